"""The router's HTTP client (router/upstream.py) against a real socket server that misbehaves on purpose: every way
a worker can fail to answer must reach the turn as `Unreachable`, and a long streamed line (a lease record for a
long prompt) must pass whole."""
import asyncio

import pytest

from kvturn.router.upstream import Unreachable, Upstream

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


def test_refused_connection_is_unreachable():
    async def test(client):
        server, url = await serve(b"")
        server.close()
        await server.wait_closed()
        await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(Unreachable):
        run(with_client(test))


def test_body_cut_short_is_unreachable():
    async def test(client):
        server, url = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"partial\":")
        async with server:
            await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(Unreachable):
        run(with_client(test))


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


def test_silence_past_the_timeout_is_unreachable():
    async def test(client):
        server, url = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{", close_after=False)
        async with server:
            await client.post(url + "/v1/completions", b"{}")
    with pytest.raises(Unreachable):
        run(with_client(test, timeout_s=0.3))
