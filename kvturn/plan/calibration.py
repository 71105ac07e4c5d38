"""The cost model `kvturn plan` simulates with, fitted one way: to a `kvturn bench --compare` run. Step costs come
from the steps every worker ran in service (step_samples.py), each fit put through the median of its samples; the
requests give KV bytes per token, read time per MiB each way, and per leg the time to first token outside compute,
transfer and queues. The fit of each half of the samples (drawn at random) is kept beside it: a plan says how far
its figures move with the samples it was fitted to."""
import json
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvturn.costmodel.fits import compute_terms, fit_decode_steps, fit_through_median, line_through_medians, \
    median_ratio
from kvturn.plan import json_files, step_samples
from kvturn.plan.rows import in_flight, rows_of

KIND, SCHEMA_VERSION = "kvturn-calibration", 2
MIN_FIT_SAMPLES = 4
MIN_PROMPT_SHARE = 0.25  # of a prompt step, the least left once the decodes beside it are taken out
SCATTER_QUANTILES = np.linspace(0.025, 0.975, 20)  # of a kind's prompt steps over its fit, kept for the simulation
WorkerKind = Literal["prefill", "decode", "colocated"]
WORKER_KINDS = ("prefill", "decode", "colocated")
# Every number finite and within what any hardware could measure: a saved calibration is a file anyone may have
# written, and 1e308 in a fit would overflow the simulation's arithmetic.
MAX_MS = 1e7  # of a fit's term, a leg's overhead (~3 hours)
Ms = Annotated[float, Field(ge=0.0, le=MAX_MS, allow_inf_nan=False)]
Scatter = Annotated[float, Field(ge=1e-3, le=100.0, allow_inf_nan=False)]  # as the fit clips it
ComputeTerms = tuple[Ms, Ms, Ms, Ms]  # (a, b, c, q): ms = a + b n + c n context / 1e3 + q n^2 / 2e3
StepTerms = tuple[Ms, Ms, Ms]  # (a, b, k): ms = a + b batch + k batch longest context / 1e3


class CalibrationError(ValueError):
    pass


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Literal[2] = SCHEMA_VERSION
    compute_fits: dict[WorkerKind, ComputeTerms]  # a kind not measured takes P's
    decode_step_fit: StepTerms
    colocated_step_fit: StepTerms | None = None  # a colocated worker's own (it may have more cores); None: D's
    decode_contention_ms: Ms = 0.0  # what a decode step gains while the other role computes on the same host
    read_ms_per_mib: dict[Literal["d_to_p", "p_to_d"], Ms]
    kv_bytes_per_token: float = Field(ge=1.0, le=2.0**30, allow_inf_nan=False)
    other_ms: dict[str, Ms] = {}  # per leg, of a turn alone
    other_ms_per_request: dict[str, Ms] = {}  # ...and what each other request in flight per prompt worker adds,
    other_load_seen: Ms = 0.0  # up to the most the calibration run saw
    # quantiles of prompt steps over the fit, median 1
    step_scatter: dict[WorkerKind, Annotated[list[Scatter], Field(max_length=len(SCATTER_QUANTILES))]] = {}
    # the most tokens a prompt step attended to (its context and itself): beyond, fits guess
    context_seen: int = Field(default=0, ge=0, le=step_samples.MAX_TOKENS)
    halves: list["Calibration"] = Field(default=[], max_length=2)
    source: str = ""
    samples: dict[str, int] = {}

    @field_validator("compute_fits")
    @classmethod
    def _has_prefill(cls, fits: dict) -> dict:
        if "prefill" not in fits:
            raise ValueError("needs the prefill worker's fit, which a kind not measured takes")
        return fits

    @field_validator("halves")
    @classmethod
    def _halves_are_whole(cls, halves: list) -> list:
        if any(half.halves for half in halves):
            raise ValueError("a half of a calibration has no halves of its own")
        return halves

    def fit_for(self, worker: str) -> ComputeTerms:
        return self.compute_fits.get(worker) or self.compute_fits["prefill"]

    def step_prefill_ms(self, chunks: list[tuple[int, int]], worker: str = "prefill") -> float:
        """One step computing each (new tokens, context) chunk: the fixed cost once, the other terms per chunk."""
        a, b, c, q = self.fit_for(worker)
        return a + sum(b * n + c * n * context / 1e3 + q * n * n / 2e3 for n, context in chunks) if chunks else 0.0

    def step_fit(self, worker: str) -> StepTerms:
        return self.colocated_step_fit if worker == "colocated" and self.colocated_step_fit else self.decode_step_fit

    def decode_steps_ms(self, worker: str, count: int, batch: int, longest: int) -> float:
        """`count` decode steps of `batch` requests whose longest context is `longest`, a token more each step."""
        a, b, k = self.step_fit(worker)
        return count * (a + b * batch) + k * batch * (count * longest + count * (count - 1) / 2) / 1e3

    def scatter(self, worker: str) -> list[float]:
        return self.step_scatter.get(worker) or self.step_scatter.get("prefill") or []

    def read_ms(self, tokens: int, direction: str) -> float:
        return tokens * self.kv_bytes_per_token / 2**20 * self.read_ms_per_mib[direction]

    def other(self, leg: str, load: float = 0.0) -> float:
        """A leg's time outside compute, transfer and queues for a turn that finds `load` others in flight per
        prompt worker; a leg not measured takes the median of those that were."""
        def of_leg(per_leg: dict[str, float]) -> float:
            return per_leg.get(leg, float(np.median(list(per_leg.values()))) if per_leg else 0.0)
        return of_leg(self.other_ms) + of_leg(self.other_ms_per_request) * min(load, self.other_load_seen)

    def save(self, path: Path) -> Path:
        Path(path).write_text(json.dumps({"kind": KIND, **self.model_dump()}, indent=1))
        return Path(path)


def step_fits(legs: list[dict[str, list[step_samples.Step]]], half: int | None = None) -> dict:
    """A Calibration's fields from steps in service. A prompt step's time is taken less what the decodes beside it
    added (the simulation adds them back); D, which computes few shapes of prompt, scales P's fit."""
    prompts, decodes = step_samples.collect(legs, half)
    if len(prompts["prefill"]) < MIN_FIT_SAMPLES or len(decodes["decode"]) < MIN_FIT_SAMPLES:
        raise CalibrationError(f"too few steps in service to fit: {len(prompts['prefill'])} prompt steps of "
                               f"prefill workers, {len(decodes['decode'])} decode steps of decode workers "
                               f"(need {MIN_FIT_SAMPLES} of each): run kvturn bench --compare with a P/D leg")
    decode_step, contention = fit_decode_steps(decodes["decode"])
    colocated_step = fit_decode_steps(decodes["colocated"])[0] if len(decodes["colocated"]) >= MIN_FIT_SAMPLES else None
    own_step = {"prefill": (0.0, 0.0, 0.0), "decode": decode_step, "colocated": colocated_step or decode_step}
    fits, scatter = {}, {}
    for kind, steps in ((kind, steps) for kind, steps in prompts.items() if len(steps) >= MIN_FIT_SAMPLES):
        _, b, k = own_step[kind]
        x = np.array([compute_terms(s.prompts) for s in steps])
        ms = np.array([max(s.ms - s.decodes * (b + k * s.decode_longest / 1e3), s.ms * MIN_PROMPT_SHARE)
                       for s in steps])
        terms = np.array(fits["prefill"]) * median_ratio(ms, x @ fits["prefill"]) if kind == "decode" else \
            fit_through_median(x, ms)
        fits[kind] = tuple(float(c) for c in terms)
        ratios = ms / np.maximum(x @ terms, 1e-9)
        scatter[kind] = [float(q) for q in np.clip(np.quantile(ratios / np.median(ratios), SCATTER_QUANTILES),
                                                   1e-3, 100.0)]
    return {"compute_fits": fits, "decode_step_fit": decode_step, "colocated_step_fit": colocated_step,
            "decode_contention_ms": contention, "step_scatter": scatter,
            "context_seen": max((n + context for steps in prompts.values() for s in steps for n, context in s.prompts),
                                default=0),
            "samples": {"steps": sum(map(len, [*prompts.values(), *decodes.values()])),
                        **{kind: len(s) for kind, s in prompts.items()}}}


def read_ms_per_mib(pairs: list[tuple[float, int]]) -> float | None:
    mib = sum(nbytes for _, nbytes in pairs) / 2**20
    return sum(ms for ms, _ in pairs) / mib if mib > 0 else None


def request_fields(runs: list[dict], half: int | None = None) -> dict:
    """A Calibration's fields from the runs' requests: KV bytes a token, read rates (P's from reads no step of its
    own overlapped, as the router learns them; a direction nobody read in takes the other's), and each leg's time
    outside compute as a line through the median at each load in flight (each run's legs on their own clock)."""
    legs: dict[str, list] = {}
    for rows in map(rows_of, runs):
        for leg in dict.fromkeys(row.leg for row in rows):
            of_leg = [row for row in rows if row.leg == leg]
            legs.setdefault(leg, []).extend(step_samples.half_of([(in_flight(r, of_leg), r.other_ms) for r in of_leg],
                                                                 half))
    rows = step_samples.half_of([row for run in runs for row in rows_of(run)], half)
    per_token = [r.bytes_d_to_p / r.tokens_from_decode for r in rows if r.bytes_d_to_p and r.tokens_from_decode]
    if not per_token:
        raise CalibrationError("no request read KV back from a decode worker: run a leg with bidirectional transfer "
                               "(e.g. bidir/P-cache-off) to measure KV bytes per token and read time")
    reads = [r for r in rows if r.bytes_d_to_p]
    d_to_p = read_ms_per_mib([(r.d_to_p_ms, r.bytes_d_to_p) for r in [r for r in reads if not r.d_to_p_step_ms]
                              or reads])
    p_to_d = read_ms_per_mib([(r.p_to_d_ms, r.bytes_p_to_d) for r in rows if r.bytes_p_to_d])
    other = {leg: line_through_medians(samples, MIN_FIT_SAMPLES) for leg, samples in legs.items()}
    return {"kv_bytes_per_token": float(np.median(per_token)),
            "read_ms_per_mib": {"d_to_p": d_to_p, "p_to_d": p_to_d if p_to_d is not None else d_to_p},
            "other_ms": {leg: a for leg, (a, _, _) in other.items()},
            "other_ms_per_request": {leg: b for leg, (_, b, _) in other.items()},
            "other_load_seen": float(max((seen for _, _, seen in other.values()), default=0))}


def fitted(runs: list[dict], source: str = "") -> Calibration:
    """A calibration fitted to bench results JSONs, pooled (runs of the same hardware at different times)."""
    legs = []
    for index, run in enumerate(runs):
        which = f"run {index + 1} of {len(runs)}: " if len(runs) > 1 else ""
        if not rows_of(run):
            raise CalibrationError(f"{which}not a kvturn bench results JSON: no measured requests under 'legs'")
        for name, leg in run["legs"].items():
            legs.append(step_samples.leg_steps(leg))
            if not legs[-1]:
                raise CalibrationError(f"{which}leg {name} kept no worker steps in service: calibrate from a "
                                       "kvturn bench --compare run of this kvturn")
    requests = sum(len(rows_of(run)) for run in runs)

    def fields(half: int | None) -> dict:
        steps = step_fits(legs, half)
        return {**steps, **request_fields(runs, half), "samples": {**steps["samples"], "requests": requests}}
    try:
        halves = [validated({**fields(half), "source": f"{source} (half {half + 1})"}) for half in (0, 1)]
    except CalibrationError:
        halves = []  # too few samples to fit each half apart
    return validated({**fields(None), "halves": halves, "source": source})


def validated(fields: dict, where: str = "the fit") -> Calibration:
    """A Calibration, or a CalibrationError naming each field its schema refuses (a fit of an odd run as a file)."""
    try:
        return Calibration.model_validate(fields)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise CalibrationError(f"{where}: malformed calibration: {errors}") from None


def _read_json(path: Path):
    try:
        return json_files.read_json(path)
    except json_files.Unreadable as exc:
        raise CalibrationError(f"{path}: cannot read a calibration ({exc})") from None


def load(path: Path) -> Calibration:
    """A saved calibration, or a `kvturn bench --compare` results JSON to fit one from."""
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("kind") != KIND:
        try:
            return fitted([data], source=Path(path).name)
        except CalibrationError as exc:
            raise CalibrationError(f"{path}: {exc}") from None
    if data.get("schema_version") != SCHEMA_VERSION:
        raise CalibrationError(f"{path}: a calibration of schema version {data.get('schema_version')!r}, and this "
                               f"kvturn reads version {SCHEMA_VERSION}: calibrate again (kvturn plan --calibration "
                               "RESULTS.json --save-calibration FILE)")
    return validated({k: v for k, v in data.items() if k != "kind"}, str(path))


def load_many(paths: list[Path | str]) -> Calibration:
    """One calibration, or one fitted to several bench results JSONs pooled."""
    if len(paths) == 1:
        return load(Path(paths[0]))
    runs = [_read_json(Path(path)) for path in paths]
    if any(isinstance(run, dict) and run.get("kind") == KIND for run in runs):
        raise CalibrationError("only kvturn bench results JSONs can be pooled (a saved calibration is already "
                               "fitted: give it alone)")
    return fitted(runs, source=", ".join(map(str, paths)))
