"""The router's guess of what a prefill worker's prefix cache holds of a conversation: which P last computed its
prompt, and how much of such a prompt that P's cache has still held when a turn came back to it (learned from its
reports, 0 until it has said). A turn that meets the P holding its history is then priced as the few new tokens it
is, not as the whole prompt or a pull of it; P's cache itself stays P's own."""
from collections import OrderedDict

HELD_SHARE_WEIGHT = 0.2  # of each new report in a prefill worker's learned share


class PrefixMemory:
    def __init__(self, max_conversations: int):
        self.max_conversations = max_conversations
        self.last: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key -> (P's URL, prompt tokens it computed)
        self.held_share: dict[str, float] = {}  # P's URL -> share of a returning turn's history its cache held

    def expected_cached(self, key: str | None, prefill_url: str) -> int:
        """Prompt tokens `prefill_url`'s prefix cache likely holds for conversation `key`."""
        last = self.last.get(key) if key is not None else None
        if last is None or last[0] != prefill_url:
            return 0
        return int(last[1] * self.held_share.get(prefill_url, 0.0))

    def observe(self, key: str | None, prefill_url: str, prompt_tokens: int, cached_tokens: int) -> None:
        """P `prefill_url` computed this turn's prompt of `prompt_tokens`, of which its cache held `cached_tokens`."""
        if key is None or not prefill_url or prompt_tokens <= 0:
            return
        last = self.last.get(key)
        if last is not None and last[0] == prefill_url and last[1] > 0:
            share = min(max(cached_tokens, 0) / last[1], 1.0)
            before = self.held_share.get(prefill_url)
            self.held_share[prefill_url] = share if before is None else \
                (1 - HELD_SHARE_WEIGHT) * before + HELD_SHARE_WEIGHT * share
        self.last[key] = (prefill_url, prompt_tokens)
        self.last.move_to_end(key)
        while len(self.last) > self.max_conversations:
            self.last.popitem(last=False)
