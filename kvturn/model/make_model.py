"""Write a Hugging Face-format Qwen3 model directory with seeded random weights and a trained BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on Python's own standard-library sources,
so the same seed and Python version give the same bytes.
"""
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvturn.model.config import ModelConfig
from kvturn.model.transformer import CausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRAINING_MODULES = ["argparse", "asyncio/base_events", "collections/__init__", "dataclasses", "email/message",
                    "functools", "inspect", "json/decoder", "logging/__init__", "pathlib", "subprocess",
                    "textwrap", "threading", "typing", "unittest/case", "urllib/parse"]


@dataclass(frozen=True, slots=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int


# 131,072 positions: what Qwen3's RoPE base (1e6) serves; rotary angles are computed per step, not tabled.
PRESETS = {
    "tiny": Preset(4096, 256, 768, 4, 4, 2, 64, 131072),
    "small": Preset(8192, 768, 2048, 8, 12, 4, 64, 131072),
}
# What the weights' shapes depend on: a cached directory that differs here is written anew, one that differs
# elsewhere in config.json (the context length of an older kvturn) only gets its config files rewritten.
WEIGHT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "tie_word_embeddings")


def training_text() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / f"{name}.py").read_text(encoding="utf-8") for name in TRAINING_MODULES]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    return tokenizer


def config_json(preset: Preset, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
    }


def tokenizer_config_json(preset: Preset) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": preset.max_position_embeddings,
        "add_bos_token": False,
    }


def write_configs(model_dir: Path, preset: Preset, eos_id: int, pad_id: int) -> None:
    """config.json and tokenizer_config.json, each replaced atomically (a reader sees the old or the new file)."""
    for name, content in (("tokenizer_config.json", tokenizer_config_json(preset)),
                          ("config.json", config_json(preset, eos_id, pad_id))):
        staging = model_dir / f".{name}.tmp-{os.getpid()}"
        staging.write_text(json.dumps(content, indent=2))
        os.replace(staging, model_dir / name)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(cfg).state_dict().items()}
    weights = {}
    for name in sorted(shapes):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name])
        else:
            weights[name] = torch.randn(shapes[name], generator=generator) * 0.02
    return weights


def make_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write the model directory atomically (a half-written directory is never seen by a reader)."""
    out_dir = Path(out_dir)
    spec = PRESETS[preset]
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    eos_id, pad_id = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    tokenizer.save(str(staging / "tokenizer.json"))
    write_configs(staging, spec, eos_id, pad_id)
    (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "pad_token_id": pad_id}))
    save_file(random_weights(ModelConfig.from_dir(staging), seed), str(staging / "model.safetensors"),
              metadata={"format": "pt"})
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir


def cache_dir() -> Path:
    """Where kvturn keeps what it makes for itself (the embedded model, local stacks' logs): $KVTURN_CACHE_DIR."""
    return Path(os.environ.get("KVTURN_CACHE_DIR") or Path.home() / ".cache" / "kvturn")


def default_model_dir(preset: str = "tiny") -> Path:
    """The embedded model, written on first use under the cache dir, and brought up to this kvturn's preset when
    an older kvturn wrote it."""
    model_dir = cache_dir() / f"embedded-{preset}-seed0"
    spec = PRESETS[preset]
    try:
        written = json.loads((model_dir / "config.json").read_text())
        present = (model_dir / "model.safetensors").exists()
    except (OSError, ValueError):
        written, present = {}, False
    if not present or any(written.get(name) != value for name, value in config_json(spec, 0, 0).items()
                          if name in WEIGHT_FIELDS):
        make_model(model_dir, preset=preset, seed=0)
    elif written != config_json(spec, written.get("eos_token_id"), written.get("pad_token_id")):
        write_configs(model_dir, spec, written.get("eos_token_id"), written.get("pad_token_id"))
    return model_dir
