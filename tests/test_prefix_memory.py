"""The router's guess of what a prefill worker's prefix cache holds, and the path prices that follow from it."""
from kvturn import costmodel
from kvturn.router.prefix_memory import PrefixMemory


def test_nothing_is_expected_of_a_p_until_it_has_reported_a_returning_turn():
    memory = PrefixMemory(8)
    memory.observe("a", "p0", 1000, 0)
    assert memory.expected_cached("a", "p0") == 0  # no returning turn seen yet
    memory.observe("a", "p0", 1200, 1000)  # it held the whole history
    assert memory.expected_cached("a", "p0") == 1200
    assert memory.expected_cached("a", "p1") == 0 and memory.expected_cached(None, "p0") == 0


def test_a_p_whose_cache_keeps_little_is_expected_to_hold_little():
    memory = PrefixMemory(8)
    memory.observe("a", "p0", 1000, 0)
    memory.observe("a", "p0", 1000, 0)  # P's cache is off, or under pressure
    assert memory.expected_cached("a", "p0") == 0


def test_the_memory_forgets_the_oldest_conversation_past_its_bound():
    memory = PrefixMemory(2)
    for key in ("a", "b", "c"):
        memory.observe(key, "p0", 100, 0)
    assert list(memory.last) == ["b", "c"]


def test_a_turn_meeting_its_history_in_ps_cache_is_priced_as_its_new_tokens():
    model = costmodel.CostModel()
    cold = costmodel.TurnView(4000, 3800, 0, True, 0)
    warm = costmodel.TurnView(4000, 3800, 0, True, 0, prefill_cached_tokens=3800)
    cold_paths, warm_paths = costmodel.predict(model, cold), costmodel.predict(model, warm)
    assert warm_paths[costmodel.RECOMPUTE].tokens_computed == 200
    assert warm_paths[costmodel.RECOMPUTE].explained_ms < cold_paths[costmodel.RECOMPUTE].explained_ms
    assert warm_paths[costmodel.PULL].explained_ms < cold_paths[costmodel.PULL].explained_ms  # nothing left to read
