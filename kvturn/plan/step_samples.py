"""The forward steps each leg's workers ran in service (the bench keeps every worker's /kv/steps in results.json), as
samples of the plan's cost model. A step is measured as it ran beside everything else of the leg (the other role's
steps on the same host, the router, the client, reads over NIXL), so the slowdown beside the other role and the
cost of starting idle are in the fits, on average, as the calibration run saw them."""
import random
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvturn.costmodel.fits import plausible_step_ms
from kvturn.plan.rows import busy_share

ROLES = {"prefill": "prefill", "decode": "decode", "both": "colocated"}  # a worker's role -> the fit's kind
MAX_TOKENS = 2**24  # of a context, or of a step
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class Step(BaseModel):
    """A step as a worker's /kv/steps lists it: a start on the wall clock, whole token counts within a context's
    reach, and between 10 ns and 10 s a token computed."""
    model_config = ConfigDict(strict=True, frozen=True)
    start_s: float = Field(ge=0.0, le=1e11)
    ms: float = Field(ge=1e-3, le=6e5)
    cpu_ms: float = Field(ge=0.0, le=6e5)
    prompts: list[Annotated[list[Tokens], Field(min_length=2, max_length=2)]] = Field(max_length=4096)  # [n, context]
    decodes: int = Field(ge=0, le=2**16)
    decode_context: int = Field(ge=0)  # tokens of KV the decoding sequences attended to before the step, in all
    decode_longest: Tokens  # ...the most of them: a decode step's attention is padded to it

    @model_validator(mode="after")
    def _plausible(self) -> "Step":
        decodes, longest = self.decodes, self.decode_longest
        if (longest >= 1) != (decodes >= 1) or not max(longest, decodes) <= self.decode_context <= decodes * longest \
                or any(n < 2 for n, _ in self.prompts) or not plausible_step_ms(self.ms, sum(n for n, _ in self.prompts)
                                                                                 + decodes):
            raise ValueError("not a plausible step")
        return self

    @property
    def interval(self) -> tuple[float, float]:
        return self.start_s, self.start_s + self.ms / 1e3


def parse_step(raw) -> Step | None:
    """A step, or None for anything that is not a plausible one."""
    try:
        return Step.model_validate(raw)
    except ValidationError:
        return None


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


def half_of(items: list, half: int | None) -> list:
    """All of `items`, or one half of them (0 or 1) drawn at random, the same draw every time: steps in time order
    often repeat a few shapes in turn, which every other step would split unevenly."""
    if half is None:
        return items
    first = set(random.Random(len(items)).sample(range(len(items)), len(items) // 2))
    return [item for i, item in enumerate(items) if (i in first) == (half == 0)]


def collect(legs: list[dict[str, list[Step]]], half: int | None = None) -> tuple[dict, dict]:
    """(each kind's prompt steps, its decode-only steps as (batch, longest context, share of the step the other role
    computed, ms)), pooled over the legs given, or one half of each kind's (`half_of`)."""
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
    return ({kind: half_of(steps, half) for kind, steps in prompts.items()},
            {kind: half_of(steps, half) for kind, steps in decodes.items()})
