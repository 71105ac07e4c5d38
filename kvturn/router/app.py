"""The KV-aware router: an OpenAI-compatible front over prefill and decode workers.

Per turn (see turn.py): find the conversation, ask a prefill worker to compute the prompt (max_tokens=1),
handing it the decode worker's retention lease so it can read the history back instead of recomputing it;
then stream the decode worker's tokens to the client and keep the new lease the decode worker returns.
Tensors never pass through here. Clients are untrusted: the router alone decides what workers read, and it
alone holds the cluster secret that lets a worker contact the peers named in `kv_transfer_params`.
"""
import asyncio
import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvturn import tracing
from kvturn.config import RouterConfig, is_redis_url
from kvturn.errors import BadRequest, error_response, install_error_handlers, parse_json_object, read_body
from kvturn.http_server import instance_headers
from kvturn.kv_transfer.params import SECRET_HEADER
from kvturn.registry import WorkerRegistry
from kvturn.router import keys, sessions
from kvturn.router.disconnect import unless_client_leaves
from kvturn.router.conversations import ConversationTable
from kvturn.costmodel import CostModel
from kvturn.router.redis_state import RedisConversationTable
from kvturn.router.trace_out import TraceOut
from kvturn.router.kvturn_workers import KvturnWorkers
from kvturn.router.prefix_memory import PrefixMemory
from kvturn.router.turn import Turn
from kvturn.router.turn_metrics import TurnMetrics
from kvturn.router.turn_span import TurnSpan
from kvturn.router.upstream import TimedOut, Unreachable, Upstream
from kvturn.router.vllm_backend import VLLMBackend
from kvturn.router.vllm_workers import VLLMWorkers
from kvturn.router.work_clock import IdleClock, WorkClock
from kvturn.router.workers import WorkerPool

log = logging.getLogger("kvturn.router")
RETURN_KV_HEADER = "X-Kvturn-Return-Kv-Params"
OFF_LOOP_MESSAGES = 64  # hash longer histories on a thread, so /health never waits behind one
REVIVAL_PROBE_S = 0.25  # while turns wait for a worker to come back, the dead ones are probed this often


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvturn_router_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        self.lookups = Counter("kvturn_router_conversation_lookups", "Conversation table lookups", ["result"],
                               registry=self.registry)
        self.retries = Counter("kvturn_router_retries", "Retries by reason", ["reason"], registry=self.registry)
        self.reuse = Counter("kvturn_router_prefill_reuse", "Prefill reuse outcome reported by P", ["outcome"],
                             registry=self.registry)
        self.unauthorized = Counter("kvturn_router_unauthorized", "Requests refused for a wrong or missing API key",
                                    registry=self.registry)
        self.conversations = Gauge("kvturn_router_conversations", "Conversations in the table",
                                   registry=self.registry)
        self.histories = Gauge("kvturn_router_history_digests", "History digests that name a conversation",
                               registry=self.registry)
        self.paths = Counter("kvturn_router_paths", "Turns by the path they took", ["path"], registry=self.registry)
        self.prediction_error = Histogram("kvturn_router_path_prediction_error_ratio", "|predicted - actual| / actual "
                                          "time to first token of the chosen path", ["path"],
                                          buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0), registry=self.registry)
        self.calibration_steps = Counter("kvturn_router_calibration_steps", "Prefill steps learned from workers' "
                                         "start-up calibration", ["role"], registry=self.registry)
        self.state_healthy = Gauge("kvturn_router_state_healthy", "1 while the conversation store answers",
                                   registry=self.registry)
        self.state_errors = Counter("kvturn_router_state_errors", "Conversation store calls that failed (the turn "
                                    "recomputed)", registry=self.registry)
        self.registrations_refused = Counter("kvturn_router_registrations_refused", "Worker registrations in Redis "
                                             "ignored: unsigned, bad_signature, stale or malformed", ["reason"],
                                             registry=self.registry)
        self.store_rejected = Counter("kvturn_router_store_rejected", "Records read from the shared store whose MAC "
                                      "did not hold (a store that was written to by someone else): treated as absent",
                                      ["record"], registry=self.registry)
        self.sessions_ended = Counter("kvturn_router_sessions_ended", "Sessions ended by their client (DELETE "
                                      "/v1/conversations/ID, or end_session on a last turn), by outcome", ["outcome"],
                                      registry=self.registry)


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.prefill = WorkerPool(config.prefill_urls, "prefill")
        self.decode = WorkerPool(config.decode_urls, "decode")
        self.metrics = RouterMetrics()
        self.turn_metrics = TurnMetrics(self.metrics.registry)
        self.tokenizer = None  # the model's, when --tokenizer names it: counts a prompt's tokens (turn_costs.py)
        self.text_tokens: keys.TextTokens | None = None  # ...and its messages' texts, each counted once
        if config.tokenizer_dir:
            from kvturn.model.tokenizer import ChatTokenizer
            self.tokenizer = ChatTokenizer(config.tokenizer_dir)
            self.text_tokens = keys.TextTokens(self.tokenizer)
        self.vllm = VLLMBackend(config, self.metrics.registry, self.tokenizer)
        self.costs = CostModel()
        self.prefix_memory = PrefixMemory(config.max_conversations)  # what each P's cache likely holds
        if is_redis_url(config.state_path):
            self.table = RedisConversationTable(config.state_path, config.conversation_ttl_s,
                                                on_error=self.metrics.state_errors.inc, secret=config.cluster_secret,
                                                on_rejected=lambda record: self.metrics.store_rejected.labels(record).inc())
        else:
            self.table = ConversationTable(config.conversation_ttl_s, config.max_conversations, config.state_path)
        self.registry = None
        if config.discover_url:
            self.registry = WorkerRegistry(config.discover_url, config.cluster_secret,
                                           lambda reason: self.metrics.registrations_refused.labels(reason).inc())
        self.trace = TraceOut(config.trace_out)
        self.traces = tracing.Tracing.start("router", config.otlp_traces_endpoint)  # None: no OpenTelemetry
        self.http: Upstream | None = None
        self._revival: asyncio.Task | None = None  # the probe of dead workers that waiting turns share

    async def start(self) -> None:
        headers = {SECRET_HEADER: self.config.cluster_secret} if self.config.cluster_secret else {}
        self.http = Upstream(self.config.upstream_timeout_s, headers)
        await self.http.start()
        await self.check_workers()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        self._health_task.cancel()
        if self._revival is not None:
            self._revival.cancel()
        await self.http.close()
        await self.table.close()
        self.trace.close()
        if self.traces is not None:
            self.traces.close()
        if self.registry:
            await self.registry.close()

    async def check_workers(self) -> None:
        registered = await self.registry.members() if self.registry else None
        if registered is not None:
            self.prefill.follow_registry(registered.get("prefill", {}))
            self.decode.follow_registry(registered.get("decode", {}))
        await asyncio.gather(self.prefill.check(self.http), self.decode.check(self.http))
        await self.vllm.detect(self.http, self.prefill.workers + self.decode.workers)
        await asyncio.gather(*(self.learn_calibration(w) for w in self.prefill.workers + self.decode.workers
                               if w.healthy and not w.calibration_asked))

    def has_workers(self) -> bool:
        return bool(self.prefill.healthy()) and bool(self.decode.healthy())

    async def wait_for_workers(self, deadline: float) -> bool:
        """Whether a prefill and a decode worker are in the rotation by `deadline` (event-loop time): a worker
        that died is probed every REVIVAL_PROBE_S meanwhile, so a restarted one is taken back as soon as it
        answers, and the turns waiting for it go on."""
        loop = asyncio.get_running_loop()
        while not self.has_workers():
            if loop.time() >= deadline:
                return False
            if self._revival is None or self._revival.done():
                self._revival = asyncio.create_task(self._probe_dead())
            await asyncio.wait({self._revival}, timeout=deadline - loop.time())
        return True

    async def _probe_dead(self) -> None:
        await asyncio.sleep(REVIVAL_PROBE_S)
        await asyncio.gather(*(pool.check(self.http, dead_only=True) for pool in (self.prefill, self.decode)))

    async def learn_calibration(self, worker) -> None:
        """Teach the cost model the prefill steps a kvturn worker timed at start-up, once per worker, so that the
        first turns are predicted from this cluster's speed rather than a prior (a vLLM worker has none). A worker
        that does not answer is asked again at the next check."""
        if worker.backend != "kvturn":
            worker.calibration_asked = worker.backend == "vllm"
            return
        try:
            response = await self.http.get(f"{worker.url}/kv/calibration", timeout_s=2.0)
        except Unreachable:
            return
        worker.calibration_asked = True
        try:
            reply = response.json() if response.status == 200 else {}
            taken = self.costs.observe_calibration(worker.role, reply.get("prefill_steps"))
            if worker.role == "prefill":
                self.costs.observe_read_overlap(reply.get("kv_read_overlap_layers"))
        except Exception:  # a worker's reply, whatever it holds, must not stop the router
            log.warning("%s worker %s: unusable calibration reply", worker.role, worker.url, exc_info=True)
            return
        self.metrics.calibration_steps.labels(worker.role).inc(taken)
        log.info("%s worker %s: learned %d calibration steps", worker.role, worker.url, taken)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_workers()
                await self.table.sweep()
                await self.update_gauges()
            except Exception:
                log.exception("router housekeeping failed")

    async def update_gauges(self) -> None:
        conversations, histories = await self.table.size()
        self.metrics.conversations.set(conversations)
        self.metrics.histories.set(histories)
        self.metrics.state_healthy.set(self.table.health()["healthy"])

    def caller_scope(self, request: Request) -> str:
        """The caller's namespace; BadRequest(401) when the router has API keys and the caller has none of them."""
        if not self.config.api_keys:
            return keys.scope_of(None)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            for api_key in self.config.api_keys:
                if secrets.compare_digest(token.encode(), api_key.encode()):
                    return keys.scope_of(api_key)
        self.metrics.unauthorized.inc()
        raise BadRequest("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401)

    def is_admin(self, request: Request) -> bool:
        """Whether the caller sent one of the router's admin keys."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and any(secrets.compare_digest(token.encode(), key.encode())
                                                  for key in self.config.admin_keys)

    async def conversation(self, body: dict, request: Request, chat: bool, scope: str):
        """(ConversationKey or None, History or None) of a request."""
        client_id = keys.explicit_id(body, request.headers, self.config.session_headers)
        messages = body.get("messages")
        history = None
        if chat and isinstance(messages, list):
            if len(messages) > OFF_LOOP_MESSAGES:
                history = await asyncio.to_thread(keys.History, scope, messages)
            else:
                history = keys.History(scope, messages)
        elif chat:
            raise BadRequest("messages must be a list of {role, content} objects", param="messages")
        if client_id is not None:
            return keys.ConversationKey(client_id, keys.scoped(scope, client_id), derived=False), history
        if history is None or not history.digests:
            return None, history
        found = await self.table.find_history(history.digests[:-1])
        if found is not None:
            key, found_id = found
            return keys.ConversationKey(found_id, key, derived=True), history
        derived = "derived-" + history.digests[-1][:32]
        return keys.ConversationKey(derived, keys.scoped(scope, derived), derived=True), history


def create_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="kvturn router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app, log)

    @app.get("/health")
    async def health(request: Request, response: Response):
        response.headers.update(instance_headers())
        if not router.prefill.healthy() or not router.decode.healthy():
            return error_response(503, "no healthy prefill or decode worker")
        state = router.table.health()
        if not state["healthy"]:
            state["note"] = "the conversation store is unreachable: serving, turns recompute until it is back"
        reply = {"status": "ok" if state["healthy"] else "degraded", "state": state}
        if router.is_admin(request) if config.admin_keys else config.expose_internals:
            reply |= {"prefill": [w.url for w in router.prefill.healthy()],
                      "decode": [w.url for w in router.decode.healthy()]}
        return reply

    @app.get("/v1/models")
    async def models(request: Request):
        router.caller_scope(request)
        for worker in router.decode.healthy():
            try:
                response = await router.http.get(f"{worker.url}/v1/models")
                return Response(response.content, response.status, media_type="application/json")
            except TimedOut:
                continue  # busy, not dead: its health probe says which
            except Unreachable:
                router.decode.mark_dead(worker)
        return error_response(503, "no decode worker is available")

    @app.get("/metrics")
    async def metrics(request: Request):
        if config.admin_keys and not router.is_admin(request):
            router.metrics.unauthorized.inc()
            return error_response(401, "/metrics needs an admin key (send 'Authorization: Bearer KEY')")
        await router.update_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await turn(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await turn(request, "/v1/chat/completions", chat=True)

    async def turn(request: Request, path: str, chat: bool):
        scope = router.caller_scope(request)
        raw = await read_body(request, config.max_body_mb)
        work = WorkClock()  # the router's own work on the turn, from here to its answer (vLLM turns report it)
        return await unless_client_leaves(request, run_turn(raw, work, request, scope, path, chat),
                                          router.metrics.requests.labels("client_left").inc)

    async def run_turn(raw: bytes, work: WorkClock, request: Request, scope: str, path: str, chat: bool):
        body = parse_json_object(raw)
        want_kv = bool(body.pop("return_kv_transfer_params", False)) or request.headers.get(RETURN_KV_HEADER) == "1"
        want_kv = want_kv and config.expose_internals  # a lease handle and its MAC are the cluster's
        body.pop("kv_transfer_params", None)  # only the router decides what workers read
        # the last turn: release its KV once answered
        end_session = body.pop("end_session", None) is True or keys.ends_session(request.headers)
        salt = keys.cache_salt(scope, body.pop("cache_salt", None), config.cluster_secret)
        if salt is not None:
            body["cache_salt"] = salt  # tenants share compute, not cached prefixes
        conversation, history = await router.conversation(body, request, chat, scope)
        span = TurnSpan(router.traces, request.headers) if router.traces is not None else None
        # A turn that finds no prefill or decode worker, or loses the last one before its answer began (a 503),
        # waits for one to come back within no_worker_wait_s and runs again: a restarted worker carries it over.
        deadline = asyncio.get_running_loop().time() + config.no_worker_wait_s
        while True:
            await router.wait_for_workers(deadline)
            backend = VLLMWorkers if router.vllm.serves(router.prefill.workers) else KvturnWorkers
            if not backend.reports_own_work:
                work = IdleClock()
            turn = Turn(router, path, chat, body, conversation, history, want_kv, work, backend, span)
            response = await turn.run()
            if response.status_code != 503 or router.has_workers() or not await router.wait_for_workers(deadline):
                if end_session and conversation is not None:
                    sessions.ending_after(response, router, conversation)
                if span is not None:
                    span.end_after(response, turn)
                return response
            turn.retried("worker_back")

    sessions.mount(app, router)
    return app
