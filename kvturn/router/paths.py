"""Which path a turn takes, from costs the workers measured: recompute on P, pull the history D->P then
compute the new tokens on P, or compute the new tokens on D, which already holds the history.

`CostModel` learns from what every response reports (compute time against tokens computed and context,
NIXL bytes against time, and the time nobody's compute or transfer explains); `choose` is pure.
"""
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

RECOMPUTE, PULL, COMPUTE_ON_DECODE = "recompute", "pull", "compute_on_decode"
PATHS = (RECOMPUTE, PULL, COMPUTE_ON_DECODE)
POLICIES = ("adaptive", "pull", "recompute", "compute_on_decode")
MIN_SAMPLES = 4
EXPLORE_EVERY = 16  # adaptive: a path not taken for this many turns is taken once, to re-measure it...
EXPLORE_WITHIN = 1.5  # ...if its predicted cost is at most this many times the best path's
FORGET = 0.97  # a compute fit weighs its earlier samples down by this at each new one (~30 recent samples count)
SHARED_FRACTION = 0.1  # a prefill whose steps computed more than this share of other prompts' tokens was batched
SHARED_SLACK = 16  # ...and more than this many of them (another prompt's last few tokens change little)
OUTLIER = 4.0  # a compute sample counts at most this many times above or below the fit's own prediction
# What a byte of chat messages can make: a byte-level BPE token covers a byte or more, and a message adds a few
# template tokens. A rate outside this is not a history that grew (an id reused for another, compacted history).
TOKENS_PER_BYTE = (0.02, 1.5)
MIN_ADDED_BYTES = 32  # fewer added bytes say more about the template than about the text
# Tokens a turn adds beyond the text of its new messages (counted with --tokenizer): their template, the answer's
# end and the generation prompt, and the answer tokenized otherwise when resent. An overhead outside the bound is
# not a history that grew by those messages.
ADDED_OVERHEAD_PRIOR = 8.0
ADDED_OVERHEAD_BOUND = 1024
# A whole prompt counted so: its chat template's tokens per message (role markers, separators; a system prompt the
# template adds by itself spread over the messages). More than the bound a message is not a template.
TEMPLATE_TOKENS_PRIOR = 5.0
TEMPLATE_TOKENS_BOUND = 256
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


def relative_nonnegative_fit(x: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """Coefficients of every column of x fitted to `ms` by least relative squares (each sample's error as a share of
    its time, so that a few long prompts do not decide the cost of the many short ones), none negative."""
    return nonnegative_lstsq(x / ms[:, None], np.ones(len(ms)), list(range(x.shape[1])))


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


def reported_prompt_tokens(report: dict | None) -> int:
    """The prompt tokens a worker's report counts: computed, found in its cache and read from a peer."""
    return sum((report or {}).get(k) or 0 for k in ("prompt_tokens_computed", "prompt_tokens_cached",
                                                    "prompt_tokens_remote"))


def own_read_ms(role: str, timing: dict) -> float:
    """A worker's KV read time, less on P the engine steps that ran before the read was seen done
    (`kv_read_step_ms`: other prompts' work, which the queue model counts). D's keeps them: its step under way is
    part of what a handoff costs the turn."""
    read_ms = timing.get("kv_read_ms") or 0.0
    if role == "prefill":
        read_ms -= min(max(timing.get("kv_read_step_ms") or 0.0, 0.0), read_ms)
    return read_ms


def shared_steps(report: dict) -> bool:
    """Whether a worker's prefill shared its engine steps with other prompts (a batch): its time then tells
    more about the others than about itself, so neither the compute fit nor the correction learns from it."""
    timing = report.get("timing") or {}
    own = report.get("prompt_tokens_computed") or 0
    return (timing.get("prefill_shared_tokens") or 0) > SHARED_FRACTION * own + SHARED_SLACK


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


class CostModel:
    def __init__(self):
        # Priors: a small model on a CPU core; replaced by measurements after a few turns.
        self.prefill = {"prefill": ComputeFit(PRIOR), "decode": ComputeFit(PRIOR)}
        self.calibrations = {role: 0 for role in self.prefill}  # workers whose start-up timings were learned
        # NIXL reads per direction: P's read of the history from D, and D's read of the new blocks from P, which
        # waits for D's engine step under way and so costs far more per MiB than P's.
        self.read_ms_per_mib = Typical(0.5)  # D->P
        self.handoff_read_ms_per_mib = Typical(0.5)  # P->D; until one is measured, D->P's speed stands in
        self.bytes_per_token = Mean(4096.0)
        self.other_ms = {path: Typical(15.0 if path != COMPUTE_ON_DECODE else 5.0) for path in PATHS}
        self.tokens_per_char = Mean(0.3)
        # Tokens a byte of the messages added since the conversation's last turn makes: what the new turn computes
        # is a small difference of large counts, so it is estimated from the added bytes alone (see prompt_tokens).
        self.added_tokens_per_byte = Mean(0.3)
        # With the model's tokenizer the router counts the new messages' text itself; what it cannot count (their
        # template, the answer tokenized otherwise) is this, per turn.
        self.added_overhead_tokens = Typical(ADDED_OVERHEAD_PRIOR)
        self.template_tokens_per_message = Typical(TEMPLATE_TOKENS_PRIOR)  # ...and a whole prompt's, per message
        # Tokens at the end of the lease that the next prompt does not share (its last blocks: the answer's last
        # tokens, written into the prompt, tokenize otherwise): those are computed again, whatever the path.
        self.unshared_tail_tokens = Typical(0.0)
        self.prefill_request_ms = Typical(100.0)  # a prefill worker's round trip: what each queued request adds
        # Measured / modelled compute and transfer of each path's recent turns: what the fits, smooth over all
        # shapes of turn, miss for this path's own (contention on shared cores, for one).
        self.correction = {path: Typical(1.0, deque(maxlen=16)) for path in PATHS}
        self.turns_since_chosen = {path: 0 for path in PATHS}  # adaptive explores what it has not measured lately

    def observe_turn(self, choice: "PathChoice", actual_ms: float, explained_ms: float, shared: bool = False) -> None:
        """Learn from a finished turn's time to first token, of which `explained_ms` was compute and transfer
        (as the workers measured them): the time outside them and the queue (the model's own estimate of it, so
        that what the queue model misses shows there), and how far the measured compute and transfer were from
        their model. Each term learns its own part only, so that one error is not learned twice. A turn whose
        prefill was batched with other prompts (`shared`) teaches neither: its time is the batch's."""
        estimate = choice.estimate
        if actual_ms <= 0 or shared:
            return
        self.other_ms[choice.path].add(max(actual_ms - explained_ms - estimate.queue_ms, 0.0))
        if estimate.explained_ms > 0 and explained_ms > 0:
            ratio = explained_ms / estimate.explained_ms
            self.correction[choice.path].add(min(max(ratio, 0.25), 4.0))

    def chosen(self, path: str) -> None:
        for other in self.turns_since_chosen:
            self.turns_since_chosen[other] = 0 if other == path else self.turns_since_chosen[other] + 1

    def compute_ms(self, role: str, new_tokens: int, context: int) -> float:
        fit = self.prefill[role]
        if role == "decode" and not fit.calibrated:
            fit = self.prefill["prefill"]  # the same model on the same kind of machine, until D has its own
        return fit.predict(new_tokens, context)

    def prompt_tokens(self, prompt_bytes: int, known_bytes: int = 0, known_tokens: int = 0) -> int:
        """The prompt's tokens, estimated from the bytes of its messages. `known_bytes` of them (the history up to
        the last answer) are known to make `known_tokens` (the decode worker's count): only the rest is estimated,
        so that a conversation whose text tokenizes unlike the average does not misjudge its new tokens."""
        if known_tokens and prompt_bytes >= known_bytes:
            # Until a turn on top of a lease has been measured, the whole prompts' rate stands in for the prior.
            added = self.added_tokens_per_byte
            per_byte = added.value if added.values else self.tokens_per_char.value
            return known_tokens + round((prompt_bytes - known_bytes) * per_byte)
        return round(prompt_bytes * self.tokens_per_char.value)

    def added_tokens(self, counted: int) -> int:
        """The tokens a turn adds to its history, from the tokens of its new messages' text (`counted`)."""
        return max(counted + round(self.added_overhead_tokens.value), 0)

    def observe_added(self, added_tokens: int, counted: int) -> None:
        """Learn from a turn whose new messages' text made `counted` tokens that it added `added_tokens` in all
        (the decode worker's count of the prompt beyond the lease's tokens)."""
        if abs(added_tokens - counted) <= ADDED_OVERHEAD_BOUND:
            self.added_overhead_tokens.add(added_tokens - counted)

    def templated_tokens(self, counted: int, messages: int) -> int:
        """A whole prompt's tokens, from the tokens of its messages' text (`counted`) and how many there are."""
        return counted + round(messages * self.template_tokens_per_message.value)

    def observe_template(self, prompt_tokens: int, counted: int, messages: int) -> None:
        """Learn from a whole prompt of `messages` messages whose text made `counted` tokens that it made
        `prompt_tokens` (the decode worker's count) once templated."""
        if messages and 0 <= prompt_tokens - counted <= TEMPLATE_TOKENS_BOUND * messages:
            self.template_tokens_per_message.add((prompt_tokens - counted) / messages)

    def observe_prompt(self, prompt_bytes: int, prompt_tokens: int, known_bytes: int = 0,
                       known_tokens: int = 0) -> None:
        """Learn from a turn's real prompt tokens (the decode worker's count) what its bytes make."""
        low, high = TOKENS_PER_BYTE
        if prompt_bytes and prompt_tokens and low <= prompt_tokens / prompt_bytes <= high:
            self.tokens_per_char.add(prompt_tokens / prompt_bytes)
        added_bytes, added_tokens = prompt_bytes - known_bytes, prompt_tokens - known_tokens
        if known_tokens and added_bytes >= MIN_ADDED_BYTES and low <= added_tokens / added_bytes <= high:
            self.added_tokens_per_byte.add(added_tokens / added_bytes)

    def observe_reuse(self, leased_tokens: int, reused_tokens: int) -> None:
        """Learn from a turn how much of its lease (`leased_tokens`) the new prompt really shared."""
        if leased_tokens and 0 <= leased_tokens - reused_tokens < leased_tokens:
            self.unshared_tail_tokens.add(leased_tokens - reused_tokens)

    def reusable_tokens(self, leased_tokens: int) -> int:
        return max(leased_tokens - round(self.unshared_tail_tokens.value), 0) if leased_tokens else 0

    def read_ms(self, tokens: int, direction: str = "d_to_p") -> float:
        per_mib = self.read_ms_per_mib.value
        if direction == "p_to_d" and self.handoff_read_ms_per_mib.values:
            per_mib = self.handoff_read_ms_per_mib.value
        return tokens * self.bytes_per_token.value / 2**20 * per_mib

    def observe_calibration(self, role: str, steps) -> int:
        """Learn the prefill steps a `role` worker timed at start-up (its /kv/calibration); returns how many were
        taken. Only the first CALIBRATION_WORKERS workers of a role teach it (a hundred idle workers must not
        outweigh what requests measure), and their replies are checked like any peer's (calibration_step)."""
        if role not in self.prefill or self.calibrations[role] >= CALIBRATION_WORKERS:
            return 0
        taken = [step for step in map(calibration_step, steps if isinstance(steps, list) else []) if step]
        taken = taken[:MAX_CALIBRATION_STEPS]
        if not taken:
            return 0
        self.calibrations[role] += 1
        fit = self.prefill[role]
        if not fit.measured:  # the role's first worker sets the prior; the next only adds samples
            fit.adopt_prior(taken)
        for n, context, ms in taken:
            fit.add(n, context, ms, calibration=True)
        return len(taken)

    def observe_prefill(self, role: str, report: dict) -> None:
        """Learn from a worker's `kvturn` report of one request."""
        computed = report.get("prompt_tokens_computed") or 0
        context = (report.get("prompt_tokens_cached") or 0) + (report.get("prompt_tokens_remote") or 0)
        timing = report.get("timing") or {}
        if not shared_steps(report):
            self.prefill[role].add(computed, context, timing.get("prefill_compute_ms") or 0.0)
        read_bytes, read_ms = report.get("kv_read_bytes") or 0, own_read_ms(role, timing)
        # A read that P's steps overlapped teaches no speed: over shared memory what is left of it is its own cost,
        # but over a NIC the transfer runs beside the steps, and what is left would say it cost nothing.
        overlapped = role == "prefill" and (timing.get("kv_read_step_ms") or 0.0) > 0
        if read_bytes >= 2**18 and read_ms > 0 and not overlapped:
            (self.read_ms_per_mib if role == "prefill" else self.handoff_read_ms_per_mib).add(
                read_ms / (read_bytes / 2**20))
        remote = report.get("prompt_tokens_remote") or 0
        if remote and read_bytes:
            self.bytes_per_token.add(read_bytes / remote)


@dataclass(frozen=True, slots=True)
class TurnView:
    """What the router knows of a turn before it starts."""
    prompt_tokens: int  # estimated from the body
    retained_tokens: int  # whose KV the decode worker holds for this conversation (0: no live lease)
    decode_running: int  # requests the holding decode worker is already serving
    decode_available: bool  # the holding decode worker is healthy and has room for one more
    prefill_in_flight: int  # requests queued or running on the least-loaded prefill worker
    # Predicted work still queued ahead of this turn, ms (see workers.WorkerState.backlog_ms); without it the
    # prefill queue is taken as `prefill_in_flight` typical round trips.
    prefill_backlog_ms: float | None = None
    decode_backlog_ms: float = 0.0  # prefills sent to the holding decode worker that have not yet produced
    first_token_ahead: bool = False  # the router streams P's first token itself: D's part is not in the TTFT
    decode_step_ms: float = 0.0  # one engine step of the holding decode worker now (its running decodes share it)


@dataclass(frozen=True, slots=True)
class Estimate:
    queue_ms: float  # work queued ahead of the turn on its worker
    explained_ms: float  # the turn's compute and transfer in its time to first token, as modelled
    other_ms: float  # the rest of its time to first token once its worker takes it up: hops, bookkeeping
    stall_ms: float  # what the path makes the decode worker's running requests wait, summed
    work_ms: float  # the compute and transfer this turn adds to its worker's queue
    tokens_computed: int = 0  # the prompt tokens the path computes, as estimated

    def predicted_ms(self, correction: float) -> float:
        return self.queue_ms + self.explained_ms * correction + self.other_ms


@dataclass(frozen=True, slots=True)
class PathChoice:
    path: str
    predicted_ms: dict  # every path's predicted time to first token
    stall_ms: float  # what the chosen path makes the decode worker's running requests wait, summed
    estimate: Estimate  # the chosen path's, before the correction learned from measurements

    @property
    def work_ms(self) -> float:
        """The chosen path's own work on its worker (what later turns queue behind)."""
        return self.estimate.work_ms


def predict(model: CostModel, turn: TurnView) -> dict[str, Estimate]:
    """Each possible path's time to first token, the stall it inflicts on running decodes, and its work."""
    retained = model.reusable_tokens(turn.retained_tokens)
    new = max(turn.prompt_tokens - retained, 1)
    queue = turn.prefill_backlog_ms
    if queue is None:
        queue = turn.prefill_in_flight * model.prefill_request_ms.value
    handoff = 0.0 if turn.first_token_ahead else model.read_ms(new, "p_to_d")  # D reads the new blocks before its token
    full = model.compute_ms("prefill", turn.prompt_tokens, 0)
    out = {RECOMPUTE: Estimate(queue, full + handoff, model.other_ms[RECOMPUTE].value, 0.0, full, turn.prompt_tokens)}
    if turn.retained_tokens > 0:
        pull = model.read_ms(retained) + model.compute_ms("prefill", new, retained)
        out[PULL] = Estimate(queue, pull + handoff, model.other_ms[PULL].value, 0.0, pull, new)
    if turn.retained_tokens > 0 and turn.decode_available:
        # D's measured compute of a prompt includes the decodes it shares its step with; before that step the
        # turn waits for the one under way, half a step on average.
        on_decode = model.compute_ms("decode", new, retained)
        step_wait = turn.decode_step_ms / 2 if turn.decode_running else 0.0
        out[COMPUTE_ON_DECODE] = Estimate(turn.decode_backlog_ms + step_wait, on_decode,
                                          model.other_ms[COMPUTE_ON_DECODE].value, on_decode * turn.decode_running,
                                          on_decode, new)
    return out


def choose(model: CostModel, turn: TurnView, policy: str, stall_weight: float) -> PathChoice:
    """The path of least predicted time to first token plus `stall_weight` times the wait it puts on others;
    a fixed policy takes its own path whenever it is possible. Adaptive also takes, once in a while, a path it
    has not taken lately when that path is predicted not far off, so its measurements of it stay current."""
    modelled = predict(model, turn)
    predicted = {path: e.predicted_ms(model.correction[path].value) for path, e in modelled.items()}
    cost = {path: predicted[path] + stall_weight * e.stall_ms for path, e in modelled.items()}
    if policy in cost:
        path = policy
    elif policy == "adaptive":
        path = min(cost, key=cost.get)
        stale = [p for p in cost if model.turns_since_chosen[p] >= EXPLORE_EVERY
                 and cost[p] <= EXPLORE_WITHIN * cost[path]]
        if stale:
            path = max(stale, key=model.turns_since_chosen.get)
    else:
        path = PULL if PULL in cost else RECOMPUTE
    return PathChoice(path, predicted, modelled[path].stall_ms, modelled[path])
