"""What a leg's later turns met: the P of their previous turn, and a P cache holding the history."""
from kvturn.bench.client import RequestRecord
from kvturn.bench.placement import placement


def record(conv: str, turn: int, worker: str, prompt: int, cached: int = 0, from_d: int = 0, ttft: float = 100.0):
    return RequestRecord(conv, 0, turn, 2 * turn + 1, 0.0, warmup=False, ttft_ms=ttft, input_num_tokens=prompt,
                         prefill_worker=worker, prompt_tokens_cached_prefill=cached, prompt_tokens_from_decode=from_d,
                         prompt_tokens_computed_prefill=prompt - cached - from_d)


def test_later_turns_count_the_p_they_met_and_what_its_cache_held():
    requests = [record("a", 0, "p0", 1000), record("a", 1, "p0", 1200, cached=992, ttft=50.0),
                record("a", 2, "p1", 1400, from_d=1184, ttft=80.0),
                record("b", 0, "p1", 500), record("b", 1, "p1", 700, cached=100, ttft=300.0)]
    measured = placement(requests)
    assert measured["later_turns"] == 3
    assert measured["same_p_share"] == 2 / 3 and measured["p_cache_held_share"] == 1 / 3
    assert measured["later_ttft_p50_ms_same_p"] == 175.0 and measured["later_ttft_p50_ms_other_p"] == 80.0


def test_a_failed_previous_turn_leaves_the_next_one_out():
    failed = record("a", 0, "p0", 1000)
    failed.error = "HTTP 503"
    assert placement([failed, record("a", 1, "p0", 1200)])["later_turns"] == 0
