"""Paged attention read in place from a layer-major pool equals attention over the context gathered in order."""
import torch
import torch.nn.functional as F

from kvturn.model.attention import MIN_RUN_BLOCKS, AttentionMetadata, PrefillSpan, context_of, paged_attention

BLOCK, HEADS, KV_HEADS, DIM, LAYERS, POOL_BLOCKS = 4, 4, 2, 8, 2, 64


def table_with_runs(*lengths: int, start: int = 3) -> list[int]:
    """Block ids in runs of consecutive ids of the given lengths, each run apart from the one before."""
    table, next_id = [], start
    for length in lengths:
        table += list(range(next_id, next_id + length))
        next_id += length + 2
    return table


def test_long_runs_are_read_in_place_and_short_ones_gathered_in_table_order():
    table = table_with_runs(MIN_RUN_BLOCKS, 1, 2, MIN_RUN_BLOCKS + 1)
    num_tokens = len(table) * BLOCK - 3  # the last block holds one token
    context = context_of(table, num_tokens, BLOCK)
    first, last = table[:MIN_RUN_BLOCKS], table[-(MIN_RUN_BLOCKS + 1):]
    assert context.runs == [(first[0] * BLOCK, (first[-1] + 1) * BLOCK), (last[0] * BLOCK, last[-1] * BLOCK + 1)]
    assert context.scattered_blocks.tolist() == table[MIN_RUN_BLOCKS:MIN_RUN_BLOCKS + 3]
    assert context.scattered_tokens == 3 * BLOCK


def test_a_context_ending_in_a_short_run_trims_its_last_block():
    context = context_of(table_with_runs(MIN_RUN_BLOCKS, 2), (MIN_RUN_BLOCKS + 1) * BLOCK + 1, BLOCK)
    assert len(context.runs) == 1 and context.scattered_tokens == BLOCK + 1


def reference(q, pool, layer, table, num_tokens, query_positions):
    """Attention of `q` at `query_positions` over the context gathered block by block, causal by position."""
    keys = pool[layer, 0][table].flatten(0, 1)[:num_tokens].transpose(0, 1).unsqueeze(0)
    values = pool[layer, 1][table].flatten(0, 1)[:num_tokens].transpose(0, 1).unsqueeze(0)
    mask = torch.arange(num_tokens).unsqueeze(0) <= torch.tensor(query_positions).unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def test_a_prompt_chunk_and_a_decode_over_fragmented_blocks_equal_attention_over_the_gathered_context():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(LAYERS, 2, POOL_BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
    chunk_table = table_with_runs(MIN_RUN_BLOCKS + 2, 1, 3, MIN_RUN_BLOCKS)  # past: 17 blocks, then 5 new tokens
    decode_table = [60, 61, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 2]
    past, new, decode_len = 17 * BLOCK + 2, 5, len(decode_table) * BLOCK - 1
    slots = [chunk_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(past, past + new)]
    slots.append(decode_table[-1] * BLOCK + (decode_len - 1) % BLOCK)
    q = torch.randn(new + 1, HEADS, DIM, generator=g)
    k, v = torch.randn(new + 1, KV_HEADS, DIM, generator=g), torch.randn(new + 1, KV_HEADS, DIM, generator=g)
    meta = AttentionMetadata(torch.tensor(slots), [PrefillSpan(0, new, context_of(chunk_table, past, BLOCK))], new,
                             [context_of(decode_table, decode_len, BLOCK)])
    layer, other_layer = 1, pool[0].clone()
    out = paged_attention(q, k, v, pool, layer, meta, DIM ** -0.5)
    assert torch.equal(pool[layer, 0].flatten(0, 1)[slots], k) and torch.equal(pool[layer, 1].flatten(0, 1)[slots], v)
    assert torch.equal(pool[0], other_layer)
    expected_chunk = reference(q[:new], pool, layer, chunk_table, past + new, list(range(past, past + new)))
    expected_decode = reference(q[new:], pool, layer, decode_table, decode_len, [decode_len - 1])
    assert torch.allclose(out[:new], expected_chunk, atol=1e-5)
    assert torch.allclose(out[new:], expected_decode, atol=1e-5)
