"""The pull-or-recompute policy: one test per outcome, plain inputs, no processes."""
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.policy import PromptView, RemoteView, decide

BLOCK = 16


def prompt(hashes, num_tokens=None, local=0, whole=None, must_sample_here=False):
    num_tokens = num_tokens if num_tokens is not None else len(hashes) * BLOCK + 1
    return PromptView(num_tokens, list(hashes), list(whole if whole is not None else hashes), local,
                      must_sample_here)


def remote(hashes, num_tokens=None, seconds_left=300.0, first_token=False, connected=True):
    num_tokens = num_tokens if num_tokens is not None else len(hashes) * BLOCK
    return RemoteView(list(hashes), num_tokens, seconds_left, first_token, connected)


def test_reuses_the_matching_prefix_beyond_the_local_hit():
    decision = decide(prompt([1, 2, 3, 4, 5], local=1), remote([1, 2, 3, 9]), BLOCK, 32, 5.0)
    assert decision.loads and (decision.load_from_block, decision.load_to_block) == (1, 3)
    assert not decision.whole_prompt


def test_a_lease_about_to_end_is_declined_as_expired():
    decision = decide(prompt([1, 2, 3]), remote([1, 2, 3], seconds_left=4.9), BLOCK, 1, 5.0)
    assert decision.reason == policy.EXPIRED and not decision.loads


def test_a_peer_nixl_does_not_know_is_unreachable():
    assert decide(prompt([1, 2, 3]), remote([1, 2, 3], connected=False), BLOCK, 1, 5.0).reason == \
        policy.PEER_UNREACHABLE


def test_no_common_first_block_is_a_hash_mismatch():
    assert decide(prompt([1, 2, 3]), remote([7, 8, 9]), BLOCK, 1, 5.0).reason == policy.HASH_MISMATCH


def test_blocks_already_in_the_local_cache_are_not_read_again():
    assert decide(prompt([1, 2, 3], local=2), remote([1, 2]), BLOCK, 1, 5.0).reason == policy.COVERED_LOCALLY


def test_fewer_reusable_tokens_than_the_threshold_recompute():
    decision = decide(prompt([1, 2, 3, 4]), remote([1, 2, 3]), BLOCK, 64, 5.0)
    assert decision.reason == policy.BELOW_THRESHOLD
    assert decide(prompt([1, 2, 3, 4]), remote([1, 2, 3, 4]), BLOCK, 64, 5.0).loads


def test_the_threshold_is_an_explicit_argument():
    """P->D passes 1: P already computed the blocks, so any block D lacks is worth reading."""
    assert decide(prompt([1, 2]), remote([1]), BLOCK, 1, 5.0).loads
    assert decide(prompt([1, 2]), remote([1]), BLOCK, 64, 5.0).reason == policy.BELOW_THRESHOLD


def test_the_whole_prompt_with_first_token_is_read_when_every_block_matches():
    whole = [1, 2, 3]  # two full blocks and a partial third, hashed over its tokens
    decision = decide(prompt([1, 2], num_tokens=40, whole=whole), remote(whole, num_tokens=40, first_token=True),
                      BLOCK, 64, 5.0)
    assert decision.loads and decision.whole_prompt and decision.load_to_block == 3


def test_seeded_sampling_or_logprobs_never_take_the_peer_first_token():
    whole = [1, 2, 3]
    decision = decide(prompt([1, 2], num_tokens=40, whole=whole, must_sample_here=True),
                      remote(whole, num_tokens=40, first_token=True), BLOCK, 1, 5.0)
    assert decision.loads and not decision.whole_prompt and decision.load_to_block == 2


def test_a_different_partial_tail_falls_back_to_the_full_blocks():
    decision = decide(prompt([1, 2], num_tokens=40, whole=[1, 2, 3]),
                      remote([1, 2, 4], num_tokens=40, first_token=True), BLOCK, 1, 5.0)
    assert decision.loads and not decision.whole_prompt and decision.load_to_block == 2


def test_every_reason_is_exported_for_metrics():
    reasons = {policy.EXPIRED, policy.BELOW_THRESHOLD, policy.HASH_MISMATCH, policy.EPOCH_MISMATCH,
               policy.PEER_UNREACHABLE, policy.LEASE_UNKNOWN, policy.READ_FAILED, policy.COVERED_LOCALLY,
               policy.LAYOUT_MISMATCH, policy.UNTRUSTED_PEER, policy.BAD_PEER_REPLY, policy.UNSIGNED_RECORD,
               policy.PREEMPTED, policy.LEASE_ENDED}
    assert reasons == set(policy.DECLINE_REASONS)
