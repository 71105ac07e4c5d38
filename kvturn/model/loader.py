"""Load a Hugging Face model directory (config.json + *.safetensors) into CausalLM."""
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvturn.model.config import ModelConfig
from kvturn.model.transformer import CausalLM


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.rotary.__init__(cfg.head_dim, cfg.rope_theta)
    weights = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        weights.update(load_file(path))
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing={missing[:5]} unexpected={unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype).eval()
    model.fuse()
    return model
