"""The forward steps each leg's workers ran in service (the bench keeps every worker's /kv/steps in results.json), as
samples of the plan's cost model: what each prompt step computed and took, what each decode step ran and took.

A step is measured as it ran beside everything else of the leg: the other role's steps on the same host, the
router, the client, a history just read over NIXL into scattered blocks. On the dev machine such steps ran ~1.4x
the time of the same shapes timed at a worker's start-up (alone, back to back, on a context it had just computed),
and a fit to a short calibration run's steps put the prompt steps of agent-loop runs made minutes later within
7% at the median, while D was decoding eight sessions beside them. So the fits come from these steps alone, and
the slowdown beside the other role and the cost of starting idle are in them, on average, as the run saw them."""
import math
from dataclasses import dataclass

import numpy as np

from kvturn.router.paths import nonnegative_lstsq

ROLES = {"prefill": "prefill", "decode": "decode", "both": "colocated"}  # a worker's role -> the fit's kind
MIN_BATCH_SPREAD = 2.0  # requests in a decode batch: the least spread from which a per-request cost is fitted
MIN_PROMPT_SHARE = 0.25  # of a step with prompts and decodes, the least taken as the prompts' own


@dataclass(frozen=True, slots=True)
class Step:
    start_s: float
    ms: float
    prompts: tuple[tuple[int, int], ...]  # (new tokens, tokens of KV before them) of each prompt chunk
    decodes: int
    decode_context: int  # tokens of KV the decoding sequences attended to, in all
    decode_longest: int  # ...the longest of them: a decode step's attention is padded to it

    @property
    def end_s(self) -> float:
        return self.start_s + self.ms / 1e3


def _count(value, most: int) -> bool:
    return type(value) is int and 0 <= value <= most


def parse_step(raw) -> Step | None:
    """A step as a worker's /kv/steps lists it ([start_s, ms, cpu_ms, [[new, context], ...], decodes,
    decode_context, decode_context_max]), or None for anything that is not a plausible one."""
    if not isinstance(raw, list) or len(raw) != 7:
        return None
    start, ms, _, prompts, decodes, context, longest = raw
    if type(start) not in (int, float) or type(ms) not in (int, float) or not math.isfinite(start) or \
            not 0 < ms <= 600_000 or not isinstance(prompts, list) or len(prompts) > 4096:
        return None
    if not _count(decodes, 2**16) or not _count(context, 2**40) or not _count(longest, context) or \
            (decodes == 0) != (context == 0) or longest * decodes < context:
        return None
    chunks = []
    for chunk in prompts:
        if not isinstance(chunk, list) or len(chunk) != 2 or not _count(chunk[0], 2**20) or \
                not _count(chunk[1], 2**24) or chunk[0] == 0:
            return None
        chunks.append((chunk[0], chunk[1]))
    if not chunks and not decodes:
        return None
    return Step(float(start), float(ms), tuple(chunks), decodes, context, longest)


def leg_steps(run: dict) -> dict[str, list[Step]]:
    """The fit's kind of worker -> its steps in one leg's results, in the order they ran."""
    raw = run.get("worker_steps") if isinstance(run, dict) else None
    steps = {}
    for role, role_steps in (raw if isinstance(raw, dict) else {}).items():
        if role in ROLES and isinstance(role_steps, list):
            parsed = sorted(filter(None, map(parse_step, role_steps)), key=lambda s: s.start_s)
            if parsed:
                steps[ROLES[role]] = parsed
    return steps


def busy_share(step: Step, others: list[Step]) -> float:
    """Share of `step` that steps of another worker overlapped (`others` in the order they ran)."""
    covered = sum(max(0.0, min(step.end_s, o.end_s) - max(step.start_s, o.start_s)) for o in others
                  if o.start_s < step.end_s and o.end_s > step.start_s)
    return min(covered * 1e3 / step.ms, 1.0)


@dataclass(slots=True)
class StepSamples:
    """Each kind's prompt steps ((chunks, the step)) and decode-only steps (batch, its longest context, share of the
    step the other role computed, ms), pooled over the legs and runs given."""
    prompts: dict[str, list[tuple[tuple[tuple[int, int], ...], Step]]]
    decodes: dict[str, list[tuple[int, int, float, float]]]

    def count(self) -> int:
        return sum(map(len, self.prompts.values())) + sum(map(len, self.decodes.values()))


def collect(legs: list[dict[str, list[Step]]]) -> StepSamples:
    prompts: dict[str, list] = {"prefill": [], "decode": [], "colocated": []}
    decodes: dict[str, list] = {"decode": [], "colocated": []}
    for steps in legs:
        prefill = steps.get("prefill", [])
        for kind, kind_steps in steps.items():
            for step in kind_steps:
                if step.prompts:
                    prompts[kind].append((step.prompts, step))
                elif kind in decodes:
                    busy = busy_share(step, prefill) if kind == "decode" else 0.0
                    decodes[kind].append((step.decodes, step.decode_longest, busy, step.ms))
    return StepSamples(prompts, decodes)


def fit_decode_steps(samples: list[tuple[int, int, float, float]]) -> tuple[tuple[float, float, float], float]:
    """(ms per decode step = a + b batch + k batch x longest context / 1e3, ms a step gains while the other role
    computes). The engine pads a decode step's attention to the batch's longest context: fitted to the tokens
    attended to instead, a fit of a calibration run's batches of one or two put the decode steps of `concurrent`'s eight
    sessions 27% high in all, and padded within 1%."""
    x = np.array([[1.0, batch, batch * longest / 1e3, busy] for batch, longest, busy, _ in samples])
    y = np.array([ms for *_, ms in samples])
    # Batches that barely varied cannot tell a cost per request from the fixed one: the context term carries it.
    columns = [0, 1, 2, 3] if np.ptp(x[:, 1]) >= MIN_BATCH_SPREAD else [0, 2, 3]
    coefficients = nonnegative_lstsq(x, y, columns)
    return (float(coefficients[0]), float(coefficients[1]), float(coefficients[2])), float(coefficients[3])


def prompt_ms(step: Step, decode_step: tuple[float, float, float] | None) -> float:
    """A prompt step's time less a decode step of the requests that decoded in it, which the simulation adds to
    each prompt step of its own."""
    if not step.decodes or decode_step is None:
        return step.ms
    a, b, k = decode_step
    decodes_ms = a + b * step.decodes + k * step.decodes * step.decode_longest / 1e3
    return max(step.ms - decodes_ms, step.ms * MIN_PROMPT_SHARE)
