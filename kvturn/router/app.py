"""The KV-aware router: an OpenAI-compatible front over prefill and decode workers.

Per turn: find the conversation, ask a prefill worker to compute the prompt (max_tokens=1),
handing it the decode worker's retention lease so it can read the history back instead of
recomputing it; then stream the decode worker's tokens to the client as they come and keep
the new lease the decode worker returns at the end. Tensors never pass through here.
"""
import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvturn.router.conversations import ConversationTable
from kvturn.router.workers import WorkerPool, WorkerState
from kvturn.server.protocol import error_response

log = logging.getLogger("kvturn.router")
CONVERSATION_HEADER = "X-Conversation-Id"
RETURN_KV_HEADER = "X-Kvturn-Return-Kv-Params"
KV_FIELDS_FROM_DECODE = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_block_hashes",
                         "remote_block_epochs", "remote_host", "remote_port", "remote_num_tokens",
                         "remote_blocks_expiry_time", "handle", "tp_size")


@dataclass(slots=True)
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    conversation_ttl_s: float = 450.0
    state_path: str | None = None
    max_in_flight_per_decode: int = 32
    health_interval_s: float = 2.0
    request_timeout_s: float = 120.0  # per read: a worker silent this long is given up on


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvturn_router_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        self.lookups = Counter("kvturn_router_conversation_lookups", "Conversation table lookups", ["result"],
                               registry=self.registry)
        self.retries = Counter("kvturn_router_retries", "Retries by reason", ["reason"], registry=self.registry)
        self.reuse = Counter("kvturn_router_prefill_reuse", "Prefill reuse outcome reported by P", ["outcome"],
                             registry=self.registry)
        self.conversations = Gauge("kvturn_router_conversations", "Conversations in the table",
                                   registry=self.registry)


class UpstreamError(Exception):
    def __init__(self, response: Response):
        self.response = response


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.prefill = WorkerPool(config.prefill_urls, "prefill")
        self.decode = WorkerPool(config.decode_urls, "decode")
        self.table = ConversationTable(config.conversation_ttl_s, config.state_path)
        self.metrics = RouterMetrics()
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout_s, connect=5.0), limits=limits)
        await asyncio.gather(self.prefill.check(self.http), self.decode.check(self.http))
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        self._health_task.cancel()
        await self.http.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(self.prefill.check(self.http), self.decode.check(self.http))
            self.metrics.conversations.set(len(self.table))

    # ---- one turn
    def conversation_key(self, body: dict, request: Request, chat: bool) -> str | None:
        key = body.pop("conversation_id", None) or request.headers.get(CONVERSATION_HEADER)
        if key is not None:
            return str(key)[:256]
        if chat and isinstance(body.get("messages"), list):
            return self.table.key_for_history(body["messages"])
        return None

    async def run_prefill(self, path: str, body: dict, key: str | None, lease: dict | None):
        """Call a prefill worker; returns (its JSON, the worker). Retries another P, and once without reuse."""
        tried: set[str] = set()
        with_reuse = lease is not None
        while True:
            worker = self.prefill.least_loaded(tried)
            if worker is None:
                raise UpstreamError(error_response(503, "no prefill worker is available"))
            kv = {"do_remote_decode": True, "do_remote_prefill": False}
            if with_reuse:
                kv.update({f: lease[f] for f in KV_FIELDS_FROM_DECODE if f in lease})
            p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
            p_body.pop("stream_options", None)
            if "max_completion_tokens" in p_body:
                p_body["max_completion_tokens"] = 1
            if key is not None:
                p_body["conversation_id"] = key
            worker.in_flight += 1
            try:
                response = await self.http.post(worker.url + path, json=p_body)
            except httpx.HTTPError:
                self.prefill.mark_dead(worker)
                tried.add(worker.url)
                self.metrics.retries.labels("prefill_unreachable").inc()
                continue
            finally:
                worker.in_flight -= 1
            if response.status_code == 200:
                return response.json(), worker
            if response.status_code < 500:
                raise UpstreamError(Response(response.content, response.status_code,
                                             media_type="application/json"))
            if with_reuse:
                with_reuse = False
                self.metrics.retries.labels("prefill_failed_with_reuse").inc()
                continue
            tried.add(worker.url)
            self.metrics.retries.labels("prefill_failed").inc()

    def pick_decode(self, entry, exclude: set[str]) -> WorkerState | None:
        if entry is not None and entry.decode_url not in exclude:
            holder = self.decode.find(entry.decode_url)
            if holder and holder.healthy and holder.in_flight < self.config.max_in_flight_per_decode:
                return holder
        return self.decode.least_loaded(exclude)


def merged_kvturn(key: str | None, prefill: dict, prefill_url: str, decode: dict | None, decode_url: str,
                  prefill_round_trip_s: float) -> dict:
    """One timing breakdown for the turn, from P's and D's own accounts."""
    p_timing, d_timing = prefill.get("timing", {}), (decode or {}).get("timing", {})
    return {
        "conversation_id": key,
        "prefill_worker": prefill_url,
        "decode_worker": decode_url,
        "reuse": prefill.get("reuse"),
        "prompt_tokens_computed_prefill": prefill.get("prompt_tokens_computed"),
        "prompt_tokens_from_decode": prefill.get("prompt_tokens_remote"),
        "prompt_tokens_cached_prefill": prefill.get("prompt_tokens_cached"),
        "bytes_d_to_p": prefill.get("kv_read_bytes", 0),
        "bytes_p_to_d": (decode or {}).get("kv_read_bytes", 0),
        "timing": {
            "prefill_request_ms": prefill_round_trip_s * 1e3,
            "queue_ms": p_timing.get("queue_ms"),
            "d_to_p_read_ms": p_timing.get("kv_read_ms"),
            "prefill_compute_ms": p_timing.get("prefill_compute_ms"),
            "p_to_d_read_ms": d_timing.get("kv_read_ms"),
            "decode_ttft_ms": d_timing.get("ttft_ms"),
        },
        "decode": decode,
        "prefill_timing": p_timing,
    }


def create_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="kvturn router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health():
        if not router.prefill.healthy() or not router.decode.healthy():
            return error_response(503, "no healthy prefill or decode worker")
        return {"status": "ok", "prefill": [w.url for w in router.prefill.healthy()],
                "decode": [w.url for w in router.decode.healthy()]}

    @app.get("/v1/models")
    async def models():
        for worker in router.decode.healthy():
            try:
                response = await router.http.get(f"{worker.url}/v1/models")
                return Response(response.content, response.status_code, media_type="application/json")
            except httpx.HTTPError:
                router.decode.mark_dead(worker)
        return error_response(503, "no decode worker is available")

    @app.get("/metrics")
    async def metrics():
        router.metrics.conversations.set(len(router.table))
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await turn(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await turn(request, "/v1/chat/completions", chat=True)

    async def turn(request: Request, path: str, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(400, f"malformed JSON body: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        want_kv = bool(body.pop("return_kv_transfer_params", False)) or request.headers.get(RETURN_KV_HEADER) == "1"
        body.pop("kv_transfer_params", None)  # only the router decides what workers read
        try:
            key = router.conversation_key(body, request, chat)
        except (TypeError, AttributeError):
            return error_response(400, "messages must be a list of {role, content} objects")
        entry, missed_because = router.table.lookup(key) if key else (None, None)
        router.metrics.lookups.labels("hit" if entry else (missed_because or "miss")).inc()
        started = time.perf_counter()
        try:
            prefill, p_worker = await router.run_prefill(path, body, key, entry.kv_params if entry else None)
        except UpstreamError as exc:
            router.metrics.requests.labels("prefill_error").inc()
            return exc.response
        p_round_trip = time.perf_counter() - started
        if missed_because and (prefill.get("kvturn") or {}).get("reuse") is None:
            prefill.setdefault("kvturn", {})["reuse"] = missed_because  # the lease ended before this turn came
        router.metrics.reuse.labels(str((prefill.get("kvturn") or {}).get("reuse"))).inc()
        d_body = {**body, "kv_transfer_params": prefill.get("kv_transfer_params")}
        if key is not None:
            d_body["conversation_id"] = key
        context = TurnContext(key, entry, prefill, p_worker.url, p_round_trip, want_kv, chat)
        if body.get("stream"):
            return await stream_decode(path, d_body, context)
        return await complete_decode(path, d_body, context)

    async def open_decode(path: str, d_body: dict, context: "TurnContext", stream: bool):
        """Send the turn to a decode worker (another one if the first cannot be reached)."""
        tried: set[str] = set()
        while True:
            worker = router.pick_decode(context.entry, tried)
            if worker is None:
                raise UpstreamError(error_response(503, "no decode worker is available"))
            worker.in_flight += 1
            try:
                request = router.http.build_request("POST", worker.url + path, json=d_body)
                response = await router.http.send(request, stream=stream)
                return worker, response
            except httpx.HTTPError:
                worker.in_flight -= 1
                router.decode.mark_dead(worker)
                tried.add(worker.url)
                router.metrics.retries.labels("decode_unreachable").inc()

    def remember(context: "TurnContext", worker: WorkerState, kv: dict | None, answer: str | None, body: dict):
        if context.key is None:
            return
        if kv and kv.get("handle"):
            router.table.put(context.key, worker.url, kv)
        else:
            router.table.drop(context.key)  # the old lease is superseded or gone
        if context.chat and answer is not None and isinstance(body.get("messages"), list):
            router.table.remember_history(body["messages"] + [{"role": "assistant", "content": answer}],
                                          context.key)

    def decode_refused(content: bytes, status: int) -> Response:
        """D answered with an error: pass it on. The conversation keeps its previous lease, which is still
        valid on a live D, so a retried turn can reuse it."""
        router.metrics.requests.labels("decode_error").inc()
        return Response(content, status, media_type="application/json")

    async def complete_decode(path: str, d_body: dict, context: "TurnContext"):
        try:
            worker, response = await open_decode(path, d_body, context, stream=False)
        except UpstreamError as exc:
            router.metrics.requests.labels("decode_error").inc()
            return exc.response
        worker.in_flight -= 1
        if response.status_code != 200:
            return decode_refused(response.content, response.status_code)
        result = response.json()
        kv = result.pop("kv_transfer_params", None)
        choice = (result.get("choices") or [{}])[0]
        answer = (choice.get("message") or {}).get("content") if context.chat else choice.get("text")
        remember(context, worker, kv, answer, d_body)
        result["kvturn"] = merged_kvturn(context.key, context.prefill.get("kvturn") or {}, context.prefill_url,
                                         result.get("kvturn"), worker.url, context.prefill_round_trip_s)
        if context.want_kv and kv is not None:
            result["kv_transfer_params"] = kv
        router.metrics.requests.labels("ok").inc()
        return JSONResponse(result)

    async def stream_decode(path: str, d_body: dict, context: "TurnContext"):
        try:
            worker, response = await open_decode(path, d_body, context, stream=True)
        except UpstreamError as exc:
            router.metrics.requests.labels("decode_error").inc()
            return exc.response
        if response.status_code != 200:
            worker.in_flight -= 1
            content = await response.aread()
            await response.aclose()
            return decode_refused(content, response.status_code)

        async def relay():
            answer, kv, finished = [], None, False
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        # Record the lease before the last write: a client may hang up right after [DONE].
                        finished = True
                        remember(context, worker, kv, "".join(answer), d_body)
                        router.metrics.requests.labels("ok").inc()
                        yield "data: [DONE]\n\n"
                        continue
                    chunk = json.loads(payload)
                    for choice in chunk.get("choices") or []:
                        answer.append((choice.get("delta") or {}).get("content") or "" if context.chat
                                      else choice.get("text") or "")
                    if "kv_transfer_params" in chunk:
                        kv = chunk["kv_transfer_params"] if context.want_kv else chunk.pop("kv_transfer_params")
                    if "kvturn" in chunk:
                        chunk["kvturn"] = merged_kvturn(context.key, context.prefill.get("kvturn") or {},
                                                        context.prefill_url, chunk["kvturn"], worker.url,
                                                        context.prefill_round_trip_s)
                    yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                log.warning("decode worker %s failed mid-stream: %s", worker.url, exc)
                yield ("data: " + json.dumps({"error": {"message": "the decode worker failed mid-stream",
                                                        "type": "ServiceUnavailableError", "param": None,
                                                        "code": 503}}) + "\n\n")
            finally:
                worker.in_flight -= 1
                if not finished:
                    if context.key:
                        router.table.drop(context.key)
                    router.metrics.requests.labels("decode_error").inc()
                await response.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


@dataclass(slots=True)
class TurnContext:
    key: str | None
    entry: object
    prefill: dict
    prefill_url: str
    prefill_round_trip_s: float
    want_kv: bool
    chat: bool
