"""Incremental detokenization with stop strings: emit only text that is final."""
from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.stop = stop
        self.token_ids: list[int] = []
        self.sent = 0
        self.stopped_at: int | None = None
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def _text(self) -> str:
        text = self.decode(self.token_ids)
        for s in self.stop:
            at = text.find(s)
            if at != -1 and (self.stopped_at is None or at < self.stopped_at):
                self.stopped_at = at
        return text if self.stopped_at is None else text[:self.stopped_at]

    def add(self, token_ids: list[int]) -> str:
        """New token ids in; the text that can be shown now out."""
        self.token_ids.extend(token_ids)
        text = self._text()
        safe = len(text) if self.stopped_at is not None else len(text) - self.hold_back
        while safe > self.sent and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence may still complete
            safe -= 1
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta

    def flush(self) -> str:
        text = self._text()
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def final(self) -> str:
        return self._text()
