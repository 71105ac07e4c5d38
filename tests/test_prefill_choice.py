"""The router's choice of a turn's prefill worker: least loaded, or prefix-affine (the conversation's own P, as llm-d
routes by prefix) with a spill to the least loaded one when its own is far behind."""
from kvturn.router.workers import WorkerPool

URLS = [f"http://10.0.0.{i}:8100" for i in range(2, 6)]


def pool_at(now: list[float]) -> WorkerPool:
    return WorkerPool(URLS, "prefill", clock=lambda: now[0])


def test_prefix_affine_sends_every_turn_of_a_conversation_to_the_same_worker():
    pool = pool_at([0.0])
    for key in ("conv-a", "conv-b", "conv-c"):
        first = pool.pick(key, "prefix-affine", spill_ms=1000.0)
        pool.claim(first, 50.0)  # load elsewhere moves nothing below the spill
        assert all(pool.pick(key, "prefix-affine", spill_ms=1000.0) is first for _ in range(5))


def test_prefix_affine_spreads_conversations_over_the_workers():
    pool = pool_at([0.0])
    chosen = {pool.pick(f"conv-{i}", "prefix-affine").url for i in range(64)}
    assert chosen == set(URLS)


def test_a_conversation_spills_to_the_least_loaded_worker_when_its_own_is_far_behind():
    pool = pool_at([0.0])
    own = pool.pick("conv-a", "prefix-affine")
    pool.claim(own, 5000.0)
    spilled = pool.pick("conv-a", "prefix-affine", spill_ms=1000.0)
    assert spilled is not own and spilled.backlog_ms() == 0.0
    assert pool.pick("conv-a", "prefix-affine", spill_ms=10_000.0) is own


def test_a_worker_leaving_moves_only_its_own_conversations():
    pool = pool_at([0.0])
    before = {f"conv-{i}": pool.pick(f"conv-{i}", "prefix-affine") for i in range(32)}
    gone = pool.workers[0]
    pool.mark_dead(gone)
    for key, worker in before.items():
        if worker is not gone:
            assert pool.pick(key, "prefix-affine") is worker
        else:
            assert pool.pick(key, "prefix-affine") is not gone


def test_least_loaded_and_keyless_turns_take_the_least_backlog():
    pool = pool_at([0.0])
    for worker, work_ms in zip(pool.workers, (300.0, 100.0, 200.0, 400.0)):
        pool.claim(worker, work_ms)
    assert pool.pick("conv-a", "least-loaded") is pool.workers[1]
    assert pool.pick(None, "prefix-affine") is pool.workers[1]
