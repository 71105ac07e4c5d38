import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

# `make test`: the same examples every run, so a failure is a regression and never luck. `make fuzz`: long, random.
settings.register_profile("ci", max_examples=60, derandomize=True, print_blob=True)
settings.register_profile("fuzz", max_examples=2000, derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("KVTURN_HYPOTHESIS_PROFILE", "ci"))
os.environ.setdefault("KVTURN_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".kvturn-cache"))

# The integration tier: tests that start processes (workers, routers, redis-server, fake peers). `make test-unit`
# runs the rest alone; `make test` runs both. Here the modules all of whose tests do; elsewhere such a test carries
# @pytest.mark.integration itself.
INTEGRATION_MODULES = {"test_clients", "test_disaggregated", "test_exhaustion", "test_faults", "test_fuzz",
                       "test_many_routers", "test_observability", "test_pressure", "test_real_model",
                       "test_redis_state", "test_retention", "test_store_trust", "test_supervision", "test_trust", "test_vllm_integration",
                       "test_vllm_router", "test_worker_api"}
INTEGRATION_TESTS = {"test_plan.py::test_the_router_traces_each_finished_turn_for_the_planner"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in INTEGRATION_MODULES or f"{item.path.name}::{item.originalname}" in INTEGRATION_TESTS:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from kvturn.model.make_model import default_model_dir
    return default_model_dir("tiny")


@pytest.fixture(scope="session")
def llama_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model re-declared as an untied Llama (no q/k norm) with its own random weights."""
    from safetensors.torch import save_file

    from kvturn.model.config import ModelConfig
    from kvturn.model.make_model import random_weights
    out = tmp_path_factory.mktemp("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                  rope_theta=500000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    (out / "config.json").write_text(json.dumps(config))
    save_file(random_weights(ModelConfig.from_dir(out), seed=7), str(out / "model.safetensors"))
    return out
