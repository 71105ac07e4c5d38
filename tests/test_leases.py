import time

from kvturn.engine.block_manager import BlockManager
from kvturn.kv_transfer.leases import LeaseTable


def table(blocks=32, budget=None, clock=time.monotonic):
    bm = BlockManager(blocks, 16)
    return bm, LeaseTable(bm, budget, clock=clock)


def retain(bm, leases, n, key, ttl=60.0, after_read=False):
    ids = [bm.allocate_new() for _ in range(n)]
    lease = leases.retain(ids, list(range(n)), n * 16, key, ttl, after_read)
    bm.release_all(ids)  # the request finished; only the lease holds them now
    return lease


def test_a_lease_is_found_only_with_its_key():
    bm, leases = table()
    lease = retain(bm, leases, 3, "conv-a")
    assert leases.lookup(lease.handle, "conv-a") is lease
    assert leases.lookup(lease.handle, "conv-b") is None
    assert leases.lookup("made-up", "conv-a") is None


def test_a_lease_can_be_read_many_times_until_it_expires():
    now = [100.0]
    bm, leases = table(clock=lambda: now[0])
    lease = retain(bm, leases, 2, "c", ttl=0.2)
    assert leases.lookup(lease.handle, "c") and leases.lookup(lease.handle, "c")
    now[0] += 0.25
    assert leases.lookup(lease.handle, "c") is None
    assert leases.expire() == 1 and bm.num_free_blocks == 32


def test_a_newer_turn_supersedes_the_older_lease():
    bm, leases = table()
    old = retain(bm, leases, 2, "c")
    new = retain(bm, leases, 3, "c")
    assert leases.lookup(old.handle, "c") is None and leases.lookup(new.handle, "c") is new
    assert leases.counts["superseded"] == 1 and leases.retained_blocks == 3


def test_retention_budget_reclaims_the_oldest_leases_first():
    bm, leases = table(budget=5)
    first, second = retain(bm, leases, 2, "a"), retain(bm, leases, 2, "b")
    third = retain(bm, leases, 3, "c")
    assert leases.retained_blocks <= 5
    assert leases.lookup(first.handle, "a") is None
    assert leases.lookup(second.handle, "b") and leases.lookup(third.handle, "c")
    assert leases.counts["reclaimed"] == 1


def test_release_needs_the_binding_key():
    bm, leases = table()
    lease = retain(bm, leases, 2, "p-request-1", after_read=True)
    assert not leases.release(lease.handle, "someone-else")
    assert leases.release(lease.handle, "p-request-1") and bm.num_free_blocks == 32


def test_pressure_takes_leases_but_never_a_pin_a_decode_worker_is_about_to_read():
    bm, leases = table()
    pin = retain(bm, leases, 2, "p-request-1", after_read=True)
    lease = retain(bm, leases, 3, "conv-a")
    assert leases.reclaim_oldest()  # the lease goes, though the pin is older
    assert leases.lookup(lease.handle, "conv-a") is None and leases.lookup(pin.handle, "p-request-1") is pin
    assert not leases.reclaim_oldest()  # only the pin is left: the pool's caller waits for D's read instead
    assert leases.counts["reclaimed"] == 1 and leases.retained_blocks == 2


def test_a_tenant_within_its_share_keeps_its_retained_kv_however_much_another_tenant_retains():
    bm, leases = table(blocks=64, budget=20)  # two tenants: a share of 10 blocks each
    kept = retain(bm, leases, 8, "tenant-a:conv-1")
    for i, size in enumerate((8, 8, 12, 14)):  # tenant b's turns reclaim b's own leases, then its own new one
        retain(bm, leases, size, f"tenant-b:conv-{i}")
        assert leases.lookup(kept.handle, "tenant-a:conv-1") is kept
        assert leases.retained_blocks <= 20
    assert leases.choices["least_recent"] == 2 and leases.choices["over_share"] == 2  # b beyond its share: its own go
    assert leases.blocks_in("pool") == 8  # b's 14 blocks were more than its share: they went themselves
