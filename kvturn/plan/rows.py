"""The measured requests of a `kvturn bench` results JSON, as the calibration fits read them: token counts, the
time split, and when each phase (waiting, prefill, decode) ran."""
from dataclasses import dataclass

MAX_TOKENS = 2**24  # of a prompt, or of an answer's text
MAX_BYTES = 2**50  # read by one request


@dataclass(slots=True)
class Row:
    leg: str
    conversation_id: str
    turn: int
    start_ms: float
    ttft_ms: float
    latency_ms: float
    input_tokens: int
    output_tokens: int
    tpot_ms: float | None
    computed: int | None  # prompt tokens the prefill computed
    prefill_compute_ms: float
    decode_compute_ms: float
    d_to_p_ms: float
    p_to_d_ms: float
    bytes_d_to_p: int
    bytes_p_to_d: int
    tokens_from_decode: int
    first_token_ahead: bool = False  # the router sent P's token ahead: D's read and compute are not in the TTFT
    d_to_p_step_ms: float = 0.0  # of d_to_p_ms, P's engine steps for other prompts before the read was seen done
    # P's wait for its engine's steps: its engine's wait to run the prompt less its read from D (a colocated
    # worker's); from a bench that did not record the engine's wait, all of P's own time to its first token less its
    # read and compute, which also holds its tokenizing and handling (a few ms)
    queue_ms: float = 0.0
    decode_wait_ms: float = 0.0  # ...and D's, when D computed the prompt
    decode_computed: int | None = None  # prompt tokens D computed, when it computed the prompt and said so
    answer_text_tokens: int | None = None  # what the answer's text came to, resent next turn; None: not counted

    @property
    def d_part_of_ttft_ms(self) -> float:
        return 0.0 if self.first_token_ahead else self.decode_compute_ms + self.p_to_d_ms

    @property
    def other_ms(self) -> float:
        """TTFT that is neither compute nor transfer (as the bench's RequestRecord.other_ms) nor a worker's wait for
        its engine's steps, which the simulation queues of its own: the router's and the HTTP hops' time, and the
        workers' tokenizing and handling."""
        waits = self.queue_ms + (0.0 if self.first_token_ahead else self.decode_wait_ms)
        return max(self.ttft_ms - self.prefill_compute_ms - self.d_to_p_ms - self.d_part_of_ttft_ms - waits, 0.0)


def _row(leg: str, r: dict) -> Row | None:
    """A request of a bench results JSON as a Row, or None for one that failed, warmed up, or does not say a
    positive TTFT and prompt length; any other field that is not a plausible number counts as unmeasured."""
    if not isinstance(r, dict) or r.get("error") or r.get("warmup") or not number_within(r.get("ttft_ms"), 1e-9, 1e9) \
            or not _tokens(r.get("input_num_tokens"), 1):
        return None
    prompt = r["input_num_tokens"]
    computed = r.get("prompt_tokens_computed_prefill")
    computed = computed if _tokens(computed, 0, prompt) else None
    decode_computed = r.get("decode_tokens_computed")
    read_ms = _ms(r.get("d_to_p_read_ms"))
    queue = _steps_wait(_ms(r.get("queue_ms")), r.get("engine_wait_ms"), read_ms)
    decode_wait = 0.0
    if decode_compute := _ms(r.get("decode_compute_ms")):  # D computed the prompt (compute on decode): it queued
        p_to_d_ms = _ms(r.get("p_to_d_read_ms"))
        decode_wait = _steps_wait(_ms(r.get("decode_ttft_ms")) - decode_compute - p_to_d_ms,
                                  r.get("decode_engine_wait_ms"), p_to_d_ms)
    cached_percent = r.get("approx_cached_percent")
    if computed is None and number_within(cached_percent, 0.0, 100.0) and _ms(r.get("prefill_compute_ms")):
        computed = round(prompt * (1 - cached_percent / 100))  # a colocated worker
    output = r.get("output_num_tokens")
    counted = _tokens(output, 1)
    tpot = r.get("tpot_ms")
    return Row(leg, str(r.get("conversation_id")), r["turn"] if _tokens(r.get("turn"), 0) else 0,
               _ms(r.get("start_time_ms")), r["ttft_ms"], _ms(r.get("latency_ms")) or r["ttft_ms"], prompt,
               output if counted else 1, tpot if number_within(tpot, 0.0, 1e9) else None, computed,
               _ms(r.get("prefill_compute_ms")), decode_compute, read_ms, _ms(r.get("p_to_d_read_ms")),
               _bytes(r.get("bytes_d_to_p")), _bytes(r.get("bytes_p_to_d")),
               r["prompt_tokens_from_decode"] if _tokens(r.get("prompt_tokens_from_decode"), 0, prompt) else 0,
               r.get("first_token_from") == "prefill", _ms(r.get("d_to_p_read_step_ms")), queue,
               max(decode_wait, 0.0), decode_computed if _tokens(decode_computed, 1, prompt) else None,
               r.get("answer_text_tokens") if counted and _tokens(r.get("answer_text_tokens"), 0) else None)


def _steps_wait(own_wait_ms: float, engine_wait_ms, read_ms: float) -> float:
    """Of a worker's own time to its first token less its read and compute (`own_wait_ms`), the wait for its
    engine's steps: the engine's wait to run the prompt (which holds the read, done before its first step) less
    the read. Without a plausible engine wait, all of it."""
    if not number_within(engine_wait_ms, 0.0, 1e9):
        return own_wait_ms
    return min(own_wait_ms, max(engine_wait_ms - read_ms, 0.0))


def number_within(value, least: float, most: float) -> bool:
    """Whether `value` is an int or float from `least` to `most` (not a bool; NaN fails both comparisons)."""
    return type(value) in (int, float) and least <= value <= most


def _tokens(value, least: int, most: int = MAX_TOKENS) -> bool:
    """Whether `value` is a count of tokens from `least` to `most` (an int, not a bool)."""
    return type(value) is int and least <= value <= most


def _bytes(value) -> int:
    return value if type(value) is int and 0 <= value <= MAX_BYTES else 0


def _ms(value) -> float:
    """A time a worker reported, or 0 for anything that is not a finite, nonnegative number of ms."""
    return float(value) if number_within(value, 0.0, 1e9) else 0.0


def rows_of(results: dict) -> list[Row]:
    legs = results.get("legs")
    if not isinstance(legs, dict):
        return []
    rows = [_row(leg, r) for leg, run in legs.items() if isinstance(run, dict)
            for r in (run.get("requests") or []) if isinstance(r, dict)]
    return [r for r in rows if r is not None]


def decode_interval(row: Row) -> tuple[float, float]:
    return row.start_ms + row.ttft_ms, row.start_ms + row.latency_ms


def prefill_interval(row: Row) -> tuple[float, float]:
    """When the prompt was computed: just before its first token (or before the KV went to the decode worker)."""
    end = row.start_ms + row.ttft_ms - row.d_part_of_ttft_ms
    return end - row.prefill_compute_ms - (0.0 if row.first_token_ahead else row.decode_compute_ms), end


def busy_share(interval: tuple[float, float], others: list[tuple[float, float]],
               own: tuple[float, float] | None = None) -> float:
    """Share of `interval` that some other interval overlaps (at most 1); `own` (the row's own other phase) is
    left out."""
    length = interval[1] - interval[0]
    if length <= 0:
        return 0.0
    covered = sum(max(0.0, min(interval[1], b) - max(interval[0], a)) for a, b in others if (a, b) != own)
    return min(covered / length, 1.0)


def after_idle(arrival: float, start: float, others: list[tuple[float, float]]) -> bool:
    """The worker computed nothing else from the request's arrival to the start of its work: it found the worker
    idle (a request queued behind another's steps starts right after them, back to back)."""
    return not any(a < start and b > arrival for a, b in others)
