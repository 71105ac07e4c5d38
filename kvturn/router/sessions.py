"""Ending a session: `DELETE /v1/conversations/{id}` releases the KV a decode worker retains for the conversation, at
once, instead of holding it until its lease expires.

The id is the caller's own (`conversation_id`, `X-Conversation-Id`, or the `derived-...` id a response names in
`kvturn.conversation_id`), taken in the caller's scope like every id (keys.py): with API keys, a tenant can end
only its own conversations, and another tenant's id is simply not found (404, as an id never used), so it can be
neither ended nor probed. The router then tells the decode worker that holds the lease to drop it, over the side
channel with the cluster secret (`POST /kv/conversation/release`), and forgets the conversation. A conversation
the router no longer knows (its entry expired, or another router replica's table lost it) is released on every
kvturn decode worker: the scoped key matches nothing but that conversation's own lease there.

A client may instead end the session with its last turn: `"end_session": true` in that request's body (or Dynamo's
header `X-Dynamo-Session-Final: true`) releases the lease the turn leaves, once its answer is sent (the one way to
end a conversation named by its history alone).
"""
import asyncio
import logging

import orjson
from fastapi import FastAPI, Request
from starlette.background import BackgroundTasks

from kvturn.errors import BadRequest, error_response
from kvturn.router import keys
from kvturn.router.upstream import Unreachable

log = logging.getLogger("kvturn.router")
RELEASE_PATH = "/kv/conversation/release"


async def release_at(router, url: str, key: str) -> bool:
    """Ask the decode worker at `url` to drop what it retains for `key`; whether it had something to drop."""
    try:
        reply = await router.http.post(url + RELEASE_PATH, orjson.dumps({"binding_key": key}), timeout_s=5.0)
        return reply.status == 200 and reply.json().get("released") is True
    except (Unreachable, ValueError, AttributeError):
        log.info("could not release conversation KV at %s; its lease expires on its own", url)
        return False


async def end_conversation(router, key: str, conversation_id: str) -> dict | None:
    """Release the retained KV of the conversation of (scoped) `key` and forget it; None if neither the router nor a
    worker knew it."""
    entry, _ = await router.table.lookup(key)
    holders = [w for w in router.decode.healthy() if w.backend == "kvturn"]
    if entry is not None:
        holders = [w for w in holders if w.url == entry.decode_url]
    released = await asyncio.gather(*(release_at(router, w.url, key) for w in holders))
    await router.table.drop(key)
    if entry is None and not any(released):
        return None
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True, "kv_released": any(released)}


def ending_after(response, router, conversation) -> None:
    """Release the conversation's KV once `response` (the last turn's answer, streamed or whole) is sent, after
    what the response already does then (a stream closes its worker's answer)."""
    tasks = BackgroundTasks()
    if response.background is not None:
        tasks.add_task(response.background)
    tasks.add_task(end_conversation, router, conversation.key, conversation.client_id)
    response.background = tasks
    router.metrics.sessions_ended.labels("end_session").inc()


def mount(app: FastAPI, router) -> None:
    @app.delete("/v1/conversations/{conversation_id:path}")
    async def delete_conversation(conversation_id: str, request: Request):
        scope = router.caller_scope(request)
        if not conversation_id or len(conversation_id) > keys.MAX_ID_CHARS:
            raise BadRequest(f"conversation ids are 1 to {keys.MAX_ID_CHARS} characters", param="conversation_id")
        ended = await end_conversation(router, keys.scoped(scope, conversation_id), conversation_id)
        router.metrics.sessions_ended.labels("released" if ended else "not_found").inc()
        if ended is None:
            return error_response(404, f"no conversation {conversation_id!r} is known", param="conversation_id")
        return ended
