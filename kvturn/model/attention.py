"""Paged attention on the CPU: new keys/values go into the KV pool, queries attend over their blocks."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """A run of new tokens of one sequence; `past_len` tokens of it are already in the pool."""
    token_start: int
    num_new: int
    past_len: int
    block_table: torch.Tensor  # int64 [num_blocks_for_context]


@dataclass(slots=True)
class AttentionMetadata:
    """What one forward step needs to read and write the paged KV pool.

    Flat token order: all prefill spans first, then one token per decode sequence.
    """
    write_block_ids: torch.Tensor  # int64 [T]: pool block receiving each new token's K/V
    write_offsets: torch.Tensor  # int64 [T]: slot inside that block
    prefills: list[PrefillSpan]
    decode_token_start: int
    decode_block_tables: torch.Tensor | None  # int64 [B, max_blocks], padded with block 0
    decode_key_mask: torch.Tensor | None  # bool [B, 1, 1, max_blocks * block_size]


def paged_attention(q, k, v, kv_pool, layer, meta: AttentionMetadata, scale: float):
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim]; returns [T, heads, dim]."""
    kv_pool[meta.write_block_ids, layer, 0, meta.write_offsets] = k
    kv_pool[meta.write_block_ids, layer, 1, meta.write_offsets] = v
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new)
        if span.past_len == 0:
            ctx_k, ctx_v, mask, causal = k[rows], v[rows], None, True
        else:
            context_len = span.past_len + span.num_new
            ctx_k = _gather(kv_pool, span.block_table, layer, 0)[:context_len]
            ctx_v = _gather(kv_pool, span.block_table, layer, 1)[:context_len]
            query_pos = torch.arange(span.past_len, context_len).unsqueeze(1)
            mask, causal = torch.arange(context_len).unsqueeze(0) <= query_pos, False
        out[rows] = _sdpa(q[rows].unsqueeze(0), ctx_k.unsqueeze(0), ctx_v.unsqueeze(0), mask, causal, scale)[0]
    if meta.decode_block_tables is not None:
        tables = meta.decode_block_tables
        batch = tables.shape[0]
        dk = kv_pool[tables, layer, 0].flatten(1, 2)  # [B, max_blocks*block_size, kv_heads, dim]
        dv = kv_pool[tables, layer, 1].flatten(1, 2)
        rows = slice(meta.decode_token_start, meta.decode_token_start + batch)
        out[rows] = _sdpa(q[rows].unsqueeze(1), dk, dv, meta.decode_key_mask, False, scale)[:, 0]
    return out


def _gather(kv_pool, block_table, layer, kv_index):
    return kv_pool[block_table, layer, kv_index].flatten(0, 1)


def _sdpa(q, k, v, mask, causal, scale):
    """Inputs [B, L, heads, dim]. Grouped-query heads are shared by the kernel, not copied: with a mask,
    copying them made the CPU kernel ~6x slower."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
