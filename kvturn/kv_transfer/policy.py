"""Every pull / recompute / decline decision of the connector: plain inputs, plain output, no I/O."""
from dataclasses import dataclass

REUSED = "reused"
EXPIRED = "expired"
BELOW_THRESHOLD = "below_threshold"
HASH_MISMATCH = "hash_mismatch"
EPOCH_MISMATCH = "epoch_mismatch"
PEER_UNREACHABLE = "peer_unreachable"
LEASE_UNKNOWN = "lease_unknown"
READ_FAILED = "read_failed"
COVERED_LOCALLY = "covered_locally"
LAYOUT_MISMATCH = "layout_mismatch"
UNTRUSTED_PEER = "untrusted_peer"  # a caller without the cluster secret named a peer we do not know
BAD_PEER_REPLY = "bad_peer_reply"  # the peer's side channel answered something malformed
# A caller of the cluster relayed a lease record whose MAC does not hold for this peer address and binding (a store
# rewrote it, or it is another conversation's): the peer it names is not contacted
UNSIGNED_RECORD = "unsigned_record"
PREEMPTED = "preempted"  # the scheduler needed the blocks a layered read was filling, for running requests
# The holder let the lease go before anything was read: the router heard so from it before the turn, or the epochs
# read back just before the read had changed (the read was not made)
LEASE_ENDED = "lease_ended"
DECLINE_REASONS = (EXPIRED, BELOW_THRESHOLD, HASH_MISMATCH, EPOCH_MISMATCH, PEER_UNREACHABLE, LEASE_UNKNOWN,
                   READ_FAILED, COVERED_LOCALLY, LAYOUT_MISMATCH, UNTRUSTED_PEER, BAD_PEER_REPLY, UNSIGNED_RECORD,
                   PREEMPTED, LEASE_ENDED)


@dataclass(frozen=True, slots=True)
class RemoteView:
    """What the peer's own record says it holds for this prompt."""
    block_hashes: list[int]  # chained; the last may cover a partial block (P's pin)
    num_tokens: int
    seconds_left: float  # until the lease expires
    has_first_token: bool  # P's pin carries the token P sampled after the prompt
    peer_connected: bool  # NIXL knows the peer


@dataclass(frozen=True, slots=True)
class PromptView:
    num_tokens: int
    reusable_hashes: list[int]  # full blocks whose KV may come from elsewhere (the last token is always computed)
    whole_hashes: list[int]  # every block, the partial last one hashed over its tokens
    local_hit_blocks: int  # leading blocks already served by this worker's prefix cache
    must_sample_here: bool  # a seeded generator P and D would advance differently, or logprobs P did not send


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    reason: str  # REUSED or a decline reason
    load_from_block: int = 0  # first block index to read from the peer (blocks before it are local hits)
    load_to_block: int = 0  # one past the last block index to read
    whole_prompt: bool = False  # every prompt block comes from the peer, then its first token: skip the prompt

    @property
    def loads(self) -> bool:
        return self.reason == REUSED


def matching_prefix_blocks(prompt_hashes: list[int], remote_hashes: list[int]) -> int:
    """How many leading blocks the peer holds for exactly this prompt (chained hashes, so a prefix match)."""
    matched = 0
    for mine, theirs in zip(prompt_hashes, remote_hashes):
        if mine != theirs:
            break
        matched += 1
    return matched


def decide(prompt: PromptView, remote: RemoteView, block_size: int, threshold_tokens: int,
           expiry_margin_s: float) -> ReuseDecision:
    """Read the peer's blocks beyond the local prefix-cache hit when that saves at least `threshold_tokens`
    (the caller passes 1 for P->D, where P already computed them and any block D lacks is worth reading)."""
    local = prompt.local_hit_blocks

    def decline(reason: str) -> ReuseDecision:
        return ReuseDecision(reason, local, local)

    if remote.seconds_left < expiry_margin_s:
        return decline(EXPIRED)
    if not remote.peer_connected:
        return decline(PEER_UNREACHABLE)
    if (remote.has_first_token and remote.num_tokens == prompt.num_tokens and not prompt.must_sample_here
            and remote.block_hashes == prompt.whole_hashes):
        return ReuseDecision(REUSED, local, len(prompt.whole_hashes), whole_prompt=True)
    matched = matching_prefix_blocks(prompt.reusable_hashes, remote.block_hashes)
    if matched == 0 and remote.block_hashes and prompt.reusable_hashes:
        return decline(HASH_MISMATCH)
    reusable_tokens = (matched - local) * block_size
    if reusable_tokens <= 0:
        return decline(COVERED_LOCALLY)
    if reusable_tokens < threshold_tokens:
        return decline(BELOW_THRESHOLD)
    return ReuseDecision(REUSED, local, matched)
