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
