"""JSON for the long parts of a vLLM turn: the message history (encoded once, sent three times) and lists of thousands
of token ids (parsed once, and not at all when decode echoes the ids /tokenize already gave).

A turn at 8k tokens carries ~35 KB of history and 8k ids in three places; the standard `json` module took the
router several ms of CPU per turn for them, over its budget of 2 ms. orjson does the same work in C, several times
faster; the standard module stays the fallback for what orjson refuses and `json` accepts (lone surrogates,
integers beyond 64 bits), so no request that worked before fails now."""
import json

import orjson

loads = orjson.loads  # its error is a json.JSONDecodeError (a ValueError), as the standard module's
_INT_LIST_BYTES = b"0123456789,- \t\r\n"


def dumps(value) -> bytes:
    """Compact JSON in UTF-8 (what `json.dumps(value, separators=(",", ":"))` means, not always the same bytes)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


def encode_with(body: dict, key: str, encoded: bytes) -> bytes:
    """`body` as JSON, with `body[key]` taken from `encoded` (its JSON, made once for several requests)."""
    rest = dumps({k: v for k, v in body.items() if k != key})
    joiner = b"" if rest == b"{}" else b","
    return b"%s%s\"%s\":%s}" % (rest[:-1], joiner, key.encode(), encoded)


def cut_int_list(payload: str, key: str) -> tuple[str, str | None]:
    """(`payload` without its `"key":[...]` member, the list's text) or (`payload`, None) when it has none. A quote
    inside a JSON string is escaped, so the marker only matches a real member."""
    marker = f'"{key}":['
    start = payload.find(marker)
    if start < 0:
        return payload, None
    end = payload.find("]", start)
    if end < 0:
        return payload, None
    before, after = payload[:start], payload[end + 1:]
    if before.endswith(","):
        before = before[:-1]
    elif after.startswith(","):
        after = after[1:]
    return before + after, payload[start + len(marker):end]


def parse_int_list(text: str) -> list[int] | None:
    """The ints of a JSON list's inside (`1,2,3`); None if it is not one."""
    raw = text.encode()
    if raw.translate(None, _INT_LIST_BYTES):  # anything but ints (floats, strings, true, null) is not a token list
        return None
    try:
        return orjson.loads(b"[%s]" % raw)
    except orjson.JSONDecodeError:
        return None
