"""A turn whose client leaves is cancelled end to end. Starlette does not cancel a handler when its client hangs up,
and a non-streamed turn (or a streamed one still waiting for its prefill) would otherwise run to its end: P and D
computing, D generating up to max_tokens, for nobody. Cancelling the turn's task closes its connections to the
workers, which they notice and abort the sequence, freeing its blocks (kvturn/server/app.py)."""
import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import Response

from kvturn.errors import error_response

log = logging.getLogger("kvturn.router")


async def _client_gone(request: Request) -> None:
    """Returns when the client hangs up: once its body is read, the server's next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, turn: Awaitable[Response], on_leave) -> Response:
    """`turn`'s response, or, when the client hangs up first, the turn cancelled (its cleanup run) and a 499 that
    nobody reads; `on_leave()` is called then."""
    work = asyncio.ensure_future(turn)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        gone.cancel()
    if work.cancelled():
        on_leave()
        log.info("client left %r before its answer; the turn was cancelled", request.url.path)
        return error_response(499, "the client closed the connection")
    return work.result()
