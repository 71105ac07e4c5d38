"""Our forward pass against transformers' independent implementation of the same architecture."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvturn.model.attention import AttentionMetadata, Context, PrefillSpan
from kvturn.model.loader import load_model


def our_logits(model, token_ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    cfg = model.config
    num_blocks = -(-len(token_ids) // block_size)
    pool = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    positions = torch.arange(len(token_ids))
    meta = AttentionMetadata(positions, [PrefillSpan(0, len(token_ids), Context([]))], len(token_ids), [])
    with torch.no_grad():
        return model.logits(model(token_ids, positions, pool, meta))


@pytest.mark.parametrize("which", ["tiny_model_dir", "llama_model_dir"])
def test_logits_match_transformers(which, request):
    model_dir = request.getfixturevalue(which)
    ours = load_model(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    expected_class = {"tiny_model_dir": "Qwen3ForCausalLM", "llama_model_dir": "LlamaForCausalLM"}[which]
    assert type(reference).__name__ == expected_class
    tokens = torch.randint(0, ours.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens.unsqueeze(0)).logits[0]
    assert (our_logits(ours, tokens) - expected).abs().max().item() <= 1e-4
