"""A worker's step loop as the simulation sees it, scheduled as kvturn's engine schedules (kvturn/engine/scheduler.py,
checked against it in tests/test_plan_engine_match.py): each step runs every decoding request one token and chunks
of waiting prompts within the token budget, a prompt that joins others taking only what `prefill_pack_tokens`
leaves, after reading a peer's KV for the prompts it admits. Decode-only steps are taken many at a time (until a
request finishes or one arrives), so a long decode is a few events, not one per token."""
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


def _nothing(job: "Job", now: float) -> None:
    pass


@dataclass(slots=True, eq=False)  # a job is itself, whatever its counts
class Job:
    """One request on one worker: `prefill_tokens` to compute after `context` tokens of KV it has, then
    `decode_steps` tokens to generate; the callbacks are told the job and the time."""
    prefill_tokens: int
    context: int
    decode_steps: int
    flight: object = None  # the turn it serves
    on_first_token: Callable[["Job", float], None] = _nothing
    on_finished: Callable[["Job", float], None] = _nothing
    joined_step: int = 0
    started: bool = False  # some of its prompt has been computed
    compute_ms: float = 0.0  # of the steps that computed its prompt, as the engine reports a prefill's time
    read_ms: float = 0.0  # a peer's KV to read when the job is admitted, before its first step
    loaded: bool = False  # its read is done: it waits among the running for room, as the scheduler keeps it

    @property
    def prompt_tokens(self) -> int:
        return self.context + self.prefill_tokens


@dataclass(slots=True)
class Segment:
    """Decode-only steps in progress: `count` steps of `batch` requests from `start_s`."""
    start_s: float
    count: int
    batch: int
    longest: int


@dataclass(slots=True, eq=False)
class StepLoop:
    sim: object  # the Simulation: now, at(), the calibration, the deployment's limits, and the price of a step
    kind: str  # "prefill", "decode" or "colocated": which of the calibration's fits applies
    waiting: deque = field(default_factory=deque)
    prefilling: list = field(default_factory=list)
    decoding: list = field(default_factory=list)  # heap of (step it finishes at, order, job)
    steps: int = 0
    context: int = 0  # tokens of KV the decoding requests hold
    longest_base: int = 0  # the decoding requests' longest prompt less the step it joined at
    segment: Segment | None = None
    steps_in_flight: int = 0  # decode steps the step or segment now running adds to `steps` when it ends
    busy: bool = False
    token_gaps_ms: deque | None = None  # where the router records this worker's step times (decode workers)
    _order: int = 0

    def submit_prefill(self, job: Job) -> None:
        self.waiting.append(job)
        self._wake()

    def submit_decode(self, job: Job) -> None:
        if job.decode_steps <= 0:
            job.on_finished(job, self.sim.now)
            return
        running = self.busy
        if running:
            self._wake()  # a run of decode-only steps is cut at the step in progress, which the job joins after
        self._order += 1
        job.joined_step = self.steps + self.steps_in_flight
        heapq.heappush(self.decoding, (job.joined_step + job.decode_steps, self._order, job))
        self.context += job.prompt_tokens
        own = job.prompt_tokens - job.joined_step
        self.longest_base = max(self.longest_base, own) if len(self.decoding) > 1 else own
        if not running:
            self._wake()

    def _wake(self) -> None:
        """New work: start a step if idle, or cut a run of decode-only steps at the step in progress."""
        if not self.busy:
            self.busy = True
            self._step()
        elif self.segment is not None and self.segment.count > 1:
            self._cut_segment()

    def _segment_ms(self, count: int, batch: int, longest: int) -> float:
        calibration = self.sim.calibration
        return calibration.decode_steps_ms(self.kind, count, batch, longest) + count * self.sim.contention_ms(self)

    def _cut_segment(self) -> None:
        """End the run of decode-only steps at the first step not ended by now."""
        seg = self.segment
        elapsed_ms = (self.sim.now - seg.start_s) * 1e3
        low, high = 1, seg.count
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if self._segment_ms(mid, seg.batch, seg.longest) < elapsed_ms else (low, mid)
        if low < seg.count:  # a shorter segment in its place, which only its own end event ends
            self.segment = seg = Segment(seg.start_s, low, seg.batch, seg.longest)
            self.steps_in_flight = low
            self.sim.at(seg.start_s + self._segment_ms(low, seg.batch, seg.longest) / 1e3, self._end_segment, seg)

    def _step(self) -> None:
        now, batch = self.sim.now, len(self.decoding)
        longest = self.longest_base + self.steps  # the longest context a decoding request attends to now
        while self.waiting and batch + len(self.prefilling) < self.sim.deployment.max_num_seqs:
            self.prefilling.append(self.waiting.popleft())
        if not self.prefilling and batch:
            count = self.decoding[0][0] - self.steps
            self.segment = Segment(now, count, batch, longest)
            self.steps_in_flight = count
            self.sim.at(now + self._segment_ms(count, batch, longest) / 1e3, self._end_segment, self.segment)
            return
        if not self.prefilling:
            self.busy = False
            return
        reads_ms, chunks = self._admit(batch)
        ms = self.sim.prompt_step_ms(self, chunks)
        if batch:  # the decodes beside add their terms to the one forward pass, which pays one fixed cost
            calibration = self.sim.calibration
            beside = calibration.decode_steps_ms(self.kind, 1, batch, longest) - calibration.step_fit(self.kind)[0]
            ms += beside + self.sim.contention_ms(self) if beside else 0.0
        self.steps_in_flight = 1 if batch else 0
        # the step's forward pass waits for its reads, or, read layer by layer, for each layer's as it reaches it
        took_ms = self.sim.costs.pull_ms(reads_ms, ms) if reads_ms else ms
        self.sim.at(now + took_ms / 1e3, self._end_prefill_step, chunks, batch, ms)

    def _admit(self, batch: int) -> tuple[float, list[tuple[Job, int]]]:
        """(ms of the reads the step waits for, the (prompt, new tokens) chunks it computes), as the scheduler
        admits them: the running prompts first (those under way, then those a read filled, in what room the pack
        has left), then the waiting ones in turn while the token budget lasts, one whose KV a peer holds whatever
        the pack's room (its read starts, on the worker's own thread before the forward pass), one without only while
        there is room. The prompts just read join the step last, in what room is left."""
        limits = self.sim.deployment
        budget, taken, chunks = limits.max_num_batched_tokens - batch, 0, []

        def take(job: Job) -> bool:
            nonlocal budget, taken
            n = min(job.prefill_tokens, budget if job.started or not taken else
                    min(budget, limits.prefill_pack_tokens - taken))
            if n > 0:
                chunks.append((job, n))
                budget, taken = budget - n, taken + n
            return n > 0

        for job in [job for job in self.prefilling if job.started] + \
                [job for job in self.prefilling if job.loaded and not job.started]:
            take(job)
        reads_ms, read = 0.0, []
        for job in self.prefilling:
            if job.started or job.loaded:
                continue
            if budget <= 0:
                break
            if job.read_ms:
                reads_ms += job.read_ms
                job.read_ms, job.loaded = 0.0, True
                read.append(job)
            elif not take(job):
                break
        for job in read:
            take(job)
        return reads_ms, chunks

    def _end_prefill_step(self, chunks: list, batch: int, ms: float) -> None:
        now = self.sim.now
        if batch and self.token_gaps_ms is not None:
            self.token_gaps_ms.append(ms)
        self._advance(1 if batch else 0, batch, now)
        for job, n in chunks:
            job.prefill_tokens -= n
            job.context += n
            job.started = True
            job.compute_ms += ms
            if job.prefill_tokens == 0:
                self.prefilling.remove(job)
                job.on_first_token(job, now)
                job.decode_steps -= 1  # the prefill's own step sampled the first token
                self.submit_decode(job)
        self._step()

    def _end_segment(self, seg: Segment) -> None:
        if seg is not self.segment:
            return  # cut short: the shorter segment in its place has its own end event
        self.segment = None
        if self.token_gaps_ms is not None:  # the router sees the steps as gaps between streamed tokens
            gap = (self.sim.now - seg.start_s) * 1e3 / seg.count
            self.token_gaps_ms.extend([gap] * min(seg.count, self.token_gaps_ms.maxlen))
        self._advance(seg.count, seg.batch, self.sim.now)
        self._step()

    def _advance(self, count: int, batch: int, now: float) -> None:
        self.steps += count
        self.steps_in_flight = 0
        self.context += count * batch
        finished = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.decoding)
            self.context -= job.prompt_tokens + (self.steps - job.joined_step)
            finished.append(job)
        if finished:
            self.longest_base = max((job.prompt_tokens - job.joined_step for _, _, job in self.decoding), default=0)
        for job in finished:
            job.on_finished(job, now)
