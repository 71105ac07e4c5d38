"""The measured requests of a `kvturn bench` results JSON, as the calibration reads them: what was read each way,
and the part of the time to first token that is neither compute, transfer nor a worker's queue. A field that is not
a plausible number counts as unmeasured."""
from dataclasses import dataclass


@dataclass(slots=True)
class Row:
    leg: str
    start_ms: float
    latency_ms: float
    other_ms: float  # TTFT outside compute, transfer and engine queues: the router, HTTP hops, tokenizing
    d_to_p_ms: float
    d_to_p_step_ms: float  # of d_to_p_ms, P's engine steps for other prompts before the read was seen done
    p_to_d_ms: float
    bytes_d_to_p: int
    bytes_p_to_d: int
    tokens_from_decode: int


def number_within(value, least: float, most: float) -> bool:
    """Whether `value` is an int or float from `least` to `most` (not a bool; NaN fails both comparisons)."""
    return type(value) in (int, float) and least <= value <= most


def _row(leg: str, r: dict) -> Row | None:
    """A request as a Row, or None for one that failed, warmed up, or says no positive TTFT."""
    if r.get("error") or r.get("warmup") or not number_within(r.get("ttft_ms"), 1e-9, 1e9):
        return None
    ms = {key: float(r[key]) if number_within(r.get(key), 0.0, 1e9) else 0.0 for key in (
        "start_time_ms", "latency_ms", "prefill_compute_ms", "decode_compute_ms", "d_to_p_read_ms", "p_to_d_read_ms",
        "d_to_p_read_step_ms", "queue_ms", "decode_ttft_ms")}
    count = {key: r[key] if type(r.get(key)) is int and 0 <= r[key] <= 2**50 else 0 for key in (
        "bytes_d_to_p", "bytes_p_to_d", "prompt_tokens_from_decode")}

    def steps_wait(own_ms: float, engine_wait_ms, read_ms: float) -> float:
        """Of a worker's time to its first token less its read and compute, its wait for its engine's steps: the
        engine's wait less the read done before its first step; all of it where the engine's wait is unknown."""
        return min(own_ms, max(engine_wait_ms - read_ms, 0.0)) if number_within(engine_wait_ms, 0.0, 1e9) else own_ms
    d_to_p, p_to_d, decode_ms = ms["d_to_p_read_ms"], ms["p_to_d_read_ms"], ms["decode_compute_ms"]
    outside = r["ttft_ms"] - ms["prefill_compute_ms"] - d_to_p - steps_wait(ms["queue_ms"], r.get("engine_wait_ms"),
                                                                              d_to_p)
    if r.get("first_token_from") != "prefill":  # D's read and compute (and, computing the prompt, its queue) count
        wait = steps_wait(ms["decode_ttft_ms"] - decode_ms - p_to_d, r.get("decode_engine_wait_ms"), p_to_d)
        outside -= decode_ms + p_to_d + (max(wait, 0.0) if decode_ms else 0.0)
    return Row(leg, ms["start_time_ms"], ms["latency_ms"] or r["ttft_ms"], max(outside, 0.0), d_to_p,
               ms["d_to_p_read_step_ms"], p_to_d, count["bytes_d_to_p"], count["bytes_p_to_d"],
               count["prompt_tokens_from_decode"])


def rows_of(results: dict) -> list[Row]:
    legs = results.get("legs") if isinstance(results, dict) else None
    rows = [_row(leg, r) for leg, run in (legs.items() if isinstance(legs, dict) else ()) if isinstance(run, dict)
            for r in (run.get("requests") or []) if isinstance(r, dict)]
    return [r for r in rows if r is not None]


def busy_share(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Share of `interval` that the `others` overlap (at most 1)."""
    length = interval[1] - interval[0]
    covered = sum(max(0.0, min(interval[1], b) - max(interval[0], a)) for a, b in others)
    return min(covered / length, 1.0) if length > 0 else 0.0


def in_flight(row: Row, leg_rows: list[Row]) -> int:
    """The leg's other requests in flight when `row` arrived."""
    return sum(1 for other in leg_rows if other is not row and other.start_ms <= row.start_ms < other.start_ms +
               other.latency_ms)
