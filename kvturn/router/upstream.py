"""The router's HTTP client to its workers, and the only place that knows which library it is.

aiohttp, not httpx: a turn's call to the prefill worker sends the whole history and gets a JSON answer back, and
that round trip sits inside the time to first token. With a 35 KB request and a 30 KB answer on loopback, httpx's
pure-Python HTTP/1.1 took 1.1-1.4 ms of CPU per round trip where aiohttp (C parser) took 0.35-0.4 ms, and relaying
a stream line by line is cheaper too. Every way a worker can fail to answer (refused, reset, timed out, a broken
body) reaches the turn as one exception, `Unreachable`.
"""
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson
from yarl import URL

_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError)
# A streamed line may carry a whole lease record (block hashes and ids for a long prompt): aiohttp refuses lines
# longer than twice its read buffer, 128 KiB by default.
READ_BUFFER = 1 << 22


class Unreachable(Exception):
    """The worker did not answer: no connection, a broken or cut-off reply, or silence past the timeout."""


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
            raise Unreachable(repr(exc)) from exc

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines, decoded, without their line ends."""
        try:
            async for line in self._response.content:
                yield line.decode().rstrip("\r\n")
        except (*_FAILURES, ValueError) as exc:  # ValueError: a line over 2 x READ_BUFFER
            raise Unreachable(repr(exc)) from exc

    async def close(self) -> None:
        """Done with it: a body left unread closes the connection, which tells the worker the caller left."""
        self._response.close()


class Upstream:
    def __init__(self, timeout_s: float, headers: dict[str, str]):
        self._timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=timeout_s)
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Inside the running event loop, which the session belongs to."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60),
            headers=self._headers, timeout=self._timeout, read_bufsize=READ_BUFFER, skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _send(self, method: str, url: str | URL, content: bytes | None,
                    timeout_s: float | None) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else None
        try:
            return await self._session.request(method, url, data=content, headers=headers,
                                               timeout=timeout or self._timeout)
        except _FAILURES as exc:
            raise Unreachable(repr(exc)) from exc

    async def call(self, method: str, url: str | URL, content: bytes | None = None,
                   timeout_s: float | None = None) -> Reply:
        """One request, its whole answer read."""
        response = await self._send(method, url, content, timeout_s)
        try:
            return Reply(response.status, await response.read(), response.headers.get("Content-Type", ""))
        except _FAILURES as exc:
            raise Unreachable(repr(exc)) from exc
        finally:
            response.release()

    async def post(self, url: str | URL, content: bytes, timeout_s: float | None = None) -> Reply:
        return await self.call("POST", url, content, timeout_s)

    async def get(self, url: str | URL, timeout_s: float | None = None) -> Reply:
        return await self.call("GET", url, None, timeout_s)

    async def open(self, url: str | URL, content: bytes) -> Stream:
        """POST and return once the status and headers are in; the caller reads the body and closes it."""
        return Stream(await self._send("POST", url, content, None))
