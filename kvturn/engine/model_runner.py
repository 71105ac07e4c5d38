"""Turns a scheduled batch into model inputs over the paged KV pool, runs the model, samples."""
import torch

from kvturn.engine.kv_cache import KVCache
from kvturn.engine.sampling import TokenLogprob, sample_row, token_logprob
from kvturn.engine.sequence import Sequence
from kvturn.model.attention import AttentionMetadata, PrefillSpan
from kvturn.model.transformer import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> dict[Sequence, tuple[int, TokenLogprob | None]]:
        """Compute the scheduled tokens; returns a sampled token (and its logprob when asked for) for each
        sequence that reached its end."""
        prefills = [(s, n) for s, n in batch if n > 1]
        decodes = [(s, n) for s, n in batch if n == 1]
        ids, positions, spans = [], [], []
        for seq, num_new in prefills + decodes:
            start = seq.num_computed_tokens
            if num_new > 1:
                spans.append(PrefillSpan(len(ids), num_new, start, torch.tensor(seq.block_table)))
            ids.extend(seq.token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
        positions_t = torch.tensor(positions)
        tables = [self._write_blocks(seq, n) for seq, n in prefills + decodes]
        write_blocks = torch.tensor([b for t in tables for b in t])
        meta = AttentionMetadata(write_blocks, positions_t % self.block_size, spans,
                                 decode_token_start=len(ids) - len(decodes), decode_block_tables=None,
                                 decode_key_mask=None)
        if decodes:
            meta.decode_block_tables, meta.decode_key_mask = self._decode_tables([s for s, _ in decodes])
        hidden = self.model(torch.tensor(ids), positions_t, self.kv_cache.pool, meta)
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

    def _write_blocks(self, seq: Sequence, num_new: int) -> list[int]:
        start = seq.num_computed_tokens
        return [seq.block_table[p // self.block_size] for p in range(start, start + num_new)]

    def _decode_tables(self, seqs: list[Sequence]):
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
        context = torch.empty(len(seqs), dtype=torch.int64)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table)
            context[i] = seq.num_computed_tokens + 1
        key_positions = torch.arange(max_blocks * self.block_size)
        mask = (key_positions.unsqueeze(0) < context.unsqueeze(1)).view(len(seqs), 1, 1, -1)
        return tables, mask
