"""JSON for the long parts of a vLLM turn: the message history (encoded once, sent three times) and lists of thousands
of token ids (never parsed: cut out of the worker's JSON and kept as their text, see vllm_reuse.py).

A turn at 8k tokens carries ~35 KB of history and 8k ids in three places; the standard `json` module took the
router several ms of CPU per turn for them, over its budget of 2 ms. orjson does the same work in C, several times
faster; the standard module stays the fallback for what orjson refuses and `json` accepts (lone surrogates,
integers beyond 64 bits), so no request that worked before fails now."""
import json

import orjson

loads = orjson.loads  # its error is a json.JSONDecodeError (a ValueError), as the standard module's
_ID_LIST_BYTES = b"0123456789,"


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


def checked_ids(text: str) -> str | None:
    """`text` if it is the inside of a JSON list of token ids as vLLM writes one ("1,2,3"), else None."""
    if text.encode().translate(None, _ID_LIST_BYTES) or ",," in text or text.startswith(",") or text.endswith(","):
        return None
    return text


def ids_text(values) -> str | None:
    """A list of token ids as that text ("1,2,3"); None for anything else."""
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        return None
    return ",".join(map(str, values))
