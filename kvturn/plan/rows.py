"""The measured requests of a `kvturn bench` results JSON, as the calibration reads them: what was read each way,
and the part of the time to first token that is neither compute, transfer nor a worker's queue."""
from dataclasses import dataclass

MAX_BYTES = 2**50  # read by one request


@dataclass(slots=True)
class Row:
    leg: str
    start_ms: float
    ttft_ms: float
    latency_ms: float
    prefill_compute_ms: float
    decode_compute_ms: float
    d_to_p_ms: float
    p_to_d_ms: float
    bytes_d_to_p: int
    bytes_p_to_d: int
    tokens_from_decode: int
    first_token_ahead: bool  # the router sent P's token ahead: D's read and compute are not in the TTFT
    d_to_p_step_ms: float  # of d_to_p_ms, P's engine steps for other prompts before the read was seen done
    queue_ms: float  # P's (or a colocated worker's) wait for its engine's steps, less its read from D
    decode_wait_ms: float  # ...and D's, when D computed the prompt

    @property
    def other_ms(self) -> float:
        """TTFT that is neither compute, transfer nor a wait for the engine's steps (the simulation queues those
        itself): the router's and the HTTP hops' time, and the workers' tokenizing and handling."""
        d_part = 0.0 if self.first_token_ahead else self.decode_compute_ms + self.p_to_d_ms + self.decode_wait_ms
        return max(self.ttft_ms - self.prefill_compute_ms - self.d_to_p_ms - self.queue_ms - d_part, 0.0)


def number_within(value, least: float, most: float) -> bool:
    """Whether `value` is an int or float from `least` to `most` (not a bool; NaN fails both comparisons)."""
    return type(value) in (int, float) and least <= value <= most


def _ms(value) -> float:
    """A time a worker reported, or 0 for anything that is not a finite, nonnegative number of ms."""
    return float(value) if number_within(value, 0.0, 1e9) else 0.0


def _count(value) -> int:
    return value if type(value) is int and 0 <= value <= MAX_BYTES else 0


def _steps_wait(own_wait_ms: float, engine_wait_ms, read_ms: float) -> float:
    """Of a worker's own time to its first token less its read and compute, the wait for its engine's steps: the
    engine's wait to run the prompt less the read done before its first step; all of it without that wait."""
    if not number_within(engine_wait_ms, 0.0, 1e9):
        return own_wait_ms
    return min(own_wait_ms, max(engine_wait_ms - read_ms, 0.0))


def _row(leg: str, r: dict) -> Row | None:
    """A request as a Row, or None for one that failed, warmed up, or says no positive TTFT; any other field that
    is not a plausible number counts as unmeasured."""
    if r.get("error") or r.get("warmup") or not number_within(r.get("ttft_ms"), 1e-9, 1e9):
        return None
    d_to_p, p_to_d, decode_compute = _ms(r.get("d_to_p_read_ms")), _ms(r.get("p_to_d_read_ms")), \
        _ms(r.get("decode_compute_ms"))
    decode_wait = 0.0
    if decode_compute:  # D computed the prompt (compute on decode): it queued too
        decode_wait = _steps_wait(_ms(r.get("decode_ttft_ms")) - decode_compute - p_to_d,
                                  r.get("decode_engine_wait_ms"), p_to_d)
    return Row(leg, _ms(r.get("start_time_ms")), r["ttft_ms"], _ms(r.get("latency_ms")) or r["ttft_ms"],
               _ms(r.get("prefill_compute_ms")), decode_compute, d_to_p, p_to_d, _count(r.get("bytes_d_to_p")),
               _count(r.get("bytes_p_to_d")), _count(r.get("prompt_tokens_from_decode")),
               r.get("first_token_from") == "prefill", _ms(r.get("d_to_p_read_step_ms")),
               _steps_wait(_ms(r.get("queue_ms")), r.get("engine_wait_ms"), d_to_p), max(decode_wait, 0.0))


def rows_of(results: dict) -> list[Row]:
    legs = results.get("legs") if isinstance(results, dict) else None
    if not isinstance(legs, dict):
        return []
    rows = [_row(leg, r) for leg, run in legs.items() if isinstance(run, dict)
            for r in (run.get("requests") or []) if isinstance(r, dict)]
    return [r for r in rows if r is not None]


def busy_share(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Share of `interval` that the `others` overlap (at most 1)."""
    length = interval[1] - interval[0]
    if length <= 0:
        return 0.0
    covered = sum(max(0.0, min(interval[1], b) - max(interval[0], a)) for a, b in others)
    return min(covered / length, 1.0)


def in_flight(row: Row, leg_rows: list[Row]) -> int:
    """The leg's other requests in flight when `row` arrived."""
    return sum(1 for other in leg_rows if other is not row and other.start_ms <= row.start_ms < other.start_ms +
               other.latency_ms)
