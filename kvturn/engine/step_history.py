"""What each recent forward step computed and how long it took, as the engine ran it in service: the samples
`kvturn plan` fits its cost model to (steps timed at start-up run alone, back to back, on a fresh contiguous
context, and so run faster than the same shapes in service)."""
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    started_s: float  # wall clock (time.time()): the workers of one host can be lined up on it
    ms: float
    cpu_ms: float  # the engine thread's CPU time in the step: below `ms` when it was descheduled or waited
    # (new tokens, tokens of KV before them) of each chunk the model ran as a prompt (more than one token)
    prompts: tuple[tuple[int, int], ...]
    decodes: int  # sequences that ran one token, on the decode path
    decode_context: int  # tokens of KV those attended to before the step, in all
    decode_longest: int  # ...and the most of them (the decode path pads every sequence's attention to it)

    def public(self) -> dict:
        return {"start_s": round(self.started_s, 6), "ms": round(self.ms, 3), "cpu_ms": round(self.cpu_ms, 3),
                "prompts": [list(p) for p in self.prompts], "decodes": self.decodes,
                "decode_context": self.decode_context, "decode_longest": self.decode_longest}


def step_record(batch: list, started_s: float, elapsed_s: float, cpu_s: float) -> StepRecord:
    """The record of a step that ran `batch` ((sequence, tokens computed) pairs, before their counts advance),
    split as the model runner splits it: a chunk of several tokens is a prompt (a preempted sequence recomputing
    its output too), one token a decode."""
    prompts = tuple((num_new, seq.num_computed_tokens) for seq, num_new in batch if num_new > 1)
    contexts = [seq.num_computed_tokens for seq, num_new in batch if num_new == 1]
    return StepRecord(started_s, elapsed_s * 1e3, cpu_s * 1e3, prompts, len(contexts), sum(contexts),
                      max(contexts, default=0))


class StepHistory:
    """The last `size` steps. Written and copied on the engine thread only."""

    def __init__(self, size: int):
        self._steps: deque[StepRecord] = deque(maxlen=size)
        self._evicted_until_s = float("-inf")  # the start of the latest step dropped for room

    def record(self, step: StepRecord) -> None:
        if len(self._steps) == self._steps.maxlen:
            self._evicted_until_s = self._steps[0].started_s
        self._steps.append(step)

    def snapshot(self) -> tuple[list[StepRecord], float]:
        """Every step kept, oldest first, and the start of the latest one dropped."""
        return list(self._steps), self._evicted_until_s


def since(snapshot: tuple[list[StepRecord], float], started_s: float) -> tuple[list[StepRecord], bool]:
    """The steps of a snapshot started at or after `started_s`, and whether some of that span were dropped."""
    steps, evicted_until_s = snapshot
    return [s for s in steps if s.started_s >= started_s], evicted_until_s >= started_s
