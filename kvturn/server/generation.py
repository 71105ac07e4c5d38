"""One request's run through the engine, answered whole or as a stream: its text and logprobs as they come, P's pin
released once D has read it, and a client that leaves (or, streaming, stops reading) ending the sequence."""
import asyncio
import logging
import time

import orjson
from fastapi import Request
from fastapi.responses import Response

from kvturn.engine.async_engine import NotRead
from kvturn.engine.sequence import Sequence
from kvturn.errors import error_body, error_response, internal_error_message
from kvturn.server import openai, spans
from kvturn.server.text_stream import TextStream
from kvturn.server.worker import Worker

log = logging.getLogger("kvturn.worker")
DISCONNECT_CHECK_S = 0.5  # how often a whole answer being generated checks that its client is still there


class Generation:
    """One request's run through the engine, answered whole or as a stream."""

    def __init__(self, worker: Worker, seq: Sequence, plan, chat: bool, base: dict, traces=None, parent=None):
        """`traces`: the worker's Tracing when traces are on, `parent` the context the caller's `traceparent` named."""
        self.worker, self.seq, self.plan, self.chat, self.base = worker, seq, plan, chat, base
        self.traces, self.parent = traces, parent
        self.text = TextStream(worker.tokenizer.decode, seq.params.stop)
        self.released = [False]
        self.logprobs: list = []  # (token, logprob, [(alternative, logprob)...]) per generated token
        self.text_offset = 0

    def add_logprobs(self, out) -> dict | None:
        """The logprobs of `out`'s tokens in the API's shape, remembering them for the whole answer."""
        if out.logprobs is None:
            return None
        text = self.worker.token_text
        entries = [(text(token_id), lp.logprob, [(text(alt), value) for alt, value in lp.top])
                   for token_id, lp in zip(out.new_token_ids, out.logprobs)]
        self.logprobs += entries
        if self.chat:
            return openai.chat_logprobs(entries)
        shaped = openai.completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(len(token) for token, _, _ in entries)
        return shaped

    def trace(self) -> None:
        """The request's span, once it finished."""
        if self.traces is not None:
            worker, seq = self.worker, self.seq
            spans.record_request(self.traces, self.parent, seq, worker.kvturn_fields(seq), worker.usage(seq),
                                 worker.model_name, worker.config.role)

    def all_logprobs(self) -> dict | None:
        if self.seq.params.logprobs is None:
            return None
        return openai.chat_logprobs(self.logprobs) if self.chat else openai.completion_logprobs(self.logprobs, 0)

    async def complete(self, request: Request):
        worker, seq = self.worker, self.seq
        outputs = worker.async_engine.generate(seq)
        try:
            async for out in _until_disconnect(outputs, request):
                worker.release_pin_once(self.plan, self.released)
                self.text.add(out.new_token_ids)
                self.add_logprobs(out)
        finally:
            worker.release_pin_once(self.plan, self.released)
            await outputs.aclose()
        if seq.finish_reason is None:
            return error_response(499 if seq.aborted else 500, "request did not finish")
        worker.observe(seq)
        self.trace()
        body = {**self.base, "choices": [openai.choice(self.chat, self.text.final(), seq.finish_reason, False,
                                                       self.all_logprobs())],
                "usage": worker.usage(seq), "kvturn": worker.kvturn_fields(seq)}
        kv = worker.response_kv_params(seq)
        if kv is not None:
            body["kv_transfer_params"] = kv
        return Response(orjson.dumps(body), media_type="application/json")  # P's answer carries ~1,700 ints at 8k

    def not_read(self) -> None:
        """The client stopped reading the stream: its sequence was ended rather than left to pile up output."""
        self.worker.metrics.streams_not_read.inc()
        log.info("request %s ended: its client took nothing of its stream for %g s", self.base["id"],
                 self.worker.config.unread_stream_timeout_s)

    async def stream(self, include_usage: bool):
        worker, seq, chat = self.worker, self.seq, self.chat
        chunk_base = {**self.base, "object": "chat.completion.chunk" if chat else "text_completion"}
        outputs = worker.async_engine.generate(seq, worker.config.unread_stream_timeout_s, self.not_read)
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield openai.sse({**chunk_base, "choices": [first]})
            async for out in outputs:
                worker.release_pin_once(self.plan, self.released)
                delta = self.text.add(out.new_token_ids)
                logprobs = self.add_logprobs(out)
                if out.finished:
                    delta += self.text.flush()
                    worker.observe(seq)
                    self.trace()
                    chunk = {**chunk_base, "choices": [openai.choice(chat, delta, seq.finish_reason, True, logprobs)],
                             "kvturn": worker.kvturn_fields(seq)}
                    kv = worker.response_kv_params(seq)
                    if kv is not None:
                        chunk["kv_transfer_params"] = kv
                    yield openai.sse(chunk)
                    if include_usage:
                        yield openai.sse({**chunk_base, "choices": [], "usage": worker.usage(seq)})
                elif delta or logprobs:
                    yield openai.sse({**chunk_base, "choices": [openai.choice(chat, delta, None, True, logprobs)]})
            yield "data: [DONE]\n\n"
        except NotRead as exc:  # should the client read again after all
            yield openai.sse(error_body(408, f"the stream was ended: {exc}"))
        except Exception as exc:  # the engine died mid-stream: tell the client instead of hanging up silently
            log.exception("stream of request %s failed", self.base["id"])
            message = internal_error_message(f"generation failed: {type(exc).__name__}", self.base["id"])
            yield openai.sse({"error": {"message": message, "type": "InternalServerError", "param": None,
                                        "code": 500}})
        finally:
            worker.release_pin_once(self.plan, self.released)
            await outputs.aclose()


async def _until_disconnect(outputs, request: Request):
    """Iterate outputs, stopping if the client goes away (so its blocks are freed): checked every
    DISCONNECT_CHECK_S, whether tokens come fast or not at all."""
    iterator = outputs.__aiter__()
    checked = time.monotonic()
    while True:
        next_output = asyncio.ensure_future(iterator.__anext__())
        while True:
            done, _ = await asyncio.wait({next_output}, timeout=DISCONNECT_CHECK_S)
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    next_output.cancel()
                    await asyncio.wait({next_output})  # the generator must be left before its caller closes it
                    return
            if done:
                break
        try:
            yield next_output.result()
        except StopAsyncIteration:
            return
