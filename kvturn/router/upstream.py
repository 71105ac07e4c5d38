"""The router's HTTP client to its workers, and the only place that knows which library it is.

aiohttp, not httpx: a turn's call to the prefill worker sends the whole history and gets a JSON answer back, and
that round trip sits inside the time to first token. Side by side in `benchmarks/router_overhead.py` (8k-token
turns), the router's process spent 3.1 ms of CPU per non-streamed turn with aiohttp against 5.7 ms with httpx.

Every way a worker can fail to answer reaches the turn as one exception, `Unreachable`: no connection, a
redirect (never followed: it would carry the cluster secret and the history to another host), a broken or
cut-off reply, a line past `MAX_LINE`, or `timeout_s` without progress, whether the worker stops reading the
request or stops sending its answer. The last is `TimedOut`, a kind of it: a worker that took the request and
is still at work on it (a long prompt, a long answer) is slow, not dead, and only its health probe says
whether it is alive.
"""
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson
from yarl import URL

_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError)
MAX_LINE = 8 << 20  # a streamed line may carry a whole lease record (block hashes and ids for a long prompt)
BODY_CHUNK = 256 << 10  # a request body is written this much at a time, each piece a sign of progress


class Unreachable(Exception):
    """The worker did not answer: no connection, a redirect, a broken or cut-off reply, or no progress within
    the timeout."""


class TimedOut(Unreachable):
    """The worker was connected to and had the request, but sent nothing for the timeout."""


def _failure(exc: BaseException) -> Unreachable:
    """What a failure of the HTTP client means: a timeout once connected (not the connect's own) is TimedOut."""
    if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        return TimedOut(f"no progress within the timeout ({exc!r})")
    return Unreachable(repr(exc))


@dataclass(slots=True)
class Reply:
    status: int
    content: bytes
    content_type: str = ""

    def json(self):
        return orjson.loads(self.content)


class Stream:
    """A worker's answer whose status and headers are in and whose body is read as it comes."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response
        self.status = response.status

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except _FAILURES as exc:
            raise _failure(exc) from exc

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines, decoded, without their line ends. Split here rather than by aiohttp, whose limit on a
        line is tied to its read buffer: a buffer big enough for the longest line would let every stream hold that
        much of the router's memory."""
        pending = bytearray()
        try:
            async for data in self._response.content.iter_any():
                start = len(pending)
                pending += data
                cut = 0
                while (end := pending.find(b"\n", start)) >= 0:
                    if end - cut > MAX_LINE:
                        break
                    yield pending[cut:end].decode().rstrip("\r")
                    cut = start = end + 1
                del pending[:cut]
                if len(pending) > MAX_LINE:
                    raise Unreachable(f"the worker sent a line longer than {MAX_LINE} bytes")
        except _FAILURES as exc:
            raise _failure(exc) from exc
        if pending:
            yield pending.decode().rstrip("\r")

    async def close(self) -> None:
        """Done with it: a body left unread closes the connection, which tells the worker the caller left."""
        self._response.close()


class _Progress:
    """The deadline on writing a request: `stall_s` after the last piece began, lifted once all are out (the
    answer's silence is aiohttp's sock_read) or the request has returned (a worker may answer before reading all)."""

    def __init__(self, deadline: asyncio.Timeout, stall_s: float):
        self.deadline, self.stall_s, self.active = deadline, stall_s, True

    def piece(self) -> None:
        if self.active and not self.deadline.expired():
            self.deadline.reschedule(asyncio.get_running_loop().time() + self.stall_s)

    def done(self) -> None:
        if self.active and not self.deadline.expired():
            self.deadline.reschedule(None)
        self.active = False


async def _pieces(content: bytes, watch: _Progress):
    """The body in pieces: each is asked for once the one before is written and drained, so the deadline moves
    on with every piece and is lifted when the last one is out."""
    for start in range(0, len(content), BODY_CHUNK):
        watch.piece()
        yield content[start:start + BODY_CHUNK]
    watch.done()


# An idle connection to a worker is reused for at most this long. A server closes its idle connections after
# its keep-alive (uvicorn's and vLLM's default: 5 s); a request sent on one just as the server closes it fails
# with a disconnect, and the router takes the worker for dead. Seen in a bench run: the only prefill worker left
# the rotation for half a second and a turn got a 503.
IDLE_CONNECTION_S = 4.0  # kvturn's own servers keep theirs longer still (config.SERVER_KEEP_ALIVE_S)


class Upstream:
    def __init__(self, timeout_s: float, headers: dict[str, str]):
        self.timeout_s = timeout_s
        # sock_read: silence while the answer comes; the request's own writing is watched in _send. No limit on
        # connections in the pool: each one is a request the router has already admitted, and a wait for a free
        # one would read as a dead worker.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s)
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Inside the running event loop, which the session belongs to."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S), headers=self._headers,
            timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _send(self, method: str, url: str | URL, content: bytes | None,
                    timeout_s: float | None, extra_headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """Send a request; return once the answer's status and headers are in. A worker that stops reading the
        request fails it after `timeout_s` without progress (aiohttp times only the answer)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else self._timeout
        stall_s = timeout_s or self.timeout_s
        try:
            async with asyncio.timeout(None) as deadline:
                watch = _Progress(deadline, stall_s)
                headers, data = None, None
                if content is not None:
                    headers = {"Content-Type": "application/json", "Content-Length": str(len(content))}
                    data = _pieces(content, watch)
                if extra_headers:
                    headers = {**(headers or {}), **extra_headers}
                try:
                    response = await self._session.request(method, url, data=data, headers=headers,
                                                           timeout=timeout, allow_redirects=False)
                finally:
                    watch.done()
        except _FAILURES as exc:
            raise _failure(exc) from exc
        if 300 <= response.status < 400:
            response.close()
            raise Unreachable(f"the worker answered a redirect ({response.status}), which is not followed")
        return response

    async def call(self, method: str, url: str | URL, content: bytes | None = None,
                   timeout_s: float | None = None, headers: dict[str, str] | None = None) -> Reply:
        """One request, its whole answer read; `headers` beside the client's own (a trace's `traceparent`)."""
        response = await self._send(method, url, content, timeout_s, headers)
        try:
            return Reply(response.status, await response.read(), response.headers.get("Content-Type", ""))
        except _FAILURES as exc:
            raise _failure(exc) from exc
        finally:
            response.release()

    async def post(self, url: str | URL, content: bytes, timeout_s: float | None = None,
                   headers: dict[str, str] | None = None) -> Reply:
        return await self.call("POST", url, content, timeout_s, headers)

    async def get(self, url: str | URL, timeout_s: float | None = None) -> Reply:
        return await self.call("GET", url, None, timeout_s)

    async def open(self, url: str | URL, content: bytes, headers: dict[str, str] | None = None) -> Stream:
        """POST and return once the status and headers are in; the caller reads the body and closes it."""
        return Stream(await self._send("POST", url, content, None, headers))
