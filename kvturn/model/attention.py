"""Paged attention on the CPU: new keys/values go into the KV pool, queries attend over their blocks in place.

The pool is layer-major (engine/kv_cache.py): one layer's keys of consecutive blocks are one contiguous tensor,
so a sequence's context is a few views of the pool, one per run of consecutive block ids, and is not copied (but for
the blocks of short runs).
Attention over several runs is one softmax over all of them: a decode concatenates its runs' scores (a few bytes
a key), a prompt chunk merges each run's output by its log-sum-exp, as FlashAttention merges the tiles of a row.

Grouped-query heads are folded into the query rows (the G query heads of a key/value head are G more rows of
queries against the same keys), never expanded into copies of the keys.
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Returns the log-sum-exp beside the output, which merging runs needs; SDPA's public API does not.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# A run of fewer consecutive blocks is gathered with the other short ones (a copy of its few bytes costs less than a
# matmul call of its own); a pool whose free blocks are all scattered then costs what it did before runs were read.
MIN_RUN_BLOCKS = 8


@dataclass(slots=True)
class Context:
    """Where a sequence's context lies in one layer's plane of the pool (slot = block id * block size + offset):
    runs of consecutive blocks, read in place, and the blocks of the short runs, gathered."""
    runs: list[tuple[int, int]]  # [start, end) slot ranges
    scattered_blocks: torch.Tensor | None = None  # int64 block ids
    scattered_tokens: int = 0  # of their slots, the first this many hold the context


def context_of(block_table, num_tokens: int, block_size: int) -> Context:
    """Where the first `num_tokens` tokens of a sequence with `block_table` lie."""
    if num_tokens <= 0:
        return Context([], None)
    num_blocks = -(-num_tokens // block_size)
    blocks = np.asarray(block_table[:num_blocks], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [num_blocks]))
    long = ends - starts >= MIN_RUN_BLOCKS
    past_end = num_blocks * block_size - num_tokens  # slots of the last block beyond the context
    runs = [(int(blocks[s]) * block_size, (int(blocks[e - 1]) + 1) * block_size)
            for s, e in zip(starts[long], ends[long])]
    if long[-1]:
        runs[-1] = (runs[-1][0], runs[-1][1] - past_end)
    short_blocks = blocks[np.repeat(~long, ends - starts)]
    if not len(short_blocks):
        return Context(runs)
    tokens = len(short_blocks) * block_size - (0 if long[-1] else past_end)
    return Context(runs, torch.from_numpy(short_blocks), tokens)


@dataclass(slots=True)
class PrefillSpan:
    """A run of new tokens of one sequence, after the tokens at `past` (none for a prompt's first chunk)."""
    token_start: int
    num_new: int
    past: Context


@dataclass(slots=True)
class AttentionMetadata:
    """What one forward step needs to read and write the paged KV pool.

    Flat token order: all prefill spans first, then one token per decode sequence.
    """
    write_slots: torch.Tensor  # int64 [T]: where each new token's K/V goes in a layer's plane of the pool
    prefills: list[PrefillSpan]
    decode_token_start: int
    decode_contexts: list[Context]  # per decode sequence: its whole context, this step's token included


def paged_attention(q, k, v, kv_pool, layer, meta: AttentionMetadata, scale: float):
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim]; returns [T, heads, dim]."""
    key_blocks, value_blocks = kv_pool[layer, 0], kv_pool[layer, 1]  # [num_blocks, block_size, kv_heads, dim]
    keys, values = key_blocks.flatten(0, 1), value_blocks.flatten(0, 1)  # views, one row a slot
    keys.index_copy_(0, meta.write_slots, k)
    values.index_copy_(0, meta.write_slots, v)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new)
        past = _pieces(key_blocks, value_blocks, span.past)
        if past:
            out[rows] = _prompt_over_past(q[rows], k[rows], v[rows], past, scale)
        else:
            out[rows] = _sdpa_causal(q[rows], k[rows], v[rows], scale)
    for i, context in enumerate(meta.decode_contexts):
        row = meta.decode_token_start + i
        out[row] = _decode(q[row], _pieces(key_blocks, value_blocks, context), scale)
    return out


def _pieces(key_blocks, value_blocks, context: Context) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each piece of a context, [n, kv_heads, dim] each: views of its runs, a copy of the rest."""
    keys, values = key_blocks.flatten(0, 1), value_blocks.flatten(0, 1)
    pieces = [(keys[start:end], values[start:end]) for start, end in context.runs]
    if context.scattered_blocks is not None:
        ids, tokens = context.scattered_blocks, context.scattered_tokens
        pieces.append((key_blocks.index_select(0, ids).flatten(0, 1)[:tokens],
                       value_blocks.index_select(0, ids).flatten(0, 1)[:tokens]))
    return pieces


def _decode(q, pieces, scale: float):
    """One new token's attention over its context: q [heads, dim] -> [heads, dim]."""
    kv_heads, dim = pieces[0][0].shape[1], pieces[0][0].shape[2]
    folded = q.view(kv_heads, -1, dim) * scale  # [kv_heads, group, dim]
    scores = [torch.matmul(folded, piece_keys.permute(1, 2, 0)) for piece_keys, _ in pieces]  # [kv_heads, group, n]
    scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out, offset = None, 0
    for _, piece_values in pieces:
        length = piece_values.shape[0]
        part = torch.matmul(probs[..., offset:offset + length], piece_values.transpose(0, 1))
        out = part if out is None else out.add_(part)
        offset += length
    return out.view(q.shape)


def _prompt_over_past(q, k, v, past, scale: float):
    """A chunk of new tokens attending to the past (in the pool, in place) and causally to themselves.
    q: [n, heads, dim]; k, v: [n, kv_heads, dim]; returns [n, heads, dim]."""
    num_new, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # rows (head-in-group, token) of each key/value head: [1, kv_heads, group * n, dim]
    folded = q.transpose(0, 1).reshape(1, kv_heads, group * num_new, dim)
    parts = [_flash_with_lse(folded, piece_keys.transpose(0, 1).unsqueeze(0), piece_values.transpose(0, 1).unsqueeze(0),
                             scale=scale) for piece_keys, piece_values in past]
    own, own_lse = _flash_with_lse(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                   v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale)
    parts.append((own.reshape(folded.shape), own_lse.reshape(1, kv_heads, group * num_new)))
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
    out = None
    for part, part_lse in parts:
        weighted = part * torch.exp(part_lse - lse).unsqueeze(-1).to(part.dtype)
        out = weighted if out is None else out.add_(weighted)
    return out.view(heads, num_new, dim).transpose(0, 1)


def _sdpa_causal(q, k, v, scale):
    """A prompt's first chunk: [n, heads, dim] attending causally to itself."""
    q, k, v = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
