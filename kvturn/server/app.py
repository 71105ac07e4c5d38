"""The worker's HTTP routes: the OpenAI API (+ vLLM's /tokenize and /detokenize), health, metrics, and the
KV side channel for peers. A request's run through the engine, whole or streamed, is generation.py's."""
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
from kvturn.errors import BadRequest, error_response, install_error_handlers, parse_json_object, read_body
from kvturn.http_server import instance_headers
from kvturn.kv_transfer import side_channel
from kvturn.kv_transfer.connector import ConnectorStats
from kvturn.registry import run_registration
from kvturn.server.generation import Generation
from kvturn.server.openai import ChatCompletionRequest, CompletionRequest
from kvturn.server.worker import Worker

log = logging.getLogger("kvturn.worker")
CONVERSATION_HEADER = "X-Conversation-Id"
MAX_KEY_CHARS = 256


def validated(body: dict, model: type[BaseModel]):
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # located as FastAPI locates body errors, so one handler words them all
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def parse(request: Request, model: type[BaseModel], max_body_mb: float):
    return validated(parse_json_object(await read_body(request, max_body_mb)), model)


def conversation_key(body, request: Request) -> str | None:
    key = body.conversation_id or request.headers.get(CONVERSATION_HEADER)
    if key is not None and len(key) > MAX_KEY_CHARS:
        raise BadRequest(f"conversation ids are at most {MAX_KEY_CHARS} characters", param="conversation_id")
    return key


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
        worker.stop_prompt_threads()
        if traces is not None:
            traces.close()

    app = FastAPI(title="kvturn worker", lifespan=lifespan)
    app.state.worker = worker
    install_error_handlers(app, log)
    secret = config.connector.cluster_secret

    @app.get("/health")
    async def health(response: Response):
        response.headers.update(instance_headers())
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
        overlap = worker.connector is not None and worker.connector.config.kv_read_overlap
        return {"role": config.role, "prefill_steps": worker.calibration,
                "kv_bytes_per_token": layout.block_bytes / layout.block_size,
                "kv_read_overlap_layers": layout.num_layers if overlap else 0,  # reads it computes beside, layer by layer
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
        """vLLM's endpoint: the token ids a prompt or a chat renders to, as this worker computes them (a text
        longer than the context is refused as a prompt would be, and tokenized off the event loop)."""
        body = parse_json_object(await read_body(request, config.max_body_mb))
        if body.get("model") is not None and body["model"] != worker.model_name:
            raise BadRequest(f"The model `{body['model']}` does not exist.", status=404, param="model")
        if "messages" in body:
            tokens = await worker.off_loop(worker.prompt_ids, validated(body, ChatCompletionRequest))
        elif isinstance(body.get("prompt"), str):
            tokens = await worker.off_loop(worker.encode_prompt, body["prompt"], "prompt")
        else:
            raise BadRequest("give prompt (a string) or messages", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": worker.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = parse_json_object(await read_body(request, config.max_body_mb)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadRequest("tokens must be a list of token ids", param="tokens")
        if len(tokens) > worker.engine.max_model_len:
            raise BadRequest(f"at most {worker.engine.max_model_len} token ids (the context), got {len(tokens)}",
                             param="tokens")
        worker.check_token_ids(tokens, "tokens")
        return {"prompt": await worker.off_loop(worker.tokenizer.decode, tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(await parse(request, CompletionRequest, config.max_body_mb), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(await parse(request, ChatCompletionRequest, config.max_body_mb), request, chat=True)

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
