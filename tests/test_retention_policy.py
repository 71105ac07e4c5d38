"""Which lease gives its blocks up first (kv_transfer/retention.py): the likeliest to be read is kept, and each tenant's
retained KV is safe from another tenant while within its share."""
from kvturn.kv_transfer import retention
from kvturn.kv_transfer.retention import Candidate, choose, tenant_of


def lease(tenant: str = "", blocks: int = 10, idle_s: float = 1.0, gap_s: float | None = None,
          covered: float = 0.0, announced_s: float | None = None) -> Candidate:
    return Candidate(tenant, blocks, idle_s, gap_s, covered, announced_s)


def test_without_other_evidence_the_least_recently_used_goes_first():
    assert choose([lease(idle_s=9), lease(idle_s=5)], "", 100) == (0, retention.LEAST_RECENT)
    assert choose([], "", 100) is None


def test_a_conversation_unused_for_several_of_its_own_gaps_goes_before_an_older_one_still_in_rhythm():
    older_but_slow = lease(idle_s=60, gap_s=30)  # two of its gaps: still likely to come back
    ended = lease(idle_s=40, gap_s=5)  # eight of its gaps
    assert choose([older_but_slow, ended], "", 100) == (1, retention.ENDED)


def test_a_history_ps_cache_held_at_its_turn_goes_before_one_only_decode_holds():
    assert choose([lease(idle_s=9), lease(idle_s=1, covered=0.9)], "", 100) == (1, retention.COVERED)
    assert choose([lease(idle_s=9), lease(idle_s=1, covered=0.2)], "", 100) == (0, retention.LEAST_RECENT)


def test_a_tenant_reclaims_its_own_leases_before_another_tenants_within_its_share():
    others, own = lease("tenant-b", blocks=20, idle_s=50), lease("tenant-a", blocks=20, idle_s=1)
    assert choose([others, own], "tenant-a", 100) == (1, retention.LEAST_RECENT)


def test_a_tenant_beyond_its_share_loses_its_leases_first_whoever_asks():
    hog = [lease("tenant-b", blocks=30, idle_s=1), lease("tenant-b", blocks=30, idle_s=1)]
    own = lease("tenant-a", blocks=10, idle_s=90)
    assert choose([own, *hog], "tenant-a", 100) == (1, retention.OVER_SHARE)


def test_another_tenants_leases_within_its_share_go_only_when_a_request_needs_the_blocks_to_run():
    others = [lease("tenant-b", blocks=20)]
    assert choose(others, "tenant-a", 100, others_within_share=False) is None  # room under the retained budget
    assert choose(others, "tenant-a", 100) == (0, retention.OTHER_TENANT)  # a running request never waits


def test_the_tenant_is_the_routers_scope_before_the_last_colon():
    assert tenant_of("9f86d081884c7d65:ab12cd") == "9f86d081884c7d65" and tenant_of("plain-id") == ""


def test_a_lease_whose_next_turn_is_on_its_way_goes_last_and_the_one_announced_first_is_kept_longest():
    announced_early, announced_late = lease(idle_s=30, announced_s=30), lease(idle_s=2, announced_s=2)
    fresh = lease(idle_s=1)  # made just now; its conversation's next turn has not come
    assert choose([announced_early, announced_late, fresh], "", 100) == (2, retention.LEAST_RECENT)
    assert choose([announced_early, announced_late], "", 100) == (1, retention.ANNOUNCED)
