"""Turns a scheduled batch into model inputs over the paged KV pool, runs the model, samples."""
from typing import Callable

import numpy as np
import torch

from kvturn.engine.kv_cache import KVCache
from kvturn.engine.sampling import TokenLogprob, sample_row, token_logprob
from kvturn.engine.sequence import Sequence
from kvturn.model.attention import AttentionMetadata, PrefillSpan, context_of
from kvturn.model.transformer import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], before_layer: Callable[[int], None] | None = None
            ) -> dict[Sequence, tuple[int, TokenLogprob | None]]:
        """Compute the scheduled tokens; returns a sampled token (and its logprob when asked for) for each
        sequence that reached its end. `before_layer(l)` is called before layer l (a read may still be filling
        some of the batch's history, layer by layer)."""
        prefills = [(s, n) for s, n in batch if n > 1]
        decodes = [(s, n) for s, n in batch if n == 1]
        ids, positions, spans = [], [], []
        for seq, num_new in prefills + decodes:
            start = seq.num_computed_tokens
            if num_new > 1:
                spans.append(PrefillSpan(len(ids), num_new, context_of(seq.block_table, start, self.block_size)))
            ids.extend(seq.token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
        positions_t = torch.tensor(positions)
        slots = torch.from_numpy(np.concatenate([self._write_slots(seq, n) for seq, n in prefills + decodes]))
        contexts = [context_of(seq.block_table, seq.num_computed_tokens + 1, self.block_size) for seq, _ in decodes]
        meta = AttentionMetadata(slots, spans, decode_token_start=len(ids) - len(decodes), decode_contexts=contexts)
        hidden = self.model(torch.tensor(ids), positions_t, self.kv_cache.pool, meta, before_layer)
        rows, sampled_seqs, end = [], [], 0
        for seq, num_new in prefills + decodes:
            end += num_new
            if seq.num_computed_tokens + num_new == len(seq):
                rows.append(end - 1)
                sampled_seqs.append(seq)
        if not rows:
            return {}
        logits = self.model.logits(hidden[torch.tensor(rows)])
        sampled = {}
        for i, seq in enumerate(sampled_seqs):
            token_id = sample_row(logits[i], seq.params, seq.generator)
            k = seq.params.logprobs
            sampled[seq] = (token_id, None if k is None else token_logprob(logits[i], token_id, k))
        return sampled

    def _write_slots(self, seq: Sequence, num_new: int) -> np.ndarray:
        """Each new token's slot in a layer's plane of the pool: its block's id * block size + its offset."""
        size, start = self.block_size, seq.num_computed_tokens
        positions = np.arange(start, start + num_new)
        blocks = np.asarray(seq.block_table[start // size:(start + num_new - 1) // size + 1], dtype=np.int64)
        return blocks[positions // size - start // size] * size + positions % size
