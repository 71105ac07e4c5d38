"""The router's HTTP client (router/upstream.py) against a real socket server that misbehaves on purpose: every way
a worker can fail to answer must reach the turn as `Unreachable` (and silence once connected as its kind
`TimedOut`: slow, not dead), and a long streamed line (a lease record for a long prompt) must pass whole."""
import asyncio

import pytest

from kvturn.router.upstream import TimedOut, Unreachable, Upstream

LONG_LINE = b"data: " + b"7" * 300_000  # over aiohttp's default limit (128 KiB)


async def serve(answer: bytes, close_after: bool = True):
    """A server that reads one request and writes `answer` as is (then hangs up, unless told not to)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if close_after:
            writer.close()
        else:
            await asyncio.sleep(5)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def run(coroutine):
    return asyncio.run(coroutine)


async def with_client(test, timeout_s: float = 5.0):
    client = Upstream(timeout_s, {})
    await client.start()
    try:
        return await test(client)
    finally:
        await client.close()


def test_whole_answer_and_status():
    async def test(client):
        server, url = await serve(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 11\r\n\r\n{\"e\": true}")
        async with server:
            reply = await client.post(url + "/v1/completions", b"{}")
        return reply
    reply = run(with_client(test))
    assert (reply.status, reply.json(), reply.content_type) == (503, {"e": True}, "application/json")


def test_long_streamed_line_passes_whole():
    body = LONG_LINE + b"\n\ndata: [DONE]\n\n"
    async def test(client):
        server, url = await serve(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        async with server:
            stream = await client.open(url + "/v1/completions", b"{}")
            lines = [line async for line in stream.lines()]
            await stream.close()
        return lines
    assert run(with_client(test)) == [LONG_LINE.decode(), "", "data: [DONE]", ""]


def test_refused_connection_is_unreachable_not_a_timeout():
    async def test(client):
        server, url = await serve(b"")
        server.close()
        await server.wait_closed()
        await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(Unreachable) as failure:
        run(with_client(test))
    assert not isinstance(failure.value, TimedOut)


def test_body_cut_short_is_unreachable_not_a_timeout():
    async def test(client):
        server, url = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"partial\":")
        async with server:
            await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(Unreachable) as failure:
        run(with_client(test))
    assert not isinstance(failure.value, TimedOut)


def test_a_connection_reset_before_any_answer_is_unreachable_not_a_timeout():
    async def test(client):
        server, url = await serve(b"")  # reads the request, then hangs up without a word
        async with server:
            await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(Unreachable) as failure:
        run(with_client(test))
    assert not isinstance(failure.value, TimedOut)


def test_stream_cut_short_is_unreachable():
    async def test(client):
        server, url = await serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b"c\r\ndata: {}\n\n\n\r\n")  # a first chunk, then the connection closes
        async with server:
            stream = await client.open(url + "/v1/completions", b"{}")
            lines = []
            try:
                async for line in stream.lines():
                    lines.append(line)
            finally:
                await stream.close()
    with pytest.raises(Unreachable):
        run(with_client(test))


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{"])
def test_silence_past_the_timeout_once_connected_is_a_timeout(answer):
    """Before the status line (a whole answer being computed) or within the body: the worker is at work, or stuck;
    which of the two is for its health probe to say, not for this call."""
    async def test(client):
        server, url = await serve(answer, close_after=False)
        async with server:
            await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(TimedOut):
        run(with_client(test, timeout_s=0.3))


def test_redirect_is_not_followed():
    """A worker (or whatever answers at its address) cannot send the cluster secret and the history elsewhere."""
    seen = []

    async def test(client):
        other, other_url = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        seen.append(other)
        redirect, url = await serve(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + other_url.encode() +
                                    b"/steal\r\nContent-Length: 0\r\n\r\n")
        async with redirect, other:
            return await client.post(url + "/v1/completions", b'{"messages": "secret history"}')
    with pytest.raises(Unreachable, match="redirect"):
        run(with_client(test))


def test_worker_that_stops_reading_the_request_is_unreachable():
    """A body larger than the socket buffers to a worker that never reads: given up after the timeout without
    progress, not held forever (aiohttp itself times only the answer)."""
    async def test(client):
        async def never_read(reader, writer):
            await asyncio.sleep(30)
        server = await asyncio.start_server(never_read, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            started = asyncio.get_running_loop().time()
            try:
                await client.post(url + "/v1/completions", b"x" * (32 << 20))
            finally:
                elapsed = asyncio.get_running_loop().time() - started
        return elapsed
    with pytest.raises(TimedOut):
        run(asyncio.wait_for(with_client(test, timeout_s=0.5), 20))


def test_line_past_the_limit_is_unreachable():
    from kvturn.router.upstream import MAX_LINE
    body = b"data: " + b"7" * (MAX_LINE + 10) + b"\n\n"

    async def test(client):
        server, url = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        async with server:
            stream = await client.open(url + "/v1/completions", b"{}")
            try:
                return [line async for line in stream.lines()]
            finally:
                await stream.close()
    with pytest.raises(Unreachable, match="longer than"):
        run(with_client(test))
