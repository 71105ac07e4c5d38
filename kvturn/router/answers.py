"""A worker's answer as the router reads it: the JSON object it must be, the text of a choice, what a decode
worker's answer leaves for the next turn, and what of the turn's report a client may see."""
from dataclasses import dataclass

from kvturn.router import fast_json


def answer_object(content: bytes | str) -> dict | None:
    """A worker's 200 answer as the JSON object it must be; None if it is anything else."""
    try:
        result = fast_json.loads(content)
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def choice_text(choice: dict, chat: bool, delta: bool) -> str | None:
    """The text of a choice as `choice` makes it (and any OpenAI server): a chat message's or stream delta's
    content, or a completion's text."""
    if not chat:
        return choice.get("text")
    return (choice.get("delta" if delta else "message") or {}).get("content")


@dataclass(slots=True)
class DecodeAnswer:
    """What a decode worker answered, as the turn keeps it for the conversation's next turn."""
    decode_url: str
    text: str | None
    kv: dict | None  # its kv_transfer_params: what it retained for the next turn
    streamed: bool
    finish_reason: str | None = None


INTERNAL_FIELDS = ("prefill_worker", "decode_worker", "engine_id")  # where a turn ran: the cluster's, not a client's


def concealed(report: dict) -> dict:
    """The `kvturn` object a client sees unless the router exposes internals: no worker URL or engine id, at any
    depth (D's own report rides in it)."""
    return {name: concealed(value) if isinstance(value, dict) else value
            for name, value in report.items() if name not in INTERNAL_FIELDS}
