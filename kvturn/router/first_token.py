"""Stream P's first token to the client as soon as P answers, before the decode worker is called.

P samples the answer's first token when it computes the prompt, and a kvturn decode worker continues from
that very token (`first_token_id` in P's pin) instead of sampling its own, even when it cannot use P's
blocks. So the router can send the token at once and drop it from what D streams afterwards: the client's
first token no longer waits for the hop to D, D's parse and D's read of the new blocks.

Only where D is sure to continue from that token and its text is final: no stop strings (they may cut
across tokens), no logprobs or seeded sampling (D samples those itself), one choice, P stopped by the
one-token cap rather than finished, and a token whose text is complete UTF-8.
"""
import json
from dataclasses import dataclass

from kvturn.router.answers import choice_text

REPLACEMENT_CHAR = "\ufffd"  # what a token that ends inside a UTF-8 sequence decodes to


class FirstTokenMismatch(Exception):
    """The decode worker's text does not begin with the token sent ahead: the stream cannot go on truthfully."""


def may_send_ahead(body: dict, chat: bool) -> bool:
    """Whether the request allows sending P's first token ahead (P's answer decides the rest). Logprobs are
    off only when absent, or `false` in a chat request (a completions request's `logprobs: 0` asks for them)."""
    logprobs = body.get("logprobs")
    return (body.get("stream") is True and not body.get("stop") and body.get("n") in (None, 1)
            and (logprobs is None or (chat and logprobs is False)) and body.get("top_logprobs") is None
            and body.get("seed") is None)


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class FirstToken:
    chat: bool
    base: dict  # id, object, created, model: the stream's chunks all carry P's
    text: str
    unmatched: int  # characters of D's text still to drop: the ones the client already has

    @classmethod
    def from_prefill(cls, body: dict, prefill: dict, chat: bool) -> "FirstToken | None":
        """The first token P sampled, if the router may send it ahead of the decode worker."""
        if not may_send_ahead(body, chat):
            return None
        choices = prefill.get("choices")
        kv = prefill.get("kv_transfer_params")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        if not isinstance(kv, dict) or not isinstance(kv.get("first_token_id"), int):
            return None  # P kept no pin with its token: D samples for itself
        choice = choices[0]
        text = choice_text(choice, chat, delta=False)
        if choice.get("finish_reason") != "length" or not isinstance(text, str) or not text \
                or REPLACEMENT_CHAR in text:
            return None
        base = {"id": prefill.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
                "created": prefill.get("created"), "model": prefill.get("model")}
        return cls(chat, base, text, len(text))

    def events(self) -> str:
        """What the client gets now: (for chat) the role, then the token's text."""
        if not self.chat:
            return _sse({**self.base, "choices": [{"index": 0, "text": self.text, "logprobs": None,
                                                   "finish_reason": None}]})
        return "".join(_sse({**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                       "finish_reason": None}]})
                       for delta in ({"role": "assistant", "content": ""}, {"content": self.text}))

    def trim(self, chunk: dict) -> bool:
        """Take out of D's chunk what the client already has (its role, the first token's text); False when
        nothing is left worth sending."""
        chunk.update(self.base)
        keep = any(key in chunk for key in ("usage", "kvturn", "kv_transfer_params", "error"))
        for choice in chunk.get("choices") or []:
            holder, field = ((choice.get("delta") or {}), "content") if self.chat else (choice, "text")
            holder.pop("role", None)
            text = holder.get(field) or ""
            if self.unmatched and text:
                cut = min(self.unmatched, len(text))
                expected = self.text[len(self.text) - self.unmatched:][:cut]
                if text[:cut] != expected:
                    raise FirstTokenMismatch
                holder[field], self.unmatched = text[cut:], self.unmatched - cut
            keep = keep or bool(holder.get(field) or choice.get("finish_reason") or choice.get("logprobs"))
        return keep
