"""The pull-vs-recompute decision: pure inputs, pure output, no I/O."""
from dataclasses import dataclass

EXPIRED = "expired"
BELOW_THRESHOLD = "below_threshold"
HASH_MISMATCH = "hash_mismatch"
EPOCH_MISMATCH = "epoch_mismatch"
PEER_UNREACHABLE = "peer_unreachable"
LEASE_UNKNOWN = "lease_unknown"
READ_FAILED = "read_failed"
COVERED_LOCALLY = "covered_locally"
LAYOUT_MISMATCH = "layout_mismatch"
DECLINE_REASONS = (EXPIRED, BELOW_THRESHOLD, HASH_MISMATCH, EPOCH_MISMATCH, PEER_UNREACHABLE, LEASE_UNKNOWN,
                   READ_FAILED, COVERED_LOCALLY, LAYOUT_MISMATCH)
REUSED = "reused"


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    load_from_block: int  # first block index to read from the peer (blocks before it are local hits)
    load_to_block: int  # one past the last block index to read
    reason: str  # REUSED or a decline reason

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


def decide_reuse(prompt_hashes: list[int], remote_hashes: list[int], local_hit_blocks: int, block_size: int,
                 threshold_tokens: int, expiry_time: float, now: float, expiry_margin_s: float) -> ReuseDecision:
    """Read the peer's blocks beyond the local prefix-cache hit when that saves at least `threshold_tokens`."""
    decline = lambda reason: ReuseDecision(local_hit_blocks, local_hit_blocks, reason)  # noqa: E731
    if expiry_time - now < expiry_margin_s:
        return decline(EXPIRED)
    matched = matching_prefix_blocks(prompt_hashes, remote_hashes)
    if matched == 0 and remote_hashes and prompt_hashes:
        return decline(HASH_MISMATCH)
    reusable_tokens = (matched - local_hit_blocks) * block_size
    if reusable_tokens <= 0:
        return decline(COVERED_LOCALLY)
    if reusable_tokens < threshold_tokens:
        return decline(BELOW_THRESHOLD)
    return ReuseDecision(local_hit_blocks, matched, REUSED)
