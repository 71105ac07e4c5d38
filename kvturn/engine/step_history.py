"""What each recent forward step computed and how long it took, as the engine ran it in service: the samples
`kvturn plan` fits its cost model to (steps timed at start-up run alone, back to back, on a fresh contiguous
context, and on the dev machine ran ~1.4x faster than the same shapes in service)."""
from collections import deque
from dataclasses import dataclass

STEP_HISTORY = 20_000  # steps kept: a long bench leg's decode steps, ~3 MB


@dataclass(frozen=True, slots=True)
class StepRecord:
    started_s: float  # wall clock (time.time()): the workers of one host can be lined up on it
    ms: float
    cpu_ms: float  # the engine thread's CPU time in the step: below `ms` when it was descheduled or waited
    prompts: tuple[tuple[int, int], ...]  # (new tokens, tokens of KV before them) of each prompt chunk
    decodes: int  # sequences that decoded one token
    decode_context: int  # tokens of KV those sequences attended to, in all
    decode_context_max: int  # ...and the longest of them (a decode step's attention is padded to it)

    def public(self) -> list:
        return [round(self.started_s, 6), round(self.ms, 3), round(self.cpu_ms, 3), [list(p) for p in self.prompts],
                self.decodes, self.decode_context, self.decode_context_max]


class StepHistory:
    def __init__(self, size: int = STEP_HISTORY):
        self._steps: deque[StepRecord] = deque(maxlen=size)
        self.recorded = 0

    def record(self, step: StepRecord) -> None:
        self._steps.append(step)
        self.recorded += 1

    def since(self, started_s: float) -> tuple[list[StepRecord], bool]:
        """The steps started at or after `started_s`, oldest first, and whether older ones of that span were dropped."""
        steps = list(self._steps)  # a copy: the engine thread appends meanwhile
        kept = [s for s in steps if s.started_s >= started_s]
        dropped = len(steps) == self._steps.maxlen and bool(steps) and steps[0].started_s > started_s
        return kept, dropped


def step_record(batch: list, started_s: float, elapsed_s: float, cpu_s: float) -> StepRecord:
    """The record of a step that ran `batch` ((sequence, tokens computed) pairs, before their counts advance)."""
    prompts = tuple((num_new, seq.num_computed_tokens) for seq, num_new in batch if seq.num_output_tokens == 0)
    contexts = [seq.num_computed_tokens + num_new for seq, num_new in batch if seq.num_output_tokens > 0]
    return StepRecord(started_s, elapsed_s * 1e3, cpu_s * 1e3, prompts, len(contexts), sum(contexts),
                      max(contexts, default=0))
