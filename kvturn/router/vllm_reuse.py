"""How much of a vLLM decode worker's retained KV the next prefill may load: pure, checked in token space.

vLLM's prefill side loads `min(remote_num_tokens, prompt_tokens)` tokens from the decode worker by position and
checks nothing, so an edited history (or an answer that re-tokenizes differently once rendered into the next
prompt) would be served on stale KV. The router caps `remote_num_tokens` at the prefix the new prompt really
shares with the tokens the decode worker retained.
"""
PASSED = "passed"  # the new prompt starts with every retained token (up to block rounding)
CAPPED = "capped"  # the prompt diverges inside the retained tokens: only the verified prefix is passed
REFUSED_BELOW_THRESHOLD = "refused_below_threshold"  # it all matches, but too little to be worth a read
REFUSED_MISMATCH = "refused_mismatch"  # it diverges so early that the verified prefix is below the threshold
NO_PARAMS = "no_params"  # nothing retained for this conversation
NO_TOKEN_IDS = "no_token_ids"  # params kept without the token ids they hold: cannot be verified
TOKENIZE_FAILED = "tokenize_failed"  # the new prompt's token ids could not be had
OUTCOMES = (PASSED, CAPPED, REFUSED_BELOW_THRESHOLD, REFUSED_MISMATCH, NO_PARAMS, NO_TOKEN_IDS, TOKENIZE_FAILED)

_CHUNK = 256  # compare slices this long at C speed, then walk the one that differs


def common_prefix_len(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:  # the usual case, a prompt that extends the retained tokens: one comparison in C
        return limit
    start = 0
    while start < limit and a[start:start + _CHUNK] == b[start:start + _CHUNK]:
        start += _CHUNK
    end = min(start + _CHUNK, limit)
    while start < end and a[start] == b[start]:
        start += 1
    return min(start, limit)


def retained_token_ids(prompt_ids: list[int] | None, output_ids: list[int] | None,
                       remote_num_tokens: int | None) -> list[int] | None:
    """The tokens whose KV the decode worker kept: its prompt and answer, cut at what it says it holds (the last
    sampled token has no KV yet)."""
    if not prompt_ids or not isinstance(remote_num_tokens, int) or remote_num_tokens <= 0:
        return None
    kept = prompt_ids[:remote_num_tokens]
    return kept + list(output_ids or ())[:remote_num_tokens - len(kept)]


def verified_reuse(retained_ids: list[int], new_prompt_ids: list[int], claimed_tokens: int, block_size: int,
                   threshold: int) -> tuple[int, str, int]:
    """(tokens to pass as remote_num_tokens, or 0; outcome; verified common prefix in tokens)."""
    reachable = min(claimed_tokens, len(retained_ids), len(new_prompt_ids))
    verified = min(common_prefix_len(retained_ids, new_prompt_ids), reachable)
    tokens = verified // block_size * block_size
    if tokens <= 0 or tokens < threshold:
        return 0, (REFUSED_BELOW_THRESHOLD if verified == reachable else REFUSED_MISMATCH), verified
    return tokens, (PASSED if verified == reachable else CAPPED), verified
