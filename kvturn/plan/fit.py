"""Fitting the plan's cost model to a `kvturn bench` results JSON (or several, pooled). The workers' steps in
service (step_samples.py), when the bench kept them, give the compute and decode step fits; otherwise the
per-request rows do: how many prompt tokens each worker computed and in how long, TTFT and TPOT, and when each
request ran, from which the batch, and whether the other role was busy on the shared cores, are worked out. The
requests give the rest either way: what was read each way, and the time outside compute and transfer."""
import numpy as np

from kvturn.bench.catalog import LEGS
from kvturn.config import EngineConfig, default_of
from kvturn.plan import step_samples
from kvturn.plan.rows import Row, after_idle, busy_share, decode_interval, prefill_interval, rows_of
from kvturn.costmodel.fits import ComputeFit, calibration_step, nonnegative_lstsq, relative_nonnegative_fit

BLOCK_SIZE = default_of(EngineConfig, "block_size")
MIN_FIT_SAMPLES = 4
QUIET_SHARE = 0.25  # a prompt computed with the other role busy for less than this is taken as uncontended
MAX_SLOWDOWN = 3.0
MIN_BATCH_SPREAD = 2.0  # requests in a decode batch: the least spread from which a per-request cost is fitted
MAX_IDLE_MS = 1000.0  # what starting a step idle may add
MAX_BATCHED_TOKENS = default_of(EngineConfig, "max_num_batched_tokens")  # a step's token budget (chunked prefill)
MIN_PROMPT_SHARE = 0.25  # of a measured prompt step, the least left once the decodes beside or starting idle are out
SCATTER_QUANTILES = np.linspace(0.025, 0.975, 20)  # of a kind's prompt steps over its fit, kept for the simulation
MAX_SCATTER_QUANTILES = 1000
MAX_SCATTER = 100.0  # the most a saved quantile may say a step took over its fit
MAX_OTHER_MS = 1e6  # of a saved time outside compute, or what a request in flight adds to it
WORKER_KINDS = ("prefill", "decode", "colocated")  # the kinds of worker a compute fit is for
# The shapes a calibration run measured, at their most, that a plan compares with the steps it simulates: new tokens
# of one prompt computed in a step, the tokens a prompt's step attends to (its context and itself), the requests in a
# decode step, and the tokens a decode step attends to (the batch times its longest context where the engine pads
# to it, else their sum). Beyond them the fits are extrapolated.
SEEN_SHAPES = ("prompt_tokens", "prompt_context", "decode_batch", "decode_attended")
MAX_SEEN = 2.0**40
MAX_RESENT_RATIO = 64.0  # the most an answer's text may come to, over the tokens generated


class CalibrationError(ValueError):
    pass


Chunks = tuple[tuple[int, int], ...]  # (new tokens, context) of each prompt computed in the same steps


def features(chunks: Chunks) -> np.ndarray:
    """The router's compute terms (`ComputeFit`'s) for prompts computed together: the fixed cost once, for the
    steps they shared, the per-token and attention terms for each."""
    total = np.zeros(4)
    for new, context in chunks:
        total += ComputeFit.terms(new, context)
    total[0] = 1.0
    return total


def fit_compute(samples: list[tuple[Chunks, float]]) -> tuple[float, float, float, float]:
    """The router's compute model (`ComputeFit`'s terms), fitted to relative error: most turns of an agent compute
    a few hundred tokens, and an absolute fit would let the few long first prompts decide their cost. A coefficient
    that comes out negative is dropped and the rest refitted (no negative cost per token)."""
    x = np.array([features(chunks) for chunks, _ in samples])
    y = np.array([ms for _, ms in samples])
    coefficients = relative_nonnegative_fit(x, y)
    return tuple(float(c) for c in coefficients)


def fit_through_median(samples: list[tuple[Chunks, float]]) -> tuple[float, float, float, float]:
    """`fit_compute`, scaled so that half the samples ran slower than the fit and half faster. Least relative
    squares come out low when times scatter, by ~1.5 x their variance in logs (2% at a spread of 0.11, as P's steps
    in service on the dev machine; 6% at 0.2), and the plan predicts medians."""
    coefficients = fit_compute(samples)
    ratios = _ratios(samples, coefficients)
    scale = float(np.median(ratios)) if len(ratios) else 1.0
    return tuple(c * scale for c in coefficients)


def _ratios(samples: list[tuple[Chunks, float]], coefficients) -> np.ndarray:
    """Each sample's time over what the fit puts it at, where the fit is positive."""
    return np.array([ms / fitted for chunks, ms in samples if (fitted := predict_compute(coefficients, chunks)) > 0])


def predict_compute(coefficients, chunks: Chunks) -> float:
    return float(np.dot(coefficients, features(chunks)))


def _new_tokens_on_decode(row: Row, previous: Row | None) -> int | None:
    """What D computed on the compute-on-decode path: what D said it computed, or, from a bench that did not record
    it, the prompt beyond the full blocks it retained last turn (which assumes the whole answer came back as it was
    generated)."""
    if row.decode_computed is not None:
        return row.decode_computed
    if previous is None:
        return None
    retained = (previous.input_tokens + previous.output_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    return row.input_tokens - retained if 0 < retained < row.input_tokens else None


Legs = dict[str, list[Row]] | list[tuple[str, list[Row]]]  # each leg's rows; a list when runs are pooled


def _legs(by_leg: Legs) -> list[tuple[str, list[Row]]]:
    return list(by_leg.items()) if isinstance(by_leg, dict) else by_leg


def compute_samples(by_leg: Legs, colocated_step: tuple[float, float, float] | None = None
                    ) -> dict[str, list[tuple[Chunks, float, float, bool]]]:
    """(the prompts computed together, ms, share of the time the other role was busy, whether they found the worker
    idle) per kind of worker. Prompts computed in the same steps each report the steps' whole time: those reporting
    the same time over the same span make one sample, which started after idling if any of them found the worker
    idle; two prompts computed apart in equal times stay two.

    A colocated worker's prompt steps also ran its decodes; with `colocated_step` (its decode step fit) their part
    is taken out, since the simulation adds a step of the decodes running to each prompt step."""
    grouped: dict[tuple, list] = {}
    for group, (leg, leg_rows) in enumerate(_legs(by_leg)):
        colocated = leg in LEGS and LEGS[leg].mode == "colocated"
        decoding = [decode_interval(r) for r in leg_rows]
        prefilling = [prefill_interval(r) for r in leg_rows]
        on_decode = [_decode_compute_interval(r) for r in leg_rows if r.decode_compute_ms > 0]
        previous: dict[str, Row] = {}
        for row in sorted(leg_rows, key=lambda r: (r.conversation_id, r.turn)):
            if row.computed and row.prefill_compute_ms > 0:
                interval = prefill_interval(row)
                busy = 0.0 if colocated else busy_share(interval, decoding, decode_interval(row))
                others = [i for i in prefilling + (decoding if colocated else []) if i != interval]
                key = ("colocated" if colocated else "prefill", group, round(row.prefill_compute_ms, 1))
                beside = decodes_beside(interval, row, leg_rows) if colocated and colocated_step else None
                _share_steps(grouped, key, interval, (row.computed, row.input_tokens - row.computed, busy,
                                                      after_idle(row.start_ms, interval[0], others), beside))
            new = _new_tokens_on_decode(row, previous.get(row.conversation_id))
            if row.decode_compute_ms > 0 and new:
                interval = _decode_compute_interval(row)
                others = [i for i in decoding + on_decode if i != interval and i != decode_interval(row)]
                key = ("decode", group, round(row.decode_compute_ms, 1))
                _share_steps(grouped, key, interval, (new, row.input_tokens - new, 0.0,
                                                      after_idle(row.start_ms, interval[0], others), None))
            previous[row.conversation_id] = row
    samples: dict[str, list] = {"prefill": [], "decode": [], "colocated": []}
    for (kind, _, ms), prompts in ((key, prompts) for key, spans in grouped.items() for _, prompts in spans):
        chunks = tuple((new, context) for new, context, *_ in prompts)
        busy, idle = max(prompt[2] for prompt in prompts), any(prompt[3] for prompt in prompts)
        besides = [prompt[4] for prompt in prompts if prompt[4] is not None]
        if besides:  # the prompts shared their steps, and so the decodes beside them
            batch, context = max(besides)
            steps = -(-sum(new for new, _ in chunks) // MAX_BATCHED_TOKENS)
            a, b, k = colocated_step
            # A batch under one is a decode beside part of the time: the step's fixed cost counts for that part.
            decodes_ms = steps * (a * min(batch, 1.0) + b * batch + k * context / 1e3)
            ms = max(ms - decodes_ms, ms * MIN_PROMPT_SHARE)
        samples[kind].append((chunks, ms, busy, idle))
    return samples


def _share_steps(grouped: dict[tuple, list], key: tuple, interval: tuple[float, float], prompt: tuple) -> None:
    """Add `prompt` to the prompts of `key` (a worker and a compute time) computed over most of the same span, or
    as computed in steps of its own."""
    spans = grouped.setdefault(key, [])
    for span, prompts in spans:
        if busy_share(interval, [span]) > 0.5:
            prompts.append(prompt)
            return
    spans.append((interval, [prompt]))


def decodes_beside(interval: tuple[float, float], row: Row, leg_rows: list[Row]) -> tuple[float, float]:
    """(mean batch, mean tokens of context) of the other requests decoding while `interval` ran, weighted by the
    share of it they overlapped."""
    batch = context = 0.0
    for other in leg_rows:
        if other is not row:
            share = busy_share(interval, [decode_interval(other)])
            batch += share
            context += share * (other.input_tokens + other.output_tokens / 2)
    return batch, context


def _decode_compute_interval(row: Row) -> tuple[float, float]:
    """When D computed the prompt's new tokens: just before its decode began."""
    start, _ = decode_interval(row)
    return start - row.decode_compute_ms, start


def start_up_samples(results: dict) -> dict[str, list[tuple[Chunks, float, float]]]:
    """The prefill steps each leg's workers timed at start-up (the bench keeps their /kv/calibration), per kind of
    worker, as samples computed alone, back to back: prompts from scratch and on a long context, which the requests
    of one short run span too few of."""
    kinds = step_samples.ROLES
    samples: dict[str, list] = {kind: [] for kind in kinds.values()}
    for run in (results.get("legs") or {}).values():
        steps = run.get("worker_calibration") if isinstance(run, dict) else None
        for role, role_steps in (steps if isinstance(steps, dict) else {}).items():
            if role in kinds and isinstance(role_steps, list):
                for n, context, ms in filter(None, map(calibration_step, role_steps)):
                    samples[kinds[role]].append((((n, context),), ms, 0.0))
    return samples


def idle_step_ms(requests: list[tuple[Chunks, float, float, bool]],
                 start_up: list[tuple[Chunks, float, float]]) -> float:
    """How much longer P computed a prompt it started idle, with D quiet, than its steps back to back predict: the
    median of those requests' time beyond a fit of the start-up steps (timed back to back) and of the requests that
    started while P computed another; 0 with too few of either. Idle, a CPU's caches fill with what ran meanwhile
    (request parsing, tokenizing, others' processes) and the first step reloads them: on the 2-core dev machine
    ~9-17 ms, hardly more for a long prompt than for a short one."""
    quiet = [(chunks, ms, idle) for chunks, ms, busy, idle in requests if busy < QUIET_SHARE]
    warm = [sample[:2] for sample in start_up] + [(chunks, ms) for chunks, ms, idle in quiet if not idle]
    if len(warm) < MIN_FIT_SAMPLES:
        return 0.0
    back_to_back = fit_compute(warm)
    extra = [ms - predict_compute(back_to_back, chunks) for chunks, ms, idle in quiet if idle]
    return float(np.clip(np.median(extra), 0.0, MAX_IDLE_MS)) if len(extra) >= MIN_FIT_SAMPLES else 0.0


def back_to_back_ms(ms: float, idle: bool, idle_ms: float) -> float:
    """A measured prompt's time as a step back to back would have taken: less the cost of starting idle."""
    return max(ms - idle_ms, ms * MIN_PROMPT_SHARE) if idle else ms


def fit_with_contention(points: list[tuple[Chunks, float, float, bool]], idle_ms: float
                        ) -> tuple[tuple, float, float | None]:
    """P's compute on cores it shares with D, from (prompts, ms, share of the time D was busy, whether they found P
    idle): (the compute fit of the prompts computed with D quiet, back to back (one started idle counts less
    `idle_ms`); the share by which a prompt's time grew per unit of the time D was busy, of prompts computed back to
    back; the ms beyond the fit of a prompt P started idle while D was busy, None with too few of them).

    Idle, P's caches fill with what D runs on the same machine, and its first step reloads them: on the 2-core dev
    machine such a step took ~7-23 ms beyond the fit whatever its size (1.27x for ~60-100 ms prompts, 1.03x for
    200+ ms ones), while one back to back with D busy took ~1.03-1.06x."""
    quiet = [(chunks, back_to_back_ms(ms, idle, idle_ms)) for chunks, ms, busy, idle in points if busy < QUIET_SHARE]
    base = fit_compute(quiet if len(quiet) >= MIN_FIT_SAMPLES else
                       [(chunks, back_to_back_ms(ms, idle, idle_ms)) for chunks, ms, _, idle in points])
    busy = [(ms, fitted, share, idle) for chunks, ms, share, idle in points
            if share >= 1 - QUIET_SHARE and (fitted := predict_compute(base, chunks)) > 0]
    queued = [(ms / fitted, share) for ms, fitted, share, idle in busy if not idle] or \
             [(back_to_back_ms(ms, idle, idle_ms) / fitted, share) for ms, fitted, share, idle in busy]
    growth = [(ratio - 1) / share for ratio, share in queued]
    slowdown = float(np.clip(np.median(growth), 0.0, MAX_SLOWDOWN)) if growth else 0.0
    woken = [ms - fitted for ms, fitted, _, idle in busy if idle]
    busy_idle_ms = float(np.clip(np.median(woken), 0.0, MAX_IDLE_MS)) if len(woken) >= MIN_FIT_SAMPLES else None
    return base, slowdown, busy_idle_ms


def fit_decode_step(by_leg: Legs) -> tuple[tuple[float, float, float], float]:
    """(ms per decode step = a + b batch + k context / 1e3, ms a step gains while a prefill runs beside it), from
    TPOT on the P/D legs (a colocated worker's TPOT holds its own prefills, which the simulation adds itself)."""
    features, tpot = [], []
    for leg, leg_rows in _legs(by_leg):
        if leg in LEGS and LEGS[leg].mode == "colocated":
            continue
        prefilling = [prefill_interval(r) for r in leg_rows]
        for row in leg_rows:
            if row.tpot_ms:
                batch, context = batch_during_decode(row, leg_rows)
                busy = busy_share(decode_interval(row), prefilling, prefill_interval(row))
                features.append([1.0, batch, context / 1e3, busy])
                tpot.append(row.tpot_ms)
    if len(tpot) < MIN_FIT_SAMPLES:
        raise CalibrationError("too few P/D requests with more than one output token to fit the decode step time")
    return _decode_step_lstsq(np.array(features), np.array(tpot))


def _decode_step_lstsq(x: np.ndarray, ms: np.ndarray, relative: bool = False
                       ) -> tuple[tuple[float, float, float], float]:
    """((a, b, k), contention) of ms = a + b x[:, 1] + k x[:, 2] + contention x[:, 3], none negative; `relative`:
    fitted to relative error, then put through the median of the samples."""
    active = _batch_columns(x)
    if not relative:
        coefficients = nonnegative_lstsq(x, ms, active)
    else:
        coefficients = nonnegative_lstsq(x / ms[:, None], np.ones(len(ms)), active)
        coefficients *= _median_ratio(ms, x @ coefficients)
    return tuple(float(c) for c in coefficients[:3]), float(coefficients[3])


def _batch_columns(x: np.ndarray) -> list[int]:
    """The columns of a decode step fit (x[:, 1] the batch) to fit: batches that barely varied cannot tell a cost
    per request from the fixed one, and the context term carries it."""
    columns = list(range(x.shape[1]))
    return columns if np.ptp(x[:, 1]) >= MIN_BATCH_SPREAD else [c for c in columns if c != 1]


def fit_decode_steps(samples: list[tuple[int, int, float, float]]) -> tuple[tuple[float, float, float], float]:
    """(ms per decode step = a + b batch + k batch x longest context / 1e3, ms a step gains while the other role
    computes), from decode-only steps (batch, longest context, share of the step the other role computed, ms).
    The engine pads a decode step's attention to the batch's longest context: fitted to the tokens attended to
    instead, a fit of a calibration run's batches of one or two put the decode steps of `concurrent`'s eight
    sessions 27% high in all, and padded within 1%."""
    x = np.array([[1.0, batch, batch * longest / 1e3, busy] for batch, longest, busy, _ in samples])
    ms = np.array([ms for *_, ms in samples])
    # Relative error, as the compute fits: an absolute fit lets the long steps of long contexts decide, and there
    # a request's own cost and its attention's are told apart by the few batch sizes one run saw. Fitted so to three
    # calibration runs' batches of 1-4, mostly at 8-9k tokens, D's decode steps in `concurrent` (batches of up to 8
    # at 2-3k) ran 0.85 of the fit in all, 0.63-1.00 by leg; fitted relatively, 1.00 in all (2026-12-02).
    return _decode_step_lstsq(x, ms, relative=True)


def fit_colocated_decode_steps(samples: list[tuple[int, int, float, float]], decode_step: tuple[float, float, float]
                               ) -> tuple[float, float, float]:
    """A colocated worker's decode step (a, b, k) from its decode-only steps: its own fixed cost, and D's
    per-request and attention terms scaled by one factor (the same engine, on more cores). One colocated leg a
    calibration run decodes batches of up to four at nearly the same longest context, which cannot tell a
    request's own cost from its attention's: fitted alone to three calibration runs' such steps, the colocated
    worker's decode steps in `concurrent` (batches of up to 8 at 2-3k tokens) ran 0.72 of the fit; so, 0.92
    (2026-12-02)."""
    _, b, k = decode_step
    if b == k == 0:  # D's steps said nothing of batch or context: no shape to borrow
        return fit_decode_steps(samples)[0]
    x = np.array([[1.0, b * batch + k * batch * longest / 1e3] for batch, longest, _, _ in samples])
    ms = np.array([ms for *_, ms in samples])
    coefficients = nonnegative_lstsq(x / ms[:, None], np.ones(len(ms)), [0, 1])
    own, scale = coefficients * _median_ratio(ms, x @ coefficients)
    return float(own), float(scale * b), float(scale * k)


def _median_ratio(measured: np.ndarray, fitted: np.ndarray) -> float:
    """The median of measured over fitted, where the fit is positive (1 with none): the factor that puts a fit
    through the median of its samples."""
    ratios = measured[fitted > 0] / fitted[fitted > 0]
    return float(np.median(ratios)) if len(ratios) else 1.0


def prompt_step_ms(step: step_samples.Step, decode_step: tuple[float, float, float] | None) -> float:
    """A prompt step's time less what the requests that decoded in it added (by `decode_step`, padded): their
    per-request and attention terms, not its fixed cost, which a step pays once (one forward pass), as the
    simulation adds them (Calibration.decodes_share_fixed_cost). A colocated worker's prompt steps on the dev
    machine, less a whole decode step each, fitted too fast for the prompts it then computed alone (1.19-1.62x)."""
    if not step.decodes or decode_step is None:
        return step.ms
    _, b, k = decode_step
    decodes_ms = b * step.decodes + k * step.decodes * step.decode_longest / 1e3
    return max(step.ms - decodes_ms, step.ms * MIN_PROMPT_SHARE)


def fit_colocated_step(by_leg: Legs) -> tuple[float, float, float] | None:
    """ms per decode step of a colocated worker (a + b batch + k context / 1e3), from the colocated legs' TPOT less
    the time the worker spent on other requests' prompts meanwhile (the simulation adds those steps itself). A
    colocated worker may have more cores than D (the bench pins P and D to half the machine each, a colocated
    worker to all of it), so D's step time does not stand in for its own. None with too few requests."""
    features, tpot = [], []
    for leg, leg_rows in _legs(by_leg):
        if leg not in LEGS or LEGS[leg].mode != "colocated":
            continue
        for row in leg_rows:
            start, end = decode_interval(row)
            if not row.tpot_ms or row.output_tokens < 2 or end <= start:
                continue
            others = [prefill_interval(o) for o in leg_rows if o is not row]
            prompts_ms = (end - start) * busy_share((start, end), others)
            if prompts_ms < (end - start) / 2:  # most of its decode ran as decode steps
                batch, context = batch_during_decode(row, leg_rows)
                features.append([1.0, batch, context / 1e3])
                tpot.append((end - start - prompts_ms) / (row.output_tokens - 1))
    if len(tpot) < MIN_FIT_SAMPLES:
        return None
    x, y = np.array(features), np.array(tpot)
    coefficients = nonnegative_lstsq(x, y, _batch_columns(x))
    return tuple(float(c) for c in coefficients)


def batch_during_decode(row: Row, leg_rows: list[Row]) -> tuple[float, float]:
    """(mean batch, mean tokens of context in it) while this request decoded: others weighted by the share of its
    decode they overlapped."""
    batch, context = decodes_beside(decode_interval(row), row, leg_rows)
    return 1.0 + batch, row.input_tokens + row.output_tokens / 2 + context


def _read_rate(pairs: list[tuple[float, int]]) -> float | None:
    mib = sum(nbytes for _, nbytes in pairs) / 2**20
    return sum(ms for ms, _ in pairs) / mib if mib > 0 else None


def read_rates(d_to_p: float | None, p_to_d: float | None) -> dict[str, float | None]:
    """Both directions' KV read rates in ms per MiB, for a calibration: a direction nobody read in takes the other's
    rate (a rate of 0 ms is a reading, not a missing one)."""
    return {"d_to_p": d_to_p if d_to_p is not None else p_to_d, "p_to_d": p_to_d if p_to_d is not None else d_to_p}


def fitted(results: dict | list[dict], source: str = "") -> dict:
    """The fields of a Calibration fitted to a bench results JSON, or to several pooled (runs of the same
    hardware at different times: one run's speed drifts with whatever else the machine does). Each run's legs keep
    their own clock: requests of two runs never overlap, as contention or as shared steps."""
    runs = results if isinstance(results, list) else [results]
    if not runs:
        raise CalibrationError("no bench run to calibrate from")
    rows, by_leg, run_rows_of = [], [], []
    for index, run in enumerate(runs):
        run_rows = rows_of(run)
        run_rows_of.append(run_rows)
        if not run_rows:
            which = f"run {index + 1} of {len(runs)}: " if len(runs) > 1 else ""
            raise CalibrationError(f"{which}not a kvturn bench results JSON: no measured requests under 'legs'")
        rows += run_rows
        by_leg += rows_by_leg(run_rows).items()
    legs_in_service = step_legs(runs)
    in_service = step_fits(legs_in_service) if legs_in_service else None
    fits = _request_fits(runs, by_leg) if in_service is None else in_service
    per_token = [r.bytes_d_to_p / r.tokens_from_decode for r in rows if r.bytes_d_to_p and r.tokens_from_decode]
    if not per_token:
        raise CalibrationError("no request read KV back from a decode worker: run a leg with bidirectional "
                               "transfer (e.g. bidir/P-cache-off) to measure KV bytes per token and read time")
    # As the router learns it: from reads no step of P's overlapped (the others waited for other prompts' work).
    reads = [r for r in rows if r.bytes_d_to_p]
    clean = [r for r in reads if not r.d_to_p_step_ms]
    d_to_p = _read_rate([(r.d_to_p_ms, r.bytes_d_to_p) for r in clean or reads])
    p_to_d = _read_rate([(r.p_to_d_ms, r.bytes_p_to_d) for r in rows if r.bytes_p_to_d])
    other = {leg: fit_other(samples) for leg, samples in other_samples(by_leg).items()}
    return {**fits, "answer_reuse_share": answer_reuse_share(run_rows_of),
            "resent_answer_ratio": resent_answer_ratio(rows),
            "read_ms_per_mib": read_rates(d_to_p, p_to_d),
            "kv_bytes_per_token": float(np.median(per_token)), "other_ms": {leg: a for leg, (a, _, _) in other.items()},
            "other_ms_per_request": {leg: b for leg, (_, b, _) in other.items()},
            "other_load_seen": float(max((seen for _, _, seen in other.values()), default=0)), "source": source,
            "samples": {"requests": len(rows), **fits["samples"]}}


ANSWER_SHARES = [i / 20 for i in range(21)]  # the shares of an answer answer_reuse_share chooses from


def answer_reuse_share(runs: list[list[Row]]) -> float | None:
    """How much of a turn's answer the next turn reused from the decode worker's retention, as a share of the
    answer's tokens: of the shares 0, 0.05, ..., 1, the one whose reuse (the previous prompt and that share of its
    answer, in the full blocks D retained) comes closest to where reuse ended (the prompt tokens P did not compute)
    over every turn that read from D and extends the previous prompt and answer; the middle one where several come
    as close (full blocks often cannot tell neighbours apart); None with no such turn. An answer is resent as
    text, and the tokens it becomes need not be those that were generated (a chat template that writes past
    answers otherwise, a tokenizer that merges a random-weight model's tokens): KV is reusable only up to the first
    that differ. On the embedded random-weight model 0.05 (2026-12-03: every read ended within a block of the
    previous prompt); a model whose answers tokenize back as generated gives 1."""
    pairs = []
    for rows in runs:  # a turn pairs with the previous turn of its own run and leg
        previous = {(row.leg, row.conversation_id, row.turn): row for row in rows}
        for row in rows:
            before = previous.get((row.leg, row.conversation_id, row.turn - 1))
            if row.tokens_from_decode <= 0 or before is None or \
                    row.input_tokens < before.input_tokens + resent_length(before):  # an edit resending less
                continue
            reused = row.input_tokens - row.computed if row.computed is not None else row.tokens_from_decode
            # An edit within the history ends reuse before the previous prompt's own blocks: no share explains it.
            if reused >= min(before.input_tokens, row.input_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE:
                pairs.append((before.input_tokens, before.output_tokens, row.input_tokens, reused))
    if not pairs:
        return None

    def error(share: float) -> int:
        return sum(abs(min(before + int(share * answer), before + answer - 1, prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
                       - reused) for before, answer, prompt, reused in pairs)
    errors = [error(share) for share in ANSWER_SHARES]
    best = [share for share, e in zip(ANSWER_SHARES, errors) if e == min(errors)]
    return best[(len(best) - 1) // 2]


def resent_length(row: Row) -> int:
    """The tokens `row`'s answer came back as next turn: its text's count where the bench made one, else as many as
    were generated."""
    return row.answer_text_tokens if row.answer_text_tokens is not None else row.output_tokens


def resent_answer_ratio(rows: list[Row]) -> float | None:
    """What the answers' text came to, in tokens, over the tokens generated, of every answer the bench counted
    (RequestRecord.answer_text_tokens); None where it counted none. A model's answer is resent next turn as text,
    and its tokenizer need not make as many tokens of it again: on the embedded random-weight model about two
    thirds (0.66 in 2026-12-04's calibration runs, most answers coming back whole or as about half their tokens);
    a trained model's, about 1."""
    counted = [(row.answer_text_tokens, row.output_tokens) for row in rows if row.answer_text_tokens is not None]
    generated = sum(output for _, output in counted)
    if not generated:
        return None
    return min(sum(text for text, _ in counted) / generated, MAX_RESENT_RATIO)


def rows_by_leg(run_rows: list[Row]) -> dict[str, list[Row]]:
    """One run's rows by leg."""
    legs: dict[str, list[Row]] = {}
    for row in run_rows:
        legs.setdefault(row.leg, []).append(row)
    return legs


def other_samples(by_leg: Legs) -> dict[str, list[tuple[int, float]]]:
    """Each leg's (requests in flight at arrival, time outside compute) of its requests, runs pooled: what
    fit_other fits."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for leg, leg_rows in (by_leg.items() if isinstance(by_leg, dict) else by_leg):
        samples.setdefault(leg, []).extend((in_flight(r, leg_rows), r.other_ms) for r in leg_rows)
    return samples


def in_flight(row: Row, leg_rows: list[Row]) -> int:
    """The leg's other requests in flight when `row` arrived (the bench runs one worker per role)."""
    return sum(1 for other in leg_rows if other is not row and other.start_ms <= row.start_ms < other.start_ms +
               other.latency_ms)


def fit_other(samples: list[tuple[int, float]]) -> tuple[float, float, int]:
    """(ms alone, ms each other request in flight adds, the most load it saw) of a leg's time outside compute,
    transfer and queues, from (requests in flight at arrival, ms): a line through the median of each load that
    MIN_FIT_SAMPLES requests or more found, weighed by their number (a request's time outside scatters widely: a
    first turn's long prompt is tokenized and sent in it), and the highest of those loads (0 with none). With fewer
    than two such loads, the median of all, and nothing added. On the dev
    machine (2026-12-02), a sweep's requests, one at a time, had ~8-10 ms of it, a calibration run's four sessions
    at a time ~11-16, agent-loop's eight ~12-19."""
    by_load: dict[int, list[float]] = {}
    for load, ms in samples:
        by_load.setdefault(load, []).append(ms)
    loads = [n for n in sorted(by_load) if len(by_load[n]) >= MIN_FIT_SAMPLES]
    seen = max(loads, default=0)
    if len(loads) < 2:
        return float(np.median([ms for _, ms in samples])), 0.0, seen
    weights = np.sqrt([len(by_load[n]) for n in loads])
    medians = np.array([np.median(by_load[n]) for n in loads])
    x = np.array([[1.0, n] for n in loads]) * weights[:, None]
    alone, per_request = nonnegative_lstsq(x, medians * weights, [0, 1])
    return float(alone), float(per_request), seen


def step_legs(runs: list[dict]) -> list[dict[str, list[step_samples.Step]]] | None:
    """Each leg's workers' steps in service, or None unless every leg kept them for each of its workers (an older
    bench, or a worker that did not answer): the fits come from the steps of every leg or from none of them."""
    legs = []
    for run in runs:
        for name, leg in (run.get("legs") or {}).items():
            steps = step_samples.leg_steps(leg)
            colocated = name in LEGS and LEGS[name].mode == "colocated"
            if set(steps) != ({"colocated"} if colocated else {"prefill", "decode"}):
                return None
            legs.append(steps)
    return legs


def step_fits(legs: list[dict[str, list[step_samples.Step]]]) -> dict | None:
    """The compute and decode step fits from the workers' steps in service (step_samples.py), or None when there are
    too few: each kind's prompt steps in one fit, less what the decodes beside them added by that kind's decode step
    fit (so that a simulated step costs its prompts' compute plus its decodes' terms), except D's prompts, which
    scale P's fit. The slowdown beside the other role and the cost of starting idle are left at zero: on the dev
    machine P's steps with D decoding, or started idle, came within 4% of the fit of all of them."""
    samples = step_samples.collect(legs)
    if len(samples.prompts["prefill"]) < MIN_FIT_SAMPLES or len(samples.decodes["decode"]) < MIN_FIT_SAMPLES:
        return None
    decode_step, contention = fit_decode_steps(samples.decodes["decode"])
    colocated = samples.decodes["colocated"]
    colocated_step = fit_colocated_decode_steps(colocated, decode_step) if len(colocated) >= MIN_FIT_SAMPLES else None
    own_step = {"prefill": None, "decode": decode_step, "colocated": colocated_step or decode_step}
    prompts = {kind: [(step.prompts, prompt_step_ms(step, own_step[kind])) for step in steps]
               for kind, steps in samples.prompts.items()}
    fits = {"prefill": fit_through_median(prompts["prefill"])}
    if len(prompts["colocated"]) >= MIN_FIT_SAMPLES:
        fits["colocated"] = fit_through_median(prompts["colocated"])
    # D is the same engine on cores of its own, and computes only the later turns of one leg: too few shapes to
    # fit four terms, so they scale P's fit.
    ratios = _ratios(prompts["decode"], fits["prefill"])
    if len(ratios) >= MIN_FIT_SAMPLES:
        fits["decode"] = tuple(c * float(np.median(ratios)) for c in fits["prefill"])
    scatter = {kind: step_scatter(prompts[kind], fits[kind]) for kind in fits}
    return {"compute_fits": fits, "step_scatter": scatter, "seen": steps_seen(samples), "decode_fit_alone": True,
            "decode_step_fit": decode_step,
            "decode_step_padded": True, "decodes_share_fixed_cost": True,
            "colocated_step_fit": colocated_step, "idle_step_ms": 0.0,
            "busy_idle_step_ms": 0.0, "contention": {"prefill_slowdown": 0.0, "decode_step_ms": contention},
            "samples": {"steps": samples.count(), **{kind: len(steps) for kind, steps in samples.prompts.items()}}}


def steps_seen(samples: step_samples.StepSamples) -> dict[str, float]:
    """SEEN_SHAPES at their most in steps in service (whose decode steps are fitted padded)."""
    chunks = [chunk for steps in samples.prompts.values() for step in steps for chunk in step.prompts]
    batches = [(step.decodes, step.decode_longest) for steps in samples.prompts.values() for step in steps]
    batches += [(batch, longest) for decodes in samples.decodes.values() for batch, longest, _, _ in decodes]
    seen = {"prompt_tokens": float(max((n for n, _ in chunks), default=0)),
            "prompt_context": float(max((n + context for n, context in chunks), default=0)),
            "decode_batch": float(max((batch for batch, _ in batches), default=0)),
            "decode_attended": float(max((batch * longest for batch, longest in batches), default=0))}
    return _measured(seen)


def _measured(seen: dict[str, float]) -> dict[str, float]:
    """The shapes of `seen` some sample had (a count of 0 says none did)."""
    return {shape: most for shape, most in seen.items() if most >= 1}


def step_scatter(samples: list[tuple[Chunks, float]], coefficients) -> list[float]:
    """SCATTER_QUANTILES of the samples' time over the fit's, divided by their median (1 where the fit runs through
    it): how a step of these shapes scatters on this machine."""
    ratios = _ratios(samples, coefficients)
    if not len(ratios):
        return [1.0]
    quantiles = np.quantile(ratios / np.median(ratios), SCATTER_QUANTILES)
    return [float(q) for q in np.clip(quantiles, 1e-3, MAX_SCATTER)]


def _request_fits(runs: list[dict], by_leg: Legs) -> dict:
    """The compute and decode step fits from the requests' timings and the workers' start-up steps, for bench
    results that kept no steps in service."""
    colocated_step = fit_colocated_step(by_leg)
    measured = compute_samples(by_leg, colocated_step)
    start_up: dict[str, list] = {}
    for run in runs:
        for kind, timed in start_up_samples(run).items():
            start_up.setdefault(kind, []).extend(timed)
    # The fits are of steps back to back: a prompt its worker started idle counts less what that cost.
    idle_ms = idle_step_ms(measured["prefill"], start_up["prefill"])
    samples = {kind: [(chunks, back_to_back_ms(ms, idle, idle_ms), busy) for chunks, ms, busy, idle in points]
               for kind, points in measured.items() if kind != "prefill"}
    prefill = measured["prefill"] + [(chunks, ms, busy, False) for chunks, ms, busy in start_up.pop("prefill")]
    # D's requests computed their prompts beside its running decodes; its start-up steps, alone, are fitted
    # instead when there are enough, and the simulation adds the decodes' step (decode_fit_alone).
    decode_fit_alone = len(start_up["decode"]) >= MIN_FIT_SAMPLES
    if decode_fit_alone:
        samples["decode"] = []
    for kind, timed in start_up.items():
        samples[kind] += timed
    if len(prefill) < MIN_FIT_SAMPLES:
        raise CalibrationError(f"too few requests with a measured prefill on a prefill worker to fit the compute "
                               f"time (need {MIN_FIT_SAMPLES}): run at least one P/D leg")
    prefill_fit, slowdown, busy_idle_ms = fit_with_contention(prefill, idle_ms)
    fits = {"prefill": prefill_fit, **{kind: fit_compute([p[:2] for p in points]) for kind, points in samples.items()
                                       if len(points) >= MIN_FIT_SAMPLES}}
    step_fit, step_contention = fit_decode_step(by_leg)
    rows = [row for _, leg_rows in by_leg for row in leg_rows]
    # Of the prompts, what the requests say, a whole prompt's computed tokens for a step's (the batch a decode step
    # ran is not known from them: not compared)
    computed = [row.input_tokens if row.computed is None else row.computed for row in rows]
    seen = _measured({"prompt_tokens": float(max(computed, default=0)),
                      "prompt_context": float(max((row.input_tokens for row in rows), default=0))})
    return {"compute_fits": fits, "seen": seen, "decode_fit_alone": decode_fit_alone, "decode_step_fit": step_fit,
            "colocated_step_fit": colocated_step, "idle_step_ms": idle_ms, "busy_idle_step_ms": busy_idle_ms,
            "contention": {"prefill_slowdown": slowdown, "decode_step_ms": step_contention},
            "samples": {"prefill": len(prefill), **{kind: len(points) for kind, points in samples.items()}}}
