"""One worker process: engine + NIXL agent + OpenAI-compatible HTTP API + KV side channel.

Role `prefill` computes prompts and pins their blocks for a decode worker; role `decode` reads
them, decodes, and (with bidirectional transfer) retains the finished turn's blocks for the
next turn's prefill; role `both` is the colocated baseline.
"""
import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvturn.engine.async_engine import AsyncEngine
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import RemoteBlocks, RetainSpec, Sequence
from kvturn.model.loader import load_model
from kvturn.model.tokenizer import ChatTokenizer
from kvturn.server import kv_params
from kvturn.server.metrics import WorkerMetrics
from kvturn.server.peers import SECRET_HEADER, PeerClient
from kvturn.server.protocol import ChatCompletionRequest, CompletionRequest, error_response
from kvturn.server.text_stream import TextStream
from kvturn.server.worker_config import WorkerConfig
from kvturn.transfer import reuse_policy
from kvturn.transfer.nixl_agent import LayoutMismatch

log = logging.getLogger("kvturn.worker")
CONVERSATION_HEADER = "X-Conversation-Id"


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.tokenizer = ChatTokenizer(config.model_dir)
        model = load_model(config.model_dir)
        self.model_name = config.served_model_name or Path(config.model_dir).name
        self.vocab_size = model.config.vocab_size
        eos = set(model.config.eos_token_ids) | {self.tokenizer.eos_token_id}
        self.engine = LLMEngine(model, config.engine, emit=lambda out: None, detokenize=self.tokenizer.decode,
                                eos_token_ids=eos, with_transfer=config.role != "both" or config.bidirectional)
        self.async_engine = AsyncEngine(self.engine)
        self.metrics = WorkerMetrics(self.engine, config.role)
        self.side_channel_refusals = Counter("kvturn_side_channel_refused", "Side-channel calls refused for a wrong "
                                             "or missing cluster secret", registry=self.metrics.registry)
        self.peers = PeerClient(config.cluster_secret, config.side_channel_timeout_s)
        self.advertise_host = config.advertise_host or config.host

    @property
    def engine_id(self) -> str:
        return self.engine.transfer.engine_id if self.engine.transfer else "colocated"

    # ---- request preparation
    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt)
        if any(not 0 <= t < self.vocab_size for t in body.prompt):
            raise BadRequest(f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")
        return list(body.prompt)

    def sampling_params(self, body, num_prompt_tokens: int) -> SamplingParams:
        max_model_len = self.engine.max_model_len
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"The model `{body.model}` does not exist.", status=404, param="model")
        if num_prompt_tokens == 0:
            raise BadRequest("the prompt is empty", param="prompt")
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if num_prompt_tokens >= max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                             f"has {num_prompt_tokens} tokens.", param="messages")
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt_tokens
        if num_prompt_tokens + max_tokens > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                             f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                             f"in the completion). Please reduce the length of the prompt or completion.",
                             param="max_tokens")
        blocks = -(-(num_prompt_tokens + 1) // self.engine.block_size)
        if blocks > self.engine.max_prompt_blocks:
            raise BadRequest(f"the prompt needs {blocks} KV blocks but this worker's pool holds "
                             f"{self.engine.max_prompt_blocks}", param="messages")
        if any(not 0 <= t < self.vocab_size for t in body.stop_token_ids):
            raise BadRequest(f"stop_token_ids must lie in [0, {self.vocab_size})", param="stop_token_ids")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(body.top_k, 0), seed=body.seed, stop=body.stop or [],
                              stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos)

    async def resolve_remote(self, ref: kv_params.RemoteRef) -> RemoteBlocks | str:
        """Handshake with the peer if needed and get its own account of the lease; a reason string on failure."""
        try:
            info = await self.peers.agent_info(ref.host, ref.port)
            if ref.engine_id and info["engine_id"] != ref.engine_id:
                info = await self.peers.agent_info(ref.host, ref.port, refresh=True)
        except (httpx.HTTPError, ValueError, KeyError):
            return reuse_policy.PEER_UNREACHABLE
        if ref.engine_id and info["engine_id"] != ref.engine_id:
            return reuse_policy.LEASE_UNKNOWN  # the peer restarted: its leases died with it
        try:
            await self.async_engine.call(lambda: self.engine.transfer.add_peer(info))
        except LayoutMismatch as exc:
            log.error("refusing peer %s:%s: %s", ref.host, ref.port, exc)
            return reuse_policy.LAYOUT_MISMATCH
        except Exception:
            log.warning("NIXL handshake with %s:%s failed", ref.host, ref.port, exc_info=True)
            return reuse_policy.PEER_UNREACHABLE
        return await self.peers.acquire(ref, info["engine_id"])

    async def prepare(self, body, request: Request, request_id: str, arrival: float) -> tuple[Sequence, kv_params.KVPlan]:
        prompt = self.prompt_ids(body)
        tokenized = time.perf_counter()
        params = self.sampling_params(body, len(prompt))
        conversation_key = body.conversation_id or request.headers.get(CONVERSATION_HEADER)
        try:
            plan = kv_params.plan(body.kv_transfer_params, conversation_key)
        except kv_params.BadKVParams as exc:
            raise BadRequest(str(exc), param="kv_transfer_params")
        role, transfer = self.config.role, self.engine.transfer
        retain = None
        if plan.prefill_for_remote_decode:
            if role == "decode" or transfer is None:
                raise BadRequest("this worker cannot prefill for a remote decode (role "
                                 f"{role}, transfer {'on' if transfer else 'off'})", param="kv_transfer_params")
            params.max_tokens = 1
            retain = RetainSpec(self.config.engine.kv_pin_timeout_s, request_id, release_after_read=True)
        elif role == "prefill":
            raise BadRequest("this is a prefill worker: send kv_transfer_params.do_remote_decode=true",
                             param="kv_transfer_params")
        elif self.config.bidirectional and conversation_key:
            retain = RetainSpec(self.config.engine.decoder_kv_blocks_ttl_s, conversation_key,
                                release_after_read=False)
        remote, declined, side_channel_s = None, None, 0.0
        reads_remote = plan.remote is not None and (self.config.bidirectional or not plan.prefill_for_remote_decode)
        if reads_remote:  # D->P reads need --bidirectional on this worker; P->D reads always happen
            if transfer is None:
                declined = reuse_policy.PEER_UNREACHABLE
            else:
                resolve_started = time.perf_counter()
                resolved = await self.resolve_remote(plan.remote)
                side_channel_s = time.perf_counter() - resolve_started
                if isinstance(resolved, str):
                    declined = resolved
                else:
                    remote = resolved
                    if not plan.prefill_for_remote_decode:
                        remote.min_reuse_tokens = 1  # P->D: P already computed these; any block D lacks is read
        seq = Sequence(request_id, prompt, params, remote=remote, retain=retain)
        seq.timing.arrival = arrival
        seq.timing.tokenize_s = tokenized - arrival
        seq.timing.side_channel_s = side_channel_s
        if declined:
            seq.reuse_outcome = declined
            self.engine.call_soon(lambda: self.engine.stats.reuse_declines.update([declined]))
        return seq, plan

    def response_kv_params(self, seq: Sequence) -> dict | None:
        if seq.retained is None:
            return None
        return kv_params.retention_params(seq.retained, self.engine_id, seq.request_id, self.advertise_host,
                                          self.config.port, for_decode=seq.retain.release_after_read)

    def kvturn_fields(self, seq: Sequence) -> dict:
        t = seq.timing
        ttft = (t.first_token - t.arrival) if t.first_token else 0.0
        return {
            "role": self.config.role,
            "engine_id": self.engine_id,
            "prompt_tokens_computed": seq.num_prompt_tokens - seq.num_cached_tokens - seq.num_remote_tokens,
            "prompt_tokens_cached": seq.num_cached_tokens,
            "prompt_tokens_remote": seq.num_remote_tokens,
            "reuse": seq.reuse_outcome,
            "kv_read_bytes": t.kv_read_bytes,
            "timing": {
                "ttft_ms": ttft * 1e3,
                "kv_read_ms": t.kv_read_s * 1e3,
                "prefill_compute_ms": t.prefill_compute_s * 1e3,
                "queue_ms": max(ttft - t.kv_read_s - t.prefill_compute_s, 0.0) * 1e3,
                "tokenize_ms": t.tokenize_s * 1e3,
                "side_channel_ms": t.side_channel_s * 1e3,
                "engine_wait_ms": ((t.first_scheduled or t.arrival) - (t.submitted or t.arrival)) * 1e3,
            },
        }

    def usage(self, seq: Sequence) -> dict:
        return {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens,
                "total_tokens": len(seq),
                "prompt_tokens_details": {"cached_tokens": seq.num_cached_tokens + seq.num_remote_tokens}}

    def release_pin_once(self, plan: kv_params.KVPlan, released: list[bool]) -> None:
        """D tells P it no longer needs P's pinned prompt blocks (after the read, or when giving up)."""
        if plan.remote is not None and not plan.prefill_for_remote_decode and not released[0]:
            released[0] = True
            asyncio.get_running_loop().create_task(self.peers.release(plan.remote))

    def observe(self, seq: Sequence) -> None:
        t = seq.timing
        if t.first_token:
            self.metrics.ttft.observe(t.first_token - t.arrival)
        self.metrics.e2e.observe(time.perf_counter() - t.arrival)


def completion_choice(chat: bool, text: str, finish_reason: str | None, delta: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if delta:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def create_app(config: WorkerConfig) -> FastAPI:
    worker = Worker(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.async_engine.start()
        yield
        await worker.peers.close()
        if worker.async_engine.alive:
            await worker.async_engine.call(worker.engine.leases.release_all)
        worker.async_engine.stop()

    app = FastAPI(title="kvturn worker", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}")
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(400, message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    async def health():
        if not worker.async_engine.alive:
            return error_response(503, "engine is not running")
        return {"status": "ok", "role": config.role, "engine_id": worker.engine_id}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": worker.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvturn", "max_model_len": worker.engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, request, chat=True)

    async def generate(body, request: Request, chat: bool):
        arrival = time.perf_counter()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        seq, plan = await worker.prepare(body, request, request_id, arrival)
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": worker.model_name}
        if body.stream:
            return StreamingResponse(stream(seq, plan, body, base, chat), media_type="text/event-stream")
        return await complete(seq, plan, base, chat, request)

    async def complete(seq: Sequence, plan, base: dict, chat: bool, request: Request):
        text = TextStream(worker.tokenizer.decode, seq.params.stop)
        released = [False]
        outputs = worker.async_engine.generate(seq)
        try:
            async for out in _until_disconnect(outputs, request):
                worker.release_pin_once(plan, released)
                text.add(out.new_token_ids)
        finally:
            worker.release_pin_once(plan, released)
            await outputs.aclose()
        if seq.finish_reason is None:
            return error_response(499 if seq.aborted else 500, "request did not finish")
        worker.observe(seq)
        body = {**base, "choices": [completion_choice(chat, text.final(), seq.finish_reason, delta=False)],
                "usage": worker.usage(seq), "kvturn": worker.kvturn_fields(seq)}
        kv = worker.response_kv_params(seq)
        if kv is not None:
            body["kv_transfer_params"] = kv
        return JSONResponse(body)  # plain json.dumps: FastAPI's encoder walks every block id in Python

    async def stream(seq: Sequence, plan, body, base: dict, chat: bool):
        chunk_base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
        text = TextStream(worker.tokenizer.decode, seq.params.stop)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        released = [False]
        outputs = worker.async_engine.generate(seq)
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield _sse({**chunk_base, "choices": [first]})
            async for out in outputs:
                worker.release_pin_once(plan, released)
                delta = text.add(out.new_token_ids)
                if out.finished:
                    delta += text.flush()
                    worker.observe(seq)
                    chunk = {**chunk_base, "choices": [completion_choice(chat, delta, seq.finish_reason, True)],
                             "kvturn": worker.kvturn_fields(seq)}
                    kv = worker.response_kv_params(seq)
                    if kv is not None:
                        chunk["kv_transfer_params"] = kv
                    yield _sse(chunk)
                    if include_usage:
                        yield _sse({**chunk_base, "choices": [], "usage": worker.usage(seq)})
                elif delta:
                    yield _sse({**chunk_base, "choices": [completion_choice(chat, delta, None, True)]})
            yield "data: [DONE]\n\n"
        except Exception as exc:  # the engine died mid-stream: tell the client instead of hanging up silently
            log.exception("stream failed")
            yield _sse({"error": {"message": f"generation failed: {exc}", "type": "InternalServerError",
                                  "param": None, "code": 500}})
        finally:
            worker.release_pin_once(plan, released)
            await outputs.aclose()

    side_channel(app, worker)
    return app


def side_channel(app: FastAPI, worker: Worker) -> None:
    """Peer-to-peer endpoints: NIXL metadata and lease acquire/release, behind the cluster secret."""
    secret = worker.config.cluster_secret

    def refused(request: Request) -> JSONResponse | None:
        if worker.engine.transfer is None:
            return error_response(404, "this worker does not transfer KV")
        if secret and not secrets.compare_digest(request.headers.get(SECRET_HEADER, ""), secret):
            worker.side_channel_refusals.inc()
            return error_response(403, "wrong or missing cluster secret")
        return None

    async def lease_request(request: Request) -> tuple[str, str] | JSONResponse:
        """(handle, binding_key) of an authorised lease call, or the error response."""
        if (denied := refused(request)) is not None:
            return denied
        try:
            data = await request.json()
            handle, key = data["handle"], data["binding_key"]
            if not isinstance(handle, str) or not isinstance(key, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return error_response(400, "expected {handle: str, binding_key: str}")
        return handle, key

    @app.get("/kv/agent")
    async def agent(request: Request):
        return refused(request) or JSONResponse(worker.engine.transfer.local_info())

    @app.post("/kv/lease/acquire")
    async def acquire(request: Request):
        parsed = await lease_request(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        lease = worker.engine.leases.lookup(*parsed)
        if lease is None:
            return error_response(404, "no live lease with that handle for that key")
        return JSONResponse(lease.to_public())

    @app.post("/kv/lease/release")
    async def release(request: Request):
        parsed = await lease_request(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        released = await worker.async_engine.call(lambda: worker.engine.leases.release(*parsed))
        return {"released": released}


async def _until_disconnect(outputs, request: Request):
    """Iterate outputs, stopping if the client goes away (so its blocks are freed)."""
    iterator = outputs.__aiter__()
    while True:
        next_output = asyncio.ensure_future(iterator.__anext__())
        while not next_output.done():
            done, _ = await asyncio.wait({next_output}, timeout=0.5)
            if not done and await request.is_disconnected():
                next_output.cancel()
                return
        try:
            yield next_output.result()
        except StopAsyncIteration:
            return


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
