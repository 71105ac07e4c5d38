"""The cost model `kvturn plan` simulates with: prefill compute against tokens and context (the router's own
`ComputeFit` terms), decode step time against batch and context, how much slower each runs while the other role
is busy on the same cores, NIXL read time per MiB each way, KV bytes per token, and per deployment leg the time to
first token that is neither compute nor transfer. Fitted (fit.py) to a `kvturn bench` run on the user's own
machine, or several pooled, and saved as a small JSON, so a user calibrates once."""
import json
import reprlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvturn.plan import endpoints
from kvturn.plan.fit import (MAX_IDLE_MS, MAX_OTHER_MS, MAX_SCATTER, MAX_SCATTER_QUANTILES, MAX_RESENT_RATIO, MAX_SEEN,
                             MAX_SLOWDOWN, SEEN_SHAPES, WORKER_KINDS, CalibrationError, fitted, predict_compute)
from kvturn.plan.rows import number_within, rows_of

KIND = "kvturn-calibration"


@dataclass(slots=True)
class Calibration:
    # ms to compute n prompt tokens after `context` = a + b n + c n context / 1e3 + q n^2 / 2e3 (the router's
    # ComputeFit), per kind of worker: "prefill" (P, its core shared with D), "decode" (D, beside its running
    # decodes), "colocated"
    compute_fits: dict[str, tuple[float, float, float, float]]
    # ms of one decode step = a + b batch + k context tokens / 1e3, the context being the tokens the batch attends
    # to, or with decode_step_padded the batch times its longest context (kvturn's engine pads to it)
    decode_step_fit: tuple[float, float, float]
    # workers sharing cores (one host): "prefill_slowdown", the share by which a prompt's compute grows while the
    # other role is busy, and "decode_step_ms", what a decode step gains while a prefill runs
    contention: dict[str, float]
    read_ms_per_mib: dict[str, float]  # "d_to_p", "p_to_d"
    kv_bytes_per_token: float
    # per leg: time to first token outside compute, transfer and the workers' queues, of a request alone
    other_ms: dict[str, float]
    # The decode fit is of prompts computed alone (D's start-up steps, or its steps in service less the decodes
    # beside), not beside D's running decodes: a step of D's then costs the prompt's compute plus what the decodes
    # add (decodes_beside_prompts_ms), as on the other kinds of worker. False: a fit of D's requests, which holds
    # the decodes beside already.
    decode_fit_alone: bool = False
    # A colocated worker's own decode step (it may have more cores than D); None: D's stands in
    colocated_step_fit: tuple[float, float, float] | None = None
    # The first prompt step a worker runs after idling takes this many ms beyond the compute fit's time, which is
    # of steps back to back: fitted to the bench run's requests that found P idle with D quiet, against the
    # workers' start-up steps, and applied to every kind of worker (one machine's caches). 0 when fitted to steps
    # in service, whose fit holds it as the run saw it (and likewise the contention's prefill_slowdown).
    idle_step_ms: float = 0.0
    # ...and this many when the other role is busy on the same cores (one host); None, as saved before it was
    # fitted: (the fit's time + idle_step_ms) x (1 + prefill_slowdown)
    busy_idle_step_ms: float | None = None
    # Fitted to the workers' decode steps in service, which say the longest context; False, as saved before
    decode_step_padded: bool = False
    # A step computing prompts beside running decodes is one forward pass: its decodes add their per-request and
    # attention terms to the prompts' compute, not a second fixed cost (fitted so from steps in service); False, as
    # fitted from requests or saved before: they add a whole decode step
    decodes_share_fixed_cost: bool = False
    # Per kind of worker, how its prompt steps in service scattered about the fit: quantiles of measured over fitted
    # time, their median 1. The simulation draws each prompt step's time from them: steps of fixed times keep
    # closed-loop sessions in lockstep, which a real machine's scatter breaks up into queues. Empty (fitted from
    # requests, or saved before): every step takes the fit's time.
    step_scatter: dict[str, list[float]] = field(default_factory=dict)
    # per leg, what each other request in flight adds to other_ms (the router, the client and the workers' HTTP
    # handling share the cores with the steps), for up to other_load_seen of them per worker computing prompts, the
    # most the calibration run saw; empty, as saved before: other_ms whatever the load
    other_ms_per_request: dict[str, float] = field(default_factory=dict)
    other_load_seen: float = 0.0
    # fit.SEEN_SHAPES at the most the calibration run measured them (a shape it does not say, as saved before or
    # unknown from requests alone, is not compared with the plan's)
    seen: dict[str, float] = field(default_factory=dict)
    # Of a turn's answer, the share the next turn reuses from the decode worker's retention (fit.answer_reuse_share):
    # the rest of it is resent as tokens other than those generated, and computed again. None: not measured (saved
    # before, read off workers, or a run where no turn read from D after another), and planned as all of it
    answer_reuse_share: float | None = None
    # What an answer's text came to when resent, over the tokens generated (fit.resent_answer_ratio): a workload of
    # conversations, whose answers are counted as generated, is planned with its prompts as resent
    # (trace.resend_answers). None: not measured (saved before, read off workers, or a bench that did not count)
    resent_answer_ratio: float | None = None
    # Fitted to several bench runs pooled: per kind of worker, how far apart the runs' own fits put one prompt
    # (SPREAD_PROMPT), the slowest over the fastest less 1. A machine whose speed drifts between the runs (a worker
    # computing on cores it shares with the router and client) shows here; the pooled fit lies between them, and a
    # plan of that worker's legs is no surer than this. Empty: one run, or saved before.
    run_spread: dict[str, float] = field(default_factory=dict)
    source: str = ""
    samples: dict[str, int] = field(default_factory=dict)

    def fit_for(self, worker: str) -> tuple[float, float, float, float]:
        """(a, b, c, q) of `worker`'s compute; a kind the calibration run did not measure has P's."""
        return self.compute_fits.get(worker) or self.compute_fits["prefill"]

    def prefill_ms(self, new_tokens: int, context: int, worker: str = "prefill") -> float:
        return self.step_prefill_ms([(new_tokens, context)], worker) if new_tokens > 0 else 0.0

    def step_prefill_ms(self, chunks: list[tuple[int, int]], worker: str = "prefill") -> float:
        """One engine step computing each (new tokens, context) chunk: the fixed cost once for the step, the
        per-token and attention terms for every chunk (prompts batched into a step share one forward pass)."""
        a, b, c, q = self.fit_for(worker)
        return a + sum(b * n + c * n * context / 1e3 + q * n * n / 2e3 for n, context in chunks) if chunks else 0.0

    def after_idle_ms(self, compute_ms: float, other_role_busy: bool) -> float:
        """What the first prompt step after idling takes, whose compute the fit puts at `compute_ms`."""
        if not other_role_busy:
            return compute_ms + self.idle_step_ms
        if self.busy_idle_step_ms is not None:
            return compute_ms + self.busy_idle_step_ms
        return (compute_ms + self.idle_step_ms) * (1.0 + self.contention["prefill_slowdown"])

    def step_fit(self, worker: str) -> tuple[float, float, float]:
        """(a, b, k) of `worker`'s decode step: ms = a + b batch + k context tokens / 1e3."""
        if worker == "colocated" and self.colocated_step_fit is not None:
            return self.colocated_step_fit
        return self.decode_step_fit

    def attended(self, batch: int, context: int, longest: int) -> int:
        """The tokens a decode step of `batch` requests attends to, `context` in all and `longest` the most of
        them, as the step fit counts them."""
        return batch * longest if self.decode_step_padded else context

    def decode_steps_ms(self, worker: str, count: int, batch: int, context: int, longest: int) -> float:
        """`count` decode steps of `worker` running `batch` requests that attend to `context` tokens in all, the
        longest to `longest`; every request attends to one token more each step."""
        a, b, k = self.step_fit(worker)
        attended = self.attended(batch, context, longest)
        return count * (a + b * batch) + k * (count * attended + batch * count * (count - 1) / 2) / 1e3

    def decodes_beside_prompts_ms(self, worker: str, batch: int, context: int, longest: int) -> float:
        """What `batch` running decodes add to a step of `worker` that also computes prompts (nothing where the
        compute fit holds them already: D's, fitted to its requests)."""
        if not batch or (worker == "decode" and not self.decode_fit_alone):
            return 0.0
        step_ms = self.decode_steps_ms(worker, 1, batch, context, longest)
        return step_ms - self.step_fit(worker)[0] if self.decodes_share_fixed_cost else step_ms

    def scatter(self, worker: str) -> list[float]:
        """The quantiles a prompt step of `worker` draws its time's factor from; a kind the calibration run did not
        measure has P's; none: the fit's time."""
        return self.step_scatter.get(worker) or self.step_scatter.get("prefill") or []

    @property
    def answer_share(self) -> float:
        """The share of an answer the plan reuses next turn: as measured, or all of it; never more than comes back."""
        share = 1.0 if self.answer_reuse_share is None else self.answer_reuse_share
        return min(share, 1.0 if self.resent_answer_ratio is None else self.resent_answer_ratio)

    def read_ms(self, tokens: int, direction: str) -> float:
        return tokens * self.kv_bytes_per_token / 2**20 * self.read_ms_per_mib[direction]

    def other(self, leg: str, load: float = 0.0) -> float:
        """The leg's time outside compute, transfer and queues of a request that finds `load` others in flight per
        worker computing prompts. A leg the calibration run did not measure takes the median of those it did."""
        alone = _of_leg(self.other_ms, leg)
        return alone + _of_leg(self.other_ms_per_request, leg) * min(load, self.other_load_seen)

    def save(self, path: Path) -> Path:
        Path(path).write_text(json.dumps({"kind": KIND, **asdict(self)}, indent=2))
        return Path(path)


def _of_leg(per_leg: dict[str, float], leg: str) -> float:
    return per_leg.get(leg, float(np.median(list(per_leg.values()))) if per_leg else 0.0)


def _read_object(path: Path, expected: str) -> dict:
    """The JSON object in `path`, or a CalibrationError naming the file and what was `expected` there."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: cannot read a calibration ({exc})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: expected {expected}")
    return data


def load_many(paths: list[Path | str], secret: str | None = None) -> Calibration:
    """One calibration, or one fitted to several bench results JSONs pooled, or to running workers given by URL
    (endpoints.py; `secret`, the cluster's, lets them tell their steps in service)."""
    if not paths:
        raise CalibrationError("no calibration given")
    urls = [p for p in paths if endpoints.is_url(p)]
    if urls:
        if len(urls) < len(paths):
            raise CalibrationError("give bench results JSONs or workers' URLs, not both")
        return Calibration(**checked(endpoints.fitted(urls, secret), ", ".join(map(str, urls))))
    paths = [Path(p) for p in paths]
    if len(paths) == 1:
        return load(paths[0])
    runs = []
    for path in paths:
        data = _read_object(path, "a kvturn bench results JSON")
        if data.get("kind") == KIND:
            raise CalibrationError(f"{path}: only kvturn bench results JSONs can be pooled (a saved calibration "
                                   "is already fitted: give it alone)")
        if not rows_of(data):
            raise CalibrationError(f"{path}: not a kvturn bench results JSON: no measured requests under 'legs'")
        runs.append(data)
    source = ", ".join(map(str, paths))
    return Calibration(**checked({**fitted(runs, source=source), "run_spread": run_spread(runs)}, source))


# The prompt whose time the runs' own fits are compared at: 1000 new tokens after 3000 of history, a later turn's
# recompute of the sizes the calibration workload spans
SPREAD_PROMPT = (1000, 3000)
MAX_SPREAD = 100.0


def run_spread(runs: list[dict]) -> dict[str, float]:
    """Per kind of worker every run measured, the slowest run's fitted time for SPREAD_PROMPT over the fastest's,
    less 1 (Calibration.run_spread). A run too small to fit on its own is left out."""
    times: dict[str, list[float]] = {}
    for run in runs:
        try:
            fits = fitted(run)["compute_fits"]
        except CalibrationError:
            continue
        for kind, coefficients in fits.items():
            times.setdefault(kind, []).append(predict_compute(coefficients, [SPREAD_PROMPT]))
    return {kind: min(max(ms) / min(ms) - 1, MAX_SPREAD) for kind, ms in times.items()
            if len(ms) > 1 and min(ms) > 0}


MAX_COEFFICIENT = 1e6  # of a saved fit's term, ms per whatever it counts


def _within(least: float, most: float, optional: bool = False):
    return lambda v: (optional and v is None) or number_within(v, least, most)


def _numbers(counts: tuple[int, ...], optional: bool = False):
    """A list of one of `counts` numbers, each from 0 to MAX_COEFFICIENT (every fit is of nonnegative terms: a
    negative one would make a step take negative time)."""
    return lambda v: (optional and v is None) or (isinstance(v, list) and len(v) in counts and all(
        number_within(c, 0.0, MAX_COEFFICIENT) for c in v))


def _mapping(keys, value, required=()):
    """A JSON object whose keys are among `keys` (any string where None), holding `required`, each value passing
    `value`."""
    return lambda v: isinstance(v, dict) and set(required) <= set(v) and all(
        isinstance(k, str) and (keys is None or k in keys) and value(x) for k, x in v.items())


def _boolean(v) -> bool:
    return type(v) is bool


def _contention(v) -> bool:
    return isinstance(v, dict) and set(v) == {"prefill_slowdown", "decode_step_ms"} and number_within(
        v["prefill_slowdown"], 0.0, MAX_SLOWDOWN) and number_within(v["decode_step_ms"], 0.0, MAX_COEFFICIENT)


def _factor(v) -> bool:
    return number_within(v, 0.0, MAX_SCATTER) and v > 0


KINDS = ", ".join(WORKER_KINDS)
PER_LEG = (_mapping(None, _within(0.0, MAX_OTHER_MS)), f"map legs to numbers from 0 to {MAX_OTHER_MS:g}")
READ_DIRECTIONS = tuple(endpoints.READ_DIRECTION.values())
# Every field of a saved calibration: what its value must be, and that in words for the error that refuses it
SAVED_FIELDS = {
    "compute_fits": (_mapping(WORKER_KINDS, _numbers((3, 4)), required=("prefill",)),
                     f"map prefill (and {', '.join(WORKER_KINDS[1:])}) to 4 numbers (a, b, c, q; or 3, a, b, k, as "
                     f"saved before) from 0 to {MAX_COEFFICIENT:g}"),
    "decode_step_fit": (_numbers((3,)), f"be 3 numbers (a, b, k) from 0 to {MAX_COEFFICIENT:g}"),
    "contention": (_contention, f"map prefill_slowdown to a number from 0 to {MAX_SLOWDOWN:g} and decode_step_ms to "
                                f"one from 0 to {MAX_COEFFICIENT:g}"),
    "read_ms_per_mib": (_mapping(READ_DIRECTIONS, _within(0.0, MAX_COEFFICIENT), required=READ_DIRECTIONS),
                        f"map {' and '.join(READ_DIRECTIONS)} to numbers from 0 to {MAX_COEFFICIENT:g}"),
    "kv_bytes_per_token": (_within(1.0, endpoints.MAX_BYTES_PER_TOKEN),
                           f"be a number from 1 to {endpoints.MAX_BYTES_PER_TOKEN:g}"),
    "other_ms": PER_LEG,
    "decode_fit_alone": (_boolean, "be true or false"),
    "colocated_step_fit": (_numbers((3,), optional=True),
                           f"be 3 numbers (a, b, k) from 0 to {MAX_COEFFICIENT:g}, or null"),
    "idle_step_ms": (_within(0.0, MAX_IDLE_MS), f"be a number from 0 to {MAX_IDLE_MS:g}"),
    "busy_idle_step_ms": (_within(0.0, MAX_IDLE_MS, optional=True), f"be a number from 0 to {MAX_IDLE_MS:g}, or null"),
    "decode_step_padded": (_boolean, "be true or false"),
    "decodes_share_fixed_cost": (_boolean, "be true or false"),
    "step_scatter": (_mapping(WORKER_KINDS, lambda q: isinstance(q, list) and 0 < len(q) <= MAX_SCATTER_QUANTILES
                              and all(map(_factor, q))),
                     f"map kinds of worker ({KINDS}) to lists of 1 to {MAX_SCATTER_QUANTILES} factors within "
                     f"(0, {MAX_SCATTER:g}]"),
    "other_ms_per_request": PER_LEG,
    "other_load_seen": (_within(0.0, MAX_OTHER_MS), f"be a number from 0 to {MAX_OTHER_MS:g}"),
    "seen": (_mapping(SEEN_SHAPES, _within(1.0, MAX_SEEN)),
             f"map shapes ({', '.join(SEEN_SHAPES)}) to numbers from 1 to {MAX_SEEN:g}"),
    "answer_reuse_share": (_within(0.0, 1.0, optional=True), "be a number from 0 to 1, or null"),
    "resent_answer_ratio": (_within(0.0, MAX_RESENT_RATIO, optional=True),
                            f"be a number from 0 to {MAX_RESENT_RATIO:g}, or null"),
    "run_spread": (_mapping(WORKER_KINDS, _within(0.0, MAX_SPREAD)),
                   f"map kinds of worker ({KINDS}) to numbers from 0 to {MAX_SPREAD:g}"),
    "source": (lambda v: isinstance(v, str), "be a string"),
    "samples": (_mapping(None, lambda n: type(n) is int and n >= 0), "map names to whole numbers from 0"),
}


def checked(fields: dict, where: str) -> dict:
    """`fields` of a Calibration, saved or just fitted, if each is as SAVED_FIELDS says once written as JSON (what
    a fit makes of an odd bench run is refused as a saved file would be, not planned with and saved unloadable);
    otherwise a CalibrationError naming `where`."""
    unknown = set(fields) - set(SAVED_FIELDS)
    if unknown:
        raise CalibrationError(f"{where}: malformed calibration (unknown fields: {', '.join(sorted(unknown))})")
    data = json.loads(json.dumps(fields))
    for name, (valid, says) in SAVED_FIELDS.items():
        if name in data and not valid(data[name]):
            raise CalibrationError(f"{where}: {name} must {says}, got {reprlib.repr(data[name])}")
    return fields


def load(path: Path) -> Calibration:
    """A saved calibration, or a `kvturn bench` results JSON to fit one from."""
    data = _read_object(path, "a kvturn bench results JSON or a saved calibration")
    if data.get("kind") != KIND:
        try:
            fields = fitted(data, source=Path(path).name)
        except CalibrationError as exc:
            raise CalibrationError(f"{path}: {exc}") from None
        return Calibration(**checked(fields, str(path)))
    # A ratio saved for steps after idling (before they were found to cost fixed ms) is not carried over.
    fields = checked({k: v for k, v in data.items() if k not in ("kind", "idle_step_ratio")}, str(path))
    try:
        calibration = Calibration(**fields)
    except TypeError as exc:
        raise CalibrationError(f"{path}: malformed calibration ({exc})") from None
    if "decode_attended" in calibration.seen and not calibration.decode_step_padded:
        raise CalibrationError(f"{path}: seen says decode_attended only of a padded decode step fit "
                               "(decode_step_padded true)")
    # (a, b, k), as saved before c and q were fitted apart, is c = q = k
    calibration.compute_fits = {kind: tuple(c) if len(c) == 4 else (*c, c[-1])
                                for kind, c in calibration.compute_fits.items()}
    calibration.decode_step_fit = tuple(calibration.decode_step_fit)
    if calibration.colocated_step_fit is not None:
        calibration.colocated_step_fit = tuple(calibration.colocated_step_fit)
    return calibration
