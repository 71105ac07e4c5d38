"""How much of a vLLM decode worker's retained KV the next prefill may load: pure, checked in token space.

vLLM's prefill side loads `min(remote_num_tokens, prompt_tokens)` tokens from the decode worker by position and
checks nothing, so an edited history (or an answer that re-tokenizes differently once rendered into the next
prompt) would be served on stale KV. The router caps `remote_num_tokens` at the prefix the new prompt really
shares with the tokens the decode worker retained.

Token ids stay the text vLLM writes, the inside of a JSON list ("1,2,3"): turning 8k of them into Python ints cost
more than the rest of the router's work on a turn. Two such texts hold the same first n ids exactly when they agree
up to the end of the n-th id (equal text is equal ids, and vLLM writes an id one way only).
"""
PASSED = "passed"  # the new prompt starts with every retained token (up to block rounding)
CAPPED = "capped"  # the prompt diverges inside the retained tokens: only the verified prefix is passed
REFUSED_BELOW_THRESHOLD = "refused_below_threshold"  # it all matches, but too little to be worth a read
REFUSED_MISMATCH = "refused_mismatch"  # it diverges so early that the verified prefix is below the threshold
NO_PARAMS = "no_params"  # nothing retained for this conversation
NO_TOKEN_IDS = "no_token_ids"  # params kept without the token ids they hold: cannot be verified
TOKENIZE_FAILED = "tokenize_failed"  # the new prompt's token ids could not be had
OUTCOMES = (PASSED, CAPPED, REFUSED_BELOW_THRESHOLD, REFUSED_MISMATCH, NO_PARAMS, NO_TOKEN_IDS, TOKENIZE_FAILED)


def count_tokens(ids: str) -> int:
    return ids.count(",") + 1 if ids else 0


def common_prefix_len(a: str, b: str) -> int:
    """How many leading token ids two id texts share: the common text found by halving, in C, then its ids."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # a[:low] == b[:low], and the text they share is at most high characters long
        mid = (low + high + 1) // 2
        if b.startswith(a[low:mid], low):
            low = mid
        else:
            high = mid - 1
    ids = a.count(",", 0, low)
    both_end_an_id = (low == len(a) or a[low] == ",") and (low == len(b) or b[low] == ",")
    return ids + 1 if low and both_end_an_id else ids


def joined_ids(prompt_ids: str, output_ids: str | None) -> str:
    return f"{prompt_ids},{output_ids}" if output_ids else prompt_ids


def retained_token_ids(prompt_ids: str | None, output_ids: str | None, remote_num_tokens: int | None) -> str | None:
    """The tokens whose KV the decode worker kept: its prompt and answer, cut at what it says it holds (the last
    sampled token has no KV yet)."""
    if not prompt_ids or not isinstance(remote_num_tokens, int) or remote_num_tokens <= 0:
        return None
    ids = joined_ids(prompt_ids, output_ids)
    cut = len(ids)
    for _ in range(count_tokens(ids) - remote_num_tokens):  # usually one or none
        cut = ids.rfind(",", 0, cut)
    return ids[:cut]


def verified_reuse(retained_ids: str, new_prompt_ids: str, claimed_tokens: int, block_size: int,
                   threshold: int) -> tuple[int, str, int]:
    """(tokens to pass as remote_num_tokens, or 0; outcome; verified common prefix in tokens)."""
    reachable = min(claimed_tokens, count_tokens(retained_ids), count_tokens(new_prompt_ids))
    verified = min(common_prefix_len(retained_ids, new_prompt_ids), reachable)
    tokens = verified // block_size * block_size
    if tokens <= 0 or tokens < threshold:
        return 0, (REFUSED_BELOW_THRESHOLD if verified == reachable else REFUSED_MISMATCH), verified
    return tokens, (PASSED if verified == reachable else CAPPED), verified
