"""The fits the cost model is made of, shared by the router's online model and the planner's calibration: least
squares with no negative cost, a prefill compute fit over (new tokens, context), and robust running values."""
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES = 4
FORGET = 0.97  # a compute fit weighs its earlier samples down by this at each new one (~30 recent samples count)
OUTLIER = 4.0  # a compute sample counts at most this many times above or below the fit's own prediction
PRIOR = (5.0, 0.1, 0.08, 0.015)  # ComputeFit's (a, b, c, q) for a small model on a CPU core, until measured
# A worker's start-up steps each count as CALIBRATION_WEIGHT requests (timed alone, the best of two), from at most
# CALIBRATION_WORKERS workers of a role and MAX_CALIBRATION_STEPS steps each: 2 x 5 x 4 = 40 with kvturn's five,
# about what the last ~30 requests weigh; each measured request then decays them by FORGET.
CALIBRATION_WEIGHT = 4.0
CALIBRATION_WORKERS = 2
MAX_CALIBRATION_STEPS = 8


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray, active: list[int]) -> np.ndarray:
    """Least squares of y on the columns `active` of x, the most negative coefficient dropped and the rest refitted
    until none is negative; every column's coefficient, zero where dropped."""
    active = list(active)
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            break
        active.pop(int(np.argmin(solution)))
    coefficients = np.zeros(x.shape[1])
    coefficients[active] = solution
    return coefficients


def relative_nonnegative_fit(x: np.ndarray, ms: np.ndarray, active: list[int] | None = None) -> np.ndarray:
    """Coefficients of the columns `active` of x (all by default) fitted to `ms` by least relative squares (each
    sample's error as a share of its time, so that a few long prompts do not decide the cost of the many short
    ones), none negative."""
    return nonnegative_lstsq(x / ms[:, None], np.ones(len(ms)), list(range(x.shape[1])) if active is None else active)


def plausible_step_ms(ms: float, tokens: int) -> bool:
    """Whether a step that computed `tokens` could have taken `ms`: between 10 ns and 10 s a token."""
    return tokens > 0 and 1e-5 <= ms / tokens <= 1e4


def calibration_step(step) -> tuple[int, int, float] | None:
    """(new tokens, context, ms) of one step of a worker's start-up calibration, or None for anything that is not
    a plausible measurement: whole token counts, a finite time, between 10 ns and 10 s a token."""
    if not isinstance(step, dict):
        return None
    n, context, ms = step.get("new_tokens"), step.get("context_tokens"), step.get("ms")
    if type(n) is not int or type(context) is not int or type(ms) not in (int, float) or not math.isfinite(ms):
        return None
    if 0 < n <= 2**20 and 0 <= context <= 2**24 and plausible_step_ms(ms, n):
        return n, context, float(ms)
    return None


class ComputeFit:
    """ms to compute `n` new tokens after `context` cached ones: a + b*n + c*n*context + q*n*n/2. The last two are
    attention: the new tokens' reads of the cached context (through the block table, dearer per pair than) the
    new tokens' causal attention among themselves, so that one fit covers a prompt computed from scratch and a
    few hundred tokens on top of a long retained history. A least-squares fit that weighs recent samples most (a
    worker's speed changes with what shares its cores), pulled towards the prior (ridge) so that a few samples
    of one shape cannot make it extrapolate wildly: a run of turns on top of a history teaches q nothing, and q
    stays near its prior."""
    SCALE = np.array([1.0, 1e3, 1e4, 1e4])  # typical size of each term, so the pull is alike for all four
    RIDGE = 0.03  # weak: the samples of one run span too few shapes to outvote a stronger pull to the prior

    def __init__(self, prior: tuple[float, ...]):
        """`prior`: (a, b, c, q), or (a, b, k) for a + b*n + k*n*(context + n/2), that is c = q = k."""
        if len(prior) == 3:
            prior = (*prior, prior[2])
        self.samples = 0
        self.measured = 0  # samples of requests, not of a worker's start-up calibration
        self.prior = np.array(prior, dtype=float)
        self.coefficients = self.prior.copy()
        self._stale = False
        # The normal equations, decayed by FORGET at each sample: a turn's choice solves a 4x4 system instead of
        # refitting every sample (which cost the router ~1 ms a turn at 256 samples).
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)

    @staticmethod
    def terms(new_tokens: int, context: int) -> np.ndarray:
        """The four terms the coefficients (a, b, c, q) multiply; kvturn/plan fits the same."""
        return np.array([1.0, float(new_tokens), new_tokens * context / 1e3, new_tokens * new_tokens / 2e3])

    def add(self, new_tokens: int, context: int, ms: float, calibration: bool = False) -> None:
        """`calibration`: a step a worker timed at start-up, not a request (it counts as CALIBRATION_WEIGHT)."""
        if new_tokens > 0 and ms > 0:
            if self.measured >= MIN_SAMPLES:  # one stalled sample (a swap, a stop) may move the fit only so far
                expected = self.predict(new_tokens, context)
                ms = min(max(ms, expected / OUTLIER), expected * OUTLIER)
            x = self.terms(new_tokens, context) / self.SCALE
            weight = CALIBRATION_WEIGHT if calibration else 1.0
            self._gram = FORGET * self._gram + weight * np.outer(x, x)
            self._moment = FORGET * self._moment + weight * ms * x
            self.samples += 1
            self.measured += not calibration
            self._stale = True

    def adopt_prior(self, samples: list[tuple[int, int, float]]) -> bool:
        """Make the fit of `samples` (new tokens, context, ms: a worker's start-up calibration) the prior that the
        fit is pulled towards: least relative squares, no term negative."""
        if len({(n, context) for n, context, _ in samples}) < len(self.prior):
            return False
        x, ms = np.array([self.terms(n, context) for n, context, _ in samples]), np.array([s[2] for s in samples])
        try:
            solution = relative_nonnegative_fit(x, ms)
        except np.linalg.LinAlgError:
            return False
        if not np.all(np.isfinite(solution)) or not solution.any():
            return False
        self.prior, self._stale = solution, True
        return True

    @property
    def calibrated(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def predict(self, new_tokens: int, context: int) -> float:
        if self._stale:
            prior = self.prior * self.SCALE
            solution = np.linalg.solve(self._gram + self.RIDGE * np.eye(4), self._moment + self.RIDGE * prior)
            self.coefficients = np.maximum(solution, 0.0) / self.SCALE  # no negative cost per token
            self._stale = False
        return float(self.coefficients @ self.terms(new_tokens, context))


@dataclass(slots=True)
class Typical:
    """The median of the recent values (one slow handshake must not move it). The prior counts as one value
    for each of the first MIN_SAMPLES that are missing, so that one odd first sample cannot decide alone."""
    prior: float
    values: deque = field(default_factory=lambda: deque(maxlen=64))
    _median: float | None = None  # kept until the next value: a turn's choice reads it several times

    def add(self, value: float) -> None:
        self.values.append(value)
        self._median = None

    @property
    def value(self) -> float:
        if self._median is None:
            padding = [self.prior] * max(MIN_SAMPLES - len(self.values), 0)
            self._median = statistics.median([*self.values, *padding])
        return self._median


@dataclass(slots=True)
class Mean:
    """A running mean over the recent values, with a prior until there are any."""
    prior: float
    values: deque = field(default_factory=lambda: deque(maxlen=128))

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def value(self) -> float:
        return sum(self.values) / len(self.values) if self.values else self.prior


def median_ratio(measured: np.ndarray, fitted: np.ndarray) -> float:
    """The median of measured over fitted where the fit is positive (1 with none): the factor that puts a fit
    through the median of its samples."""
    positive = fitted > 0
    return float(np.median(measured[positive] / fitted[positive])) if positive.any() else 1.0


def fit_through_median(x: np.ndarray, ms: np.ndarray, active: list[int] | None = None) -> np.ndarray:
    """Least relative squares of `ms` on the columns `active` of x (all by default), none negative, scaled so that
    half the samples ran slower than the fit and half faster: least relative squares come out low when times
    scatter, and a plan predicts medians."""
    coefficients = relative_nonnegative_fit(x, ms, active)
    return coefficients * median_ratio(ms, x @ coefficients)


def line_through_medians(samples: list[tuple[int, float]], min_samples: int = MIN_SAMPLES
                         ) -> tuple[float, float, int]:
    """(value at 0, what each unit of x adds, the largest x fitted) of a line through the median of y at each x
    that `min_samples` samples or more share, weighed by the root of their number, none negative. With fewer than
    two such x, the median of all and a slope of 0."""
    by_x: dict[int, list[float]] = {}
    for x, y in samples:
        by_x.setdefault(x, []).append(y)
    xs = [x for x in sorted(by_x) if len(by_x[x]) >= min_samples]
    if len(xs) < 2:
        return float(np.median([y for _, y in samples])) if samples else 0.0, 0.0, max(xs, default=0)
    weights = np.sqrt([len(by_x[x]) for x in xs])
    medians = np.array([np.median(by_x[x]) for x in xs])
    design = np.array([[1.0, x] for x in xs]) * weights[:, None]
    at_zero, slope = nonnegative_lstsq(design, medians * weights, [0, 1])
    return float(at_zero), float(slope), xs[-1]


def compute_terms(chunks) -> np.ndarray:
    """`ComputeFit`'s terms of the (new tokens, context) prompt chunks one step computed: the fixed cost once."""
    terms = sum((ComputeFit.terms(n, context) for n, context in chunks), np.zeros(4))
    terms[0] = 1.0
    return terms


def fit_decode_steps(samples: list[tuple[int, int, float, float]], min_batch_spread: float = 2.0
                     ) -> tuple[tuple[float, float, float], float]:
    """((a, b, k), extra) of decode steps' ms = a + b batch + k batch longest / 1e3 + extra busy, from (batch,
    longest context, share of the step something else ran beside, ms): an engine pads a decode step's attention to
    its longest context. Batches that varied less than `min_batch_spread` cannot tell b from k, and b is left 0."""
    x = np.array([[1.0, batch, batch * longest / 1e3, busy] for batch, longest, busy, _ in samples])
    active = [0, 1, 2, 3] if np.ptp(x[:, 1]) >= min_batch_spread else [0, 2, 3]
    c = fit_through_median(x, np.array([ms for *_, ms in samples]), active)
    return (float(c[0]), float(c[1]), float(c[2])), float(c[3])
