"""The forward steps each leg's workers ran in service (the bench keeps every worker's /kv/steps in results.json), as
samples of the plan's cost model. A step is measured as it ran beside everything else of the leg (the other role's
steps on the same host, the router, the client, reads over NIXL), so the slowdown beside the other role and the
cost of starting idle are in the fits, on average, as the calibration run saw them."""
import random
from dataclasses import dataclass

from kvturn.costmodel.fits import plausible_step_ms
from kvturn.plan.rows import busy_share, number_within

ROLES = {"prefill": "prefill", "decode": "decode", "both": "colocated"}  # a worker's role -> the fit's kind
MAX_TOKENS = 2**24  # of a context, or of a step


@dataclass(frozen=True, slots=True)
class Step:
    start_s: float
    ms: float
    prompts: tuple[tuple[int, int], ...]  # (new tokens, tokens of KV before them) of each prompt chunk
    decodes: int
    decode_context: int  # tokens of KV the decoding sequences attended to before the step, in all
    decode_longest: int  # ...the most of them: a decode step's attention is padded to it

    @property
    def interval(self) -> tuple[float, float]:
        return self.start_s, self.start_s + self.ms / 1e3


def _count(value, most: int, least: int = 0) -> bool:
    return type(value) is int and least <= value <= most


def parse_step(raw) -> Step | None:
    """A step as a worker's /kv/steps lists it, or None for anything that is not a plausible one: a start on the
    wall clock, whole token counts within a context's reach, and between 10 ns and 10 s a token computed."""
    if not isinstance(raw, dict):
        return None
    start, ms, cpu_ms, prompts = raw.get("start_s"), raw.get("ms"), raw.get("cpu_ms"), raw.get("prompts")
    decodes, context, longest = raw.get("decodes"), raw.get("decode_context"), raw.get("decode_longest")
    if not number_within(start, 0.0, 1e11) or not number_within(ms, 1e-3, 6e5) or not number_within(cpu_ms, 0.0, 6e5):
        return None
    if not isinstance(prompts, list) or len(prompts) > 4096 or not _count(decodes, 2**16) or \
            not _count(longest, MAX_TOKENS if decodes else 0, 1 if decodes else 0) or \
            not _count(context, decodes * longest, max(longest, decodes)):
        return None
    chunks = []
    for chunk in prompts:
        if not isinstance(chunk, list) or len(chunk) != 2 or not _count(chunk[0], MAX_TOKENS, 2) or \
                not _count(chunk[1], MAX_TOKENS):
            return None
        chunks.append((chunk[0], chunk[1]))
    if not plausible_step_ms(ms, sum(n for n, _ in chunks) + decodes):
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


@dataclass(slots=True)
class StepSamples:
    """Each kind's prompt steps, and its decode-only steps as (batch, longest context, share of the step the other
    role computed, ms), pooled over the legs and runs given."""
    prompts: dict[str, list[Step]]
    decodes: dict[str, list[tuple[int, int, float, float]]]

    def count(self) -> int:
        return sum(map(len, self.prompts.values())) + sum(map(len, self.decodes.values()))


def half_of(items: list, half: int | None) -> list:
    """All of `items`, or one half of them (0 or 1) drawn at random, the same draw every time: steps in time order
    often repeat a few shapes in turn, which every other step would split unevenly."""
    if half is None:
        return items
    first = set(random.Random(len(items)).sample(range(len(items)), len(items) // 2))
    return [item for i, item in enumerate(items) if (i in first) == (half == 0)]


def collect(legs: list[dict[str, list[Step]]], half: int | None = None) -> StepSamples:
    """The legs' steps by kind, or one half of each kind's (`half_of`)."""
    prompts: dict[str, list] = {"prefill": [], "decode": [], "colocated": []}
    decodes: dict[str, list] = {"decode": [], "colocated": []}
    for steps in legs:
        prefilling = [step.interval for step in steps.get("prefill", [])]
        for kind, kind_steps in steps.items():
            for step in kind_steps:
                if step.prompts:
                    prompts[kind].append(step)
                elif kind in decodes:
                    busy = busy_share(step.interval, prefilling) if kind == "decode" else 0.0
                    decodes[kind].append((step.decodes, step.decode_longest, busy, step.ms))
    return StepSamples({kind: half_of(steps, half) for kind, steps in prompts.items()},
                       {kind: half_of(steps, half) for kind, steps in decodes.items()})
