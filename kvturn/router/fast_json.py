"""JSON shortcuts for the long parts of a vLLM turn: the message history (encoded once, sent three times) and lists
of thousands of token ids (parsed in C, and not at all when decode echoes the ids /tokenize already gave).

A turn at 8k tokens carries ~40 KB of history and 8k ids in three places; decoding and encoding them with `json`
each time cost the router a few ms of CPU per turn, over its budget of 2 ms."""
import json

import numpy as np


def encode_with(body: dict, key: str, encoded: str) -> bytes:
    """`body` as JSON, with `body[key]` taken from `encoded` (its JSON, made once for several requests)."""
    rest = json.dumps({k: v for k, v in body.items() if k != key}, separators=(",", ":"))
    joiner = "" if rest == "{}" else ","
    return f'{rest[:-1]}{joiner}"{key}":{encoded}}}'.encode()


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
    if not text.strip():
        return []
    try:
        ids = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:  # newer numpy refuses what older numpy stopped at quietly
        ids = None
    if ids is None or len(ids) != text.count(",") + 1 or "." in text or "e" in text or "E" in text:
        try:
            parsed = json.loads(f"[{text}]")
        except ValueError:
            return None
        return parsed if all(isinstance(i, int) and not isinstance(i, bool) for i in parsed) else None
    return ids.tolist()
