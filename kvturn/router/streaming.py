"""A turn's streamed answer: P's first token sent ahead where the backend allows it, then the decode worker's stream
relayed to the client as it comes, with the lease D returns at the end remembered for the next turn.

`Streaming` is a part of `turn.Turn`; it uses the turn's state (body, router, backend, work clock) and its
`open_decode`, `learn_and_trace` and `waiting`.
"""
import asyncio
import json
import logging
import time

from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from kvturn.errors import error_body
from kvturn.router import fast_json
from kvturn.router.answers import DecodeAnswer, choice_text
from kvturn.router.first_token import FirstToken, FirstTokenMismatch
from kvturn.router.upstream import Stream, TimedOut, Unreachable
from kvturn.router.workers import Claim

log = logging.getLogger("kvturn.router")


def stream_error(content: bytes, status: int, message: str = "the decode worker failed mid-stream") -> str:
    """An upstream error as an event of a stream already under way: the worker's own error if it sent one."""
    try:
        error = json.loads(content)
    except ValueError:
        error = None
    if not isinstance(error, dict) or not isinstance(error.get("error"), dict):
        error = error_body(status, message)
    return f"data: {json.dumps(error)}\n\n"


class Streaming:
    async def stream_decode(self, d_body: dict) -> Response:
        first = self.backend.first_token()
        if first is not None:
            events = self.stream_after_first_token(first, d_body)
            self.work.pause()  # until the stream's next line: Starlette starts the response meanwhile
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose))
        opened = await self.open_decode(d_body)
        if isinstance(opened, Response):
            return opened
        claim, response = opened
        self.work.pause()
        return StreamingResponse(self.relay(claim, response), media_type="text/event-stream",
                                 background=BackgroundTask(self.close_stream, claim, response))

    async def stream_after_first_token(self, first: FirstToken, d_body: dict):
        """P's first token now, then D's stream without it. The status is sent with the first token, so a
        decode worker that cannot be reached or refuses shows as an error event in the stream."""
        yield first.events()
        self.first_token_at, self.first_token_from = time.perf_counter(), "prefill"
        self.work.resume()
        opened = await self.open_decode_or_wait(d_body)
        if isinstance(opened, Response):
            self.work.pause()
            yield stream_error(opened.body, opened.status_code)
            return
        claim, response = opened
        relay = self.relay(claim, response, first)
        try:
            async for event in relay:
                yield event
        finally:  # also when the client left: the response's background task closes this generator
            await relay.aclose()
            claim.release()
            await response.close()

    async def open_decode_or_wait(self, d_body: dict) -> tuple[Claim, Stream] | Response:
        """open_decode for a stream whose status already went out with P's first token: when no decode worker is
        left, wait for one to come back (a restarted one) within no_worker_wait_s and open it then. P keeps the
        prompt's blocks pinned meanwhile, and a decode worker that finds them gone recomputes them, continuing
        from the same first token."""
        router = self.router
        deadline = asyncio.get_running_loop().time() + router.config.no_worker_wait_s
        opened = await self.open_decode(d_body)
        while (isinstance(opened, Response) and opened.status_code == 503 and not router.decode.healthy()
               and await self.waiting(router.wait_for_workers(deadline))):
            self.retried("worker_back")
            opened = await self.open_decode(d_body)
        return opened

    async def close_stream(self, claim: Claim, response: Stream) -> None:
        """Runs after the response, even when the client left before the relay began."""
        claim.release()
        await response.close()

    async def relay(self, claim: Claim, response: Stream, first: FirstToken | None = None):
        """D's stream, event by event, to the client; the work clock runs only between reading a line and
        handing its event on."""
        router, backend, worker_url = self.router, self.backend, claim.worker.url
        answer, kv, finish_reason, finished, last_token_at = [], None, None, False, None
        lines = response.lines()
        try:
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    break
                self.work.resume()
                if not line.startswith("data: "):
                    self.work.pause()
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    # Record the lease before the last write: a client may hang up right after [DONE].
                    finished = True
                    await backend.remember(DecodeAnswer(worker_url, "".join(answer), kv, streamed=True,
                                                        finish_reason=finish_reason))
                    router.metrics.requests.labels("ok").inc()
                    backend.observe_work()
                    self.work.pause()
                    yield "data: [DONE]\n\n"
                    continue
                chunk = backend.read_chunk(payload)
                for choice in chunk.get("choices") or []:
                    answer.append(choice_text(choice, self.chat, delta=True) or "")
                    finish_reason = choice.get("finish_reason") or finish_reason
                now = time.perf_counter()
                if answer and answer[-1]:
                    claim.work_done()  # D has computed the prompt (a chat stream's first chunk only names the role)
                    if self.first_token_at is None:
                        self.first_token_at = now
                    elif last_token_at is not None:
                        claim.worker.token_gaps_ms.append((now - last_token_at) * 1e3)
                    last_token_at = now
                if "kv_transfer_params" in chunk:
                    kv = chunk["kv_transfer_params"] if self.want_kv else chunk.pop("kv_transfer_params")
                if first is not None and not first.trim(chunk):
                    self.work.pause()
                    continue
                backend.strip_ids(chunk)
                backend.honest_usage(chunk.get("usage"))
                if backend.reports_on(chunk, finish_reason):
                    learned = self.learn_and_trace(chunk.get("kvturn"))
                    chunk["kvturn"] = self.client_report(chunk.get("kvturn"), worker_url, learned)
                event = b"data: %s\n\n" % fast_json.dumps(chunk)
                self.work.pause()
                yield event
        except TimedOut:
            yield stream_error(b"", 504, f"the decode worker sent nothing for {router.config.upstream_timeout_s:g} s")
        except (Unreachable, json.JSONDecodeError) as exc:
            log.warning("decode worker %s failed mid-stream: %s", worker_url, exc)
            yield stream_error(b"", 503)
        except FirstTokenMismatch:
            log.error("decode worker %s did not continue from the first token sent ahead; ending the stream",
                      worker_url)
            yield stream_error(b"", 500, "the decode worker's answer does not continue the first token sent")
        finally:
            self.work.pause()
            await self.end_relay(claim, response, finished)

    async def end_relay(self, claim: Claim, response: Stream, finished: bool) -> None:
        """A relay ended, whichever way: D's load released, and a stream cut short counted as a decode error
        with the conversation's entry dropped (D retained nothing for the next turn)."""
        claim.release()
        if not finished:
            if self.key:
                await self.router.table.drop(self.key)
            self.router.metrics.requests.labels("decode_error").inc()
        await response.close()
