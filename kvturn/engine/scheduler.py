"""Which sequences run this step and how many tokens each: chunked prefill under a token budget,
admission with prefix-cache hits, reclaiming retained blocks before preempting anyone.

Prompts are packed into one step only while the step is small. A step's time grows with every token it computes
(on a CPU from a few hundred tokens on; `benchmarks/prefill_packing.py` measures it), so a second long prompt in
the step of a first only delays the first, and the prompts then end together in groups whose time depends on
prompts that came later. A step takes on prompt tokens up to `prefill_pack_tokens` only (one prompt alone may
take the whole budget; one that joins others, from the queue or with its history just read from a peer, gets what
is left and goes on in the next steps): each prompt ends after the ones before it and its own compute, which is
what the router predicts."""
from collections import deque
from typing import Callable

from kvturn.engine.block_manager import BlockManager
from kvturn.engine.prefix_host import PrefixHostTier
from kvturn.engine.sequence import Sequence, Status


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks whose KV may come from a cache: the last token is always computed, for its logits."""
    return (num_tokens - 1) // block_size


class _Step:
    """The step being scheduled: what it runs, and the token budget and prompt tokens it has taken."""

    def __init__(self, budget: int):
        self.budget = budget
        self.prompt_tokens = 0
        self.batch: list[tuple[Sequence, int]] = []

    def take(self, seq: Sequence, num_new: int, in_prompt: bool) -> None:
        self.batch.append((seq, num_new))
        seq.prompt_started = True
        self.budget -= num_new
        self.prompt_tokens += num_new if in_prompt else 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 reclaim_retained: Callable[[Sequence], bool], prefill_pack_tokens: int | None = None,
                 prefix_host: PrefixHostTier | None = None, on_preempt: Callable[[Sequence], None] | None = None):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_pack_tokens = prefill_pack_tokens or max_num_batched_tokens
        self.reclaim_retained = reclaim_retained
        self.prefix_host = prefix_host
        self.on_preempt = on_preempt  # told before a sequence's blocks are freed (a read may be filling them)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self, admit: Callable[[Sequence, list[int]], None],
                 poll: Callable[[], None] | None = None) -> list[tuple[Sequence, int]]:
        """Returns (sequence, tokens to compute) pairs. `admit` is told of each admitted sequence and
        the chained hashes of its full blocks, and may move it to LOADING_KV. `poll` (the connector's) is called
        after this round's reads have started: over shared memory a read is done when its post returns, so a
        prompt whose history KV is in by then computes in this step, not one step later."""
        step = _Step(self.max_num_batched_tokens)
        self._take_running(list(self.running), step)
        started_reads = False
        while self.waiting and step.budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            seq = self.waiting[0]
            room = self.prefill_pack_tokens - step.prompt_tokens  # prompt tokens this step may still take on
            if room <= 0 and seq.remote is None:
                break  # (a prompt whose KV a peer holds computes nothing yet: its read may start now)
            hashes = self._admit_blocks(seq)
            if hashes is None:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            admit(seq, hashes)
            if seq.status is Status.LOADING_KV:
                self.loading.append(seq)
                started_reads = True
                continue
            self.running.append(seq)
            # A prompt joining others computes only what the pack limit leaves; it goes on in the next steps.
            num_new = min(seq.num_uncomputed_tokens, step.budget if step.prompt_tokens == 0 else min(step.budget, room))
            if num_new > 0:
                step.take(seq, num_new, in_prompt=True)
        if started_reads and poll is not None:
            before = {id(seq) for seq in self.running}
            poll()  # the reads just done move their sequences from `loading` to the end of `running`
            self._take_running([seq for seq in self.running if id(seq) not in before], step)
        return step.batch

    def _take_running(self, sequences: list[Sequence], step: "_Step") -> None:
        for seq in sequences:
            if step.budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            in_prompt = seq.num_uncomputed_tokens > 1  # a decode computes its one token
            num_new = min(seq.num_uncomputed_tokens, step.budget)
            if in_prompt and step.prompt_tokens and not seq.prompt_started:
                # A prompt whose history KV has just come from a peer starts here: like one joining from the queue
                # it takes on only what the pack limit leaves. Without this, reads that ended during a long step all
                # computed in the next one, whose length then let the next reads end together: pulls went in groups.
                num_new = min(num_new, self.prefill_pack_tokens - step.prompt_tokens)
                if num_new <= 0:
                    continue
            if not self._ensure_blocks(seq, seq.num_computed_tokens + num_new):
                continue
            step.take(seq, num_new, in_prompt)

    def _admit_blocks(self, seq: Sequence) -> list[int] | None:
        """Take the cached prefix and allocate the rest of the prompt's blocks; returns the hashes of all its
        full blocks, or None if the blocks do not fit."""
        bm = self.block_manager
        hashes = seq.full_block_hashes(self.block_size)
        reusable = hashes[:reusable_blocks(len(seq), self.block_size)]
        total_blocks = seq.blocks_needed(self.block_size)
        while True:
            hit = bm.cached_prefix(seq.token_ids, reusable)
            revived = sum(1 for b in hit if bm.blocks[b].ref_count == 0)
            if bm.num_free_blocks - revived >= total_blocks - len(hit):
                break
            if not self.reclaim_retained(seq):
                return None
        for block_id in hit:
            bm.take(block_id)
        # The pool's hits continue in the prefix cache's host tier, found before the new blocks are handed out (their
        # evictions go to the region too) and copied back after, as far as the region's checks allow.
        host_hits = self.prefix_host.lookup(seq.token_ids, reusable, len(hit), self.block_size) if self.prefix_host else []
        # In runs of consecutive ids where the pool has them free: attention reads a run in place, and a NIXL read of
        # blocks consecutive on both sides is one descriptor per layer instead of that many per block.
        seq.block_table = list(hit)
        for _ in range(total_blocks - len(hit)):
            seq.block_table.append(bm.allocate_new(after=seq.block_table[-1] if seq.block_table else None))
        restored = self.prefix_host.restore(host_hits, seq.block_table[len(hit):]) if host_hits else 0
        cached = len(hit) + restored
        for i in range(len(hit), cached):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            bm.publish(seq.block_table[i], hashes[i], tokens)
        seq.num_computed_tokens = seq.num_cached_tokens = cached * self.block_size
        seq.num_host_cached_tokens = restored * self.block_size
        seq.num_published_blocks = cached
        return hashes

    def _ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens`; reclaim leases, then preempt the newest others."""
        bm = self.block_manager
        needed = seq.blocks_needed(self.block_size, num_tokens) - len(seq.block_table)
        while needed > bm.num_free_blocks:
            if self.reclaim_retained(seq):
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        for _ in range(max(needed, 0)):
            seq.block_table.append(bm.allocate_new(after=seq.block_table[-1] if seq.block_table else None))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it recomputes from scratch when readmitted."""
        if self.on_preempt is not None:
            self.on_preempt(seq)
        self.running.remove(seq)
        self.block_manager.release_all(seq.block_table)
        seq.block_table, seq.num_computed_tokens, seq.num_published_blocks = [], 0, 0
        seq.status, seq.remote, seq.prompt_started = Status.WAITING, None, False
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish_loading(self, seq: Sequence) -> None:
        self.loading.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        for queue in (self.running, self.loading):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release_all(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
