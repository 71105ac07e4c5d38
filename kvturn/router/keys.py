"""Which conversation a request belongs to, and whose it is.

A conversation id comes, in this order of precedence, from the body's `conversation_id`, then the first of the
router's session headers the request carries (`--session-header`; by default kvturn's `X-Conversation-Id`, vLLM's
`X-Session-ID`, Dynamo's `X-Dynamo-Session-ID`, SGLang's gateway's `X-SMG-Routing-Key`, AIPerf's
`X-Correlation-ID`, Claude Code's `x-claude-code-session-id`, Codex's `session-id`); a chat request without any is
named by its history: the
router remembers the hash of each turn's history plus the answer it returned, and a later request whose
messages extend such a history continues that conversation. Ids are strings of at most 256 characters,
never truncated. With API keys, every id lives in its key's own namespace (`scope`), so one tenant can
neither reach nor probe another's conversations.
"""
import hashlib
import hmac
import json
from collections import OrderedDict
from dataclasses import dataclass

import orjson

from kvturn.config import RouterConfig, default_of
from kvturn.errors import BadRequest

MAX_ID_CHARS = 256
ID_HEADERS = tuple(default_of(RouterConfig, "session_headers"))
FINAL_HEADER = "X-Dynamo-Session-Final"  # Dynamo's: "true" on a session's last turn, as the body's end_session
_TEXT = (str, type(None))  # a message's role and content that orjson writes exactly as json does


@dataclass(frozen=True, slots=True)
class ConversationKey:
    client_id: str  # what the client named (or the derived id), shown back to it
    key: str  # the id within the caller's scope: what the table and the workers see
    derived: bool


def scoped(scope: str, client_id: str) -> str:
    """The key the table and the workers see: fixed length whatever the id (workers take at most 256 characters),
    distinct for ids that differ anywhere, and in the caller's namespace."""
    return f"{scope}:{hashlib.sha256(client_id.encode()).hexdigest()[:48]}"


def scope_of(api_key: str | None) -> str:
    """The namespace of a caller: a digest of its API key (never the key itself), or the shared one."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else "public"


def cache_salt(scope: str, client_salt, secret: str | None) -> str | None:
    """The `cache_salt` the workers get: one per tenant (API key) and per salt the client sent (vLLM's field), so a
    tenant's prompts never hit another's prefix cache, nor a client's another salt's; None for the shared namespace
    without a salt (nothing to keep apart). Keyed with the cluster secret, so a caller that reaches a worker port
    cannot compute a tenant's salt."""
    if client_salt is not None and (not isinstance(client_salt, str) or not 0 < len(client_salt) <= MAX_ID_CHARS):
        raise BadRequest(f"cache_salt must be a string of 1 to {MAX_ID_CHARS} characters", param="cache_salt")
    if scope == scope_of(None) and client_salt is None:
        return None
    material = f"{scope}\0{client_salt or ''}".encode("utf-8", "surrogatepass")
    if secret:
        return hmac.new(secret.encode(), material, hashlib.sha256).hexdigest()
    return hashlib.sha256(material).hexdigest()


def explicit_id(body: dict, headers, id_headers=ID_HEADERS) -> str | None:
    """The conversation id the client named (the body's, else the first of `id_headers` it sent), validated as the
    worker validates it."""
    value = body.pop("conversation_id", None)
    source = "conversation_id"
    if value is None:
        for header in id_headers:
            if headers.get(header) is not None:
                value, source = headers.get(header), header
                break
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{source} must be a non-empty string", param="conversation_id")
    if len(value) > MAX_ID_CHARS:
        raise BadRequest(f"{source} is {len(value)} characters; at most {MAX_ID_CHARS}", param="conversation_id")
    return value


def ends_session(headers) -> bool:
    """Whether the client says this turn is its session's last (Dynamo's header)."""
    return (headers.get(FINAL_HEADER) or "").strip().lower() == "true"


def _message_bytes(message) -> bytes:
    if not isinstance(message, dict):
        raise BadRequest("messages must be a list of {role, content} objects", param="messages")
    pair = [message.get("role"), message.get("content")]
    if isinstance(pair[0], _TEXT) and isinstance(pair[1], _TEXT):
        try:
            return orjson.dumps(pair)  # for text, byte for byte what json writes below, in a tenth of the time
        except orjson.JSONEncodeError:  # a lone surrogate, which json below keeps
            pass
    return json.dumps(pair, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass")


# Prompts the router counts with the model's tokenizer (turn_costs.TurnCosts.text_tokens): longer text, or more
# messages, is estimated from its bytes instead, since counting (~6 ms for 32 KiB of English, one call a message)
# holds the event loop.
MAX_COUNTED_BYTES = 32_768
MAX_COUNTED_MESSAGES = 64


class TextTokens:
    """Token counts of message texts, kept per conversation by a digest of the conversation's key and the text (most
    recently used first, at most `most`): an agent resends its whole history every turn, and counting all of it
    again on the router's event loop, milliseconds per few thousand tokens, held up every other turn in
    flight. Kept per conversation, so that how fast a text is counted tells no one whether another tenant sent it."""

    def __init__(self, tokenizer, most: int = 8192):
        self.tokenizer, self.most = tokenizer, most
        self.counts: OrderedDict[bytes, int] = OrderedDict()

    def count(self, text: str, conversation: str | None) -> int:
        """`text`'s tokens, as counted before in `conversation` (a scoped key); with none, counted afresh."""
        if conversation is None:
            return self.tokenizer.count(text)
        scope = conversation.encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(len(scope).to_bytes(4, "big"), digest_size=16)
        digest.update(scope)
        digest.update(text.encode("utf-8", "surrogatepass"))
        key = digest.digest()
        tokens = self.counts.get(key)
        if tokens is None:
            tokens = self.counts[key] = self.tokenizer.count(text)
            if len(self.counts) > self.most:
                self.counts.popitem(last=False)
        else:
            self.counts.move_to_end(key)
        return tokens


def countable_texts(messages: list | None, size: int) -> list[str] | None:
    """The contents of `messages` (`size` bytes, as message_size counts them) to count tokens of; None unless every
    content is text and there are at most MAX_COUNTED_MESSAGES messages of at most MAX_COUNTED_BYTES."""
    if messages is None or len(messages) > MAX_COUNTED_MESSAGES or size > MAX_COUNTED_BYTES:
        return None
    texts = [m.get("content") if isinstance(m, dict) else None for m in messages]
    return texts if all(isinstance(text, str) for text in texts) else None


def added_since(messages, order: int) -> list | None:
    """The messages sent after the answer of the turn that had `order` messages; None unless `messages` plainly
    extends that turn (its answer where it was, and something after it)."""
    if not isinstance(messages, list) or not 0 < order < len(messages) - 1:
        return None
    answer = messages[order]
    if not isinstance(answer, dict) or answer.get("role") != "assistant":
        return None
    return messages[order + 1:]


def message_size(message: dict) -> int:
    """A message's share of `History.size`."""
    return len(_message_bytes(message))


class History:
    """Digests of a chat history: `digests[i]` names `messages[:i + 1]`. Each chains on the one before, so all of
    them cost one pass over the messages (linear in the history's size, not quadratic)."""

    def __init__(self, scope: str, messages: list):
        self._running = hashlib.sha256(scope.encode())
        self.digests: list[str] = []
        self.size = 0  # bytes of the messages, from which the router estimates the prompt's tokens
        for message in messages:
            encoded = _message_bytes(message)
            self.size += len(encoded)
            self._running.update(hashlib.sha256(encoded).digest())
            self.digests.append(self._running.copy().hexdigest())

    def extended(self, message: dict) -> str:
        """The digest of this history followed by `message` (what the next turn's history will start with)."""
        running = self._running.copy()
        running.update(hashlib.sha256(_message_bytes(message)).digest())
        return running.hexdigest()
