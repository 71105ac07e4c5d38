"""The worker's HTTP routes: the OpenAI API (+ vLLM's /tokenize and /detokenize), health, metrics, and the
KV side channel for peers."""
import asyncio
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from kvturn import tracing
from kvturn.config import WorkerConfig
from kvturn.engine import step_history
from kvturn.engine.sequence import Sequence
from kvturn.errors import (BadRequest, error_response, install_error_handlers, internal_error_message,
                           parse_json_object)
from kvturn.kv_transfer import side_channel
from kvturn.kv_transfer.connector import ConnectorStats
from kvturn.registry import run_registration
from kvturn.server import openai, spans
from kvturn.server.openai import ChatCompletionRequest, CompletionRequest
from kvturn.server.text_stream import TextStream
from kvturn.server.worker import Worker

log = logging.getLogger("kvturn.worker")
CONVERSATION_HEADER = "X-Conversation-Id"
DISCONNECT_CHECK_S = 0.5  # how often a whole answer being generated checks that its client is still there
MAX_KEY_CHARS = 256


def validated(body: dict, model: type[BaseModel]):
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # located as FastAPI locates body errors, so one handler words them all
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def parse(request: Request, model: type[BaseModel]):
    return validated(parse_json_object(await request.body()), model)


def conversation_key(body, request: Request) -> str | None:
    key = body.conversation_id or request.headers.get(CONVERSATION_HEADER)
    if key is not None and len(key) > MAX_KEY_CHARS:
        raise BadRequest(f"conversation ids are at most {MAX_KEY_CHARS} characters", param="conversation_id")
    return key


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

    async def stream(self, include_usage: bool):
        worker, seq, chat = self.worker, self.seq, self.chat
        chunk_base = {**self.base, "object": "chat.completion.chunk" if chat else "text_completion"}
        outputs = worker.async_engine.generate(seq)
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
        except Exception as exc:  # the engine died mid-stream: tell the client instead of hanging up silently
            log.exception("stream of request %s failed", self.base["id"])
            message = internal_error_message(f"generation failed: {type(exc).__name__}", self.base["id"])
            yield openai.sse({"error": {"message": message, "type": "InternalServerError", "param": None,
                                        "code": 500}})
        finally:
            worker.release_pin_once(self.plan, self.released)
            await outputs.aclose()


def create_app(config: WorkerConfig) -> FastAPI:
    worker = Worker(config)
    traces = tracing.Tracing.start("worker" if config.role == "both" else config.role, config.otlp_traces_endpoint)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.async_engine.start()
        async with run_registration(config):
            yield
        await worker.peers.close()
        if worker.async_engine.alive and worker.connector:
            await worker.async_engine.call(worker.connector.leases.release_all)
        worker.async_engine.stop()
        if traces is not None:
            traces.close()

    app = FastAPI(title="kvturn worker", lifespan=lifespan)
    app.state.worker = worker
    install_error_handlers(app, log)
    secret = config.connector.cluster_secret

    @app.get("/health")
    async def health():
        if not worker.async_engine.alive:
            return error_response(503, "engine is not running")
        reply = {"status": "ok", "role": config.role, "engine_id": worker.engine_id, "backend": "kvturn"}
        if worker.connector is not None:
            leases = worker.connector.leases
            # A router guesses from it which tier holds a lease it knows (router/lease_tier.py).
            reply["retention"] = {"host_tier": worker.connector.host is not None,
                                  "pool_horizon_s": leases.pool_horizon_s()}
        return reply

    @app.get("/kv/calibration")
    async def calibration():
        """Prefill steps timed at start-up (engine/calibration.py), for routers to learn before any request; and the
        KV bytes a token takes and the reads from peers so far (as /metrics counts them)."""
        layout = worker.engine.kv_cache.layout
        stats = worker.connector.stats if worker.connector else ConnectorStats()  # a colocated worker reads none
        return {"role": config.role, "prefill_steps": worker.calibration,
                "kv_bytes_per_token": layout.block_bytes / layout.block_size,
                "kv_reads": {"reads": stats.kv_reads, "bytes": stats.kv_read_bytes, "seconds": stats.kv_read_seconds,
                             "step_seconds": stats.kv_read_step_seconds}}

    @app.get("/kv/steps")
    async def steps(request: Request):
        """The forward steps run since `?since=` (epoch seconds): what each computed and how long it took, which
        `kvturn bench` keeps for `kvturn plan` to calibrate from. Cluster members only: it tells when other
        clients' requests ran and how long they were."""
        if (denied := side_channel.refusal(request, secret, worker.metrics.side_channel_refusals.inc)) is not None:
            return denied
        started_s = finite_number(request.query_params.get("since", "0"), "since")
        if not worker.async_engine.alive:
            return error_response(503, "engine is not running")
        kept, dropped = step_history.since(await worker.async_engine.call(worker.engine.steps.snapshot), started_s)
        return Response(orjson.dumps({"role": config.role, "steps": [s.public() for s in kept], "dropped": dropped}),
                        media_type="application/json")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": worker.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvturn", "max_model_len": worker.engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's endpoint: the token ids a prompt or a chat renders to, as this worker computes them."""
        body = parse_json_object(await request.body())
        if body.get("model") is not None and body["model"] != worker.model_name:
            raise BadRequest(f"The model `{body['model']}` does not exist.", status=404, param="model")
        if "messages" in body:
            chat = validated(body, ChatCompletionRequest)
            tokens = worker.prompt_ids(chat)
        elif isinstance(body.get("prompt"), str):
            tokens = worker.tokenizer.encode(body["prompt"])
        else:
            raise BadRequest("give prompt (a string) or messages", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": worker.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = parse_json_object(await request.body()).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadRequest("tokens must be a list of token ids", param="tokens")
        worker.check_token_ids(tokens, "tokens")
        return {"prompt": worker.tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(await parse(request, CompletionRequest), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(await parse(request, ChatCompletionRequest), request, chat=True)

    async def generate(body, request: Request, chat: bool):
        arrival = time.perf_counter()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        caller_has_secret = side_channel.has_secret(request, secret)
        seq, plan = await worker.prepare(body, conversation_key(body, request), caller_has_secret, request_id, arrival)
        base = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": worker.model_name}
        parent = traces.parent(request.headers) if traces is not None else None
        generation = Generation(worker, seq, plan, chat, base, traces, parent)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(generation.stream(include_usage), media_type="text/event-stream")
        return await generation.complete(request)

    side_channel.mount(app, worker.connector, secret, worker.metrics.side_channel_refusals.inc,
                       worker.async_engine.call, worker.connect_back)
    return app


def finite_number(text: str, param: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise BadRequest(f"{param} must be a finite number, got {text[:40]!r}", param=param)
    return value


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
