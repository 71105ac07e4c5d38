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


PRESETS = {
    "tiny": Preset(4096, 256, 768, 4, 4, 2, 64, 16384),
    "small": Preset(8192, 768, 2048, 8, 12, 4, 64, 16384),
}


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
    (staging / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings,
        "add_bos_token": False,
    }, indent=2))
    config = config_json(spec, eos_id, pad_id)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "pad_token_id": pad_id}))
    save_file(random_weights(ModelConfig.from_dir(staging), seed), str(staging / "model.safetensors"),
              metadata={"format": "pt"})
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir


def default_model_dir(preset: str = "tiny") -> Path:
    """The embedded model, written on first use under the cache dir."""
    from kvturn.model.pull import cache_root
    model_dir = cache_root() / f"embedded-{preset}-seed0"
    if not (model_dir / "model.safetensors").exists():
        make_model(model_dir, preset=preset, seed=0)
    return model_dir
