"""One turn of a conversation through the router, whichever workers serve it: look the conversation up, prefill
(handing P the decode worker's lease so it can read the history back), decode (whole here, streamed in
streaming.py), remember the new lease, then learn and trace. What kvturn's workers and vLLM's need beyond that is
the backend's: kvturn_workers.py and vllm_workers.py, one object per turn, its hooks named after what they do."""
import time

from fastapi.responses import Response

from kvturn.errors import error_response
from kvturn.router import fast_json
from kvturn.router.answers import DecodeAnswer, choice_text, concealed
from kvturn.router.conversations import Conversation
from kvturn.router.keys import ConversationKey, History
from kvturn.router.streaming import Streaming
from kvturn.router.upstream import Reply, Stream, TimedOut, Unreachable
from kvturn.router.work_clock import WorkClock
from kvturn.router.workers import Claim, UpstreamError, WorkerState


def one_token(body: dict) -> dict:
    """The client's request cut to what P computes: the prompt and one token, answered whole."""
    p_body = {**body, "max_tokens": 1, "stream": False}
    p_body.pop("stream_options", None)
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    return p_body


def timed_out(router, role: str) -> Response:
    """A worker had the turn but sent nothing for the upstream timeout: slow, not dead (its health probe decides
    that), so the turn fails here rather than run again elsewhere, and the worker stays in the rotation."""
    return error_response(504, f"the {role} worker sent nothing for {router.config.upstream_timeout_s:g} s")


class Turn(Streaming):
    def __init__(self, router, path: str, chat: bool, body: dict, conversation: ConversationKey | None,
                 history: History | None, want_kv: bool, work: WorkClock, backend: type, span=None):
        """`work`: started once the request's body was in, paused around every wait on a worker or the client.
        `backend`: KvturnWorkers or VLLMWorkers, made for this turn. `span`: the request's TurnSpan when traces are
        on (turn_span.py)."""
        self.router, self.path, self.chat, self.body = router, path, chat, body
        self.conversation, self.history, self.want_kv, self.work = conversation, history, want_kv, work
        self.key = conversation.key if conversation else None
        self.entry: Conversation | None = None
        self.prefill: dict = {}
        self.prefill_url = ""
        self.prefill_round_trip_s = 0.0  # from the first call to a prefill worker to the answer, retries included
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.first_token_from = "decode"  # or "prefill": P's token, sent ahead of D's stream (first_token.py)
        prompt = body.get("prompt")
        self.prompt_size = history.size if history else len(prompt) if isinstance(prompt, str) else 0
        self.span = span
        self.trace_headers = span.headers if span is not None else None  # `traceparent` for the workers
        self.lookup = "none"  # what the conversation table said: hit, miss, or why it held no entry
        self.reported: dict | None = None  # the response's `kvturn` object, once made
        self.backend = backend(self)

    async def run(self) -> Response:
        router, backend = self.router, self.backend
        await self.waiting(backend.previous_turn_settled())
        missed_because = None
        if self.key:
            self.entry, missed_because = await router.table.lookup(self.key)
        self.lookup = "hit" if self.entry else (missed_because or "miss")
        router.metrics.lookups.labels(self.lookup).inc()
        backend.choose_path()
        if backend.computes_on_decode:
            return await self.decode(dict(self.body))  # D computes the new tokens on the history it retained
        try:
            self.prefill, self.prefill_url = await self.run_prefill()
        except UpstreamError as exc:
            router.metrics.requests.labels(exc.outcome).inc()
            return exc.response
        await backend.count_reuse(missed_because)
        return await self.decode(backend.decode_body())

    def retried(self, reason: str) -> None:
        """Counted, and an event of the turn's span."""
        self.router.metrics.retries.labels(reason).inc()
        if self.span is not None:
            self.span.retried(reason)

    def report(self, decode: dict | None, decode_url: str, learned: dict | None) -> dict:
        """The response's `kvturn` object, kept for the turn's span, and the turn's metrics (its answer is out)."""
        self.reported = self.backend.report(decode, decode_url, learned)
        self.router.turn_metrics.observe(self, self.reported)
        return self.reported

    async def waiting(self, awaitable):
        """Wait on a worker or the client: not the router's own work."""
        self.work.pause()
        try:
            return await awaitable
        finally:
            self.work.resume()

    async def run_prefill(self) -> tuple[dict, str]:
        """Call a prefill worker; returns (its JSON, its URL). On a 5xx with reuse (a lease that expired or whose
        holder is gone makes P fail), once more without it; then another P."""
        router, backend = self.router, self.backend
        tried: set[str] = set()
        failed: Reply | None = None  # the last 5xx, passed on when no worker is left to try
        started = None
        while True:
            worker = self.pick_prefill(tried)
            if worker is None and failed is not None:
                raise UpstreamError(Response(failed.content, failed.status, media_type="application/json"))
            if worker is None:
                raise UpstreamError(error_response(503, "no prefill worker is available"))
            if started is None:
                await backend.verify_reuse(worker.url)
                started = time.perf_counter()
            reusing = backend.reusing
            url, content = backend.request(worker.url + self.path, backend.prefill_body(one_token(self.body)))
            with router.prefill.claim(worker, backend.prefill_work_ms) as claim:
                try:
                    response = await self.waiting(router.http.post(url, content, headers=self.trace_headers))
                except TimedOut:
                    raise UpstreamError(timed_out(router, "prefill"), "prefill_timeout") from None
                except Unreachable:
                    router.prefill.mark_dead(worker)
                    tried.add(worker.url)
                    self.retried("prefill_unreachable")
                    continue
                if response.status == 200:
                    claim.work_done()
            if reusing:
                await backend.prefill_read_lease()
            if response.status == 200:
                self.prefill_round_trip_s = time.perf_counter() - started
                return fast_json.loads(response.content), worker.url
            if response.status < 500:
                raise UpstreamError(Response(response.content, response.status, media_type="application/json"))
            if reusing:
                backend.give_up_reuse()
                self.retried("prefill_failed_with_reuse")
                continue
            tried.add(worker.url)
            failed = response
            self.retried("prefill_failed")

    async def decode(self, d_body: dict) -> Response:
        if self.key is not None:
            d_body["conversation_id"] = self.key
        if self.body.get("stream"):
            return await self.stream_decode(d_body)
        return await self.complete_decode(d_body)

    def pick_prefill(self, exclude: set[str] = frozenset()) -> WorkerState | None:
        """The router's choice of prefill worker (--prefill-choice) for this turn."""
        config = self.router.config
        return self.router.prefill.pick(self.key, config.prefill_choice, exclude, config.prefill_spill_ms)

    def pick_decode(self, exclude: set[str]) -> WorkerState | None:
        router, entry = self.router, self.entry
        if entry is not None and entry.decode_url not in exclude:
            holder = router.decode.find(entry.decode_url)
            if holder and holder.healthy and holder.in_flight < router.config.max_in_flight_per_decode:
                return holder
        return router.decode.least_loaded(exclude)

    async def open_decode(self, d_body: dict) -> tuple[Claim, Stream] | Response:
        """Send the turn to a decode worker (another one if the first cannot be reached). Returns its claim and
        its 200 answer, or the error to pass on, counted, with the worker's load released: no worker left, or the
        worker's own refusal (see decode_refused)."""
        router = self.router
        tried: set[str] = set()
        while True:
            worker = self.pick_decode(tried)
            if worker is None:
                router.metrics.requests.labels("decode_error").inc()
                return error_response(503, "no decode worker is available")
            claim = router.decode.claim(worker, self.backend.decode_work_ms)
            try:
                url, content = self.backend.request(worker.url + self.path, d_body)
                response = await self.waiting(router.http.open(url, content, headers=self.trace_headers))
            except TimedOut:
                claim.release()
                router.metrics.requests.labels("decode_timeout").inc()
                return timed_out(router, "decode")
            except Unreachable:
                claim.release()
                router.decode.mark_dead(worker)
                tried.add(worker.url)
                self.retried("decode_unreachable")
                continue
            except BaseException:  # cancelled: the client left while the stream was opening D
                claim.release()
                raise
            if response.status == 200:
                return claim, response
            claim.release()
            try:
                content = await self.waiting(response.read())
            except Unreachable:
                content = b""
            finally:
                await response.close()
            return self.decode_refused(content, response.status)

    def decode_refused(self, content: bytes, status: int) -> Response:
        """D answered with an error: pass it on. The conversation keeps its previous lease, which is still
        valid on a live D, so a retried turn can reuse it."""
        self.router.metrics.requests.labels("decode_error").inc()
        return Response(content, status, media_type="application/json")

    async def decode_answer(self, d_body: dict) -> tuple[WorkerState, bytes] | Response:
        """A non-streamed turn's whole answer from a decode worker, with the worker's load released; or the counted
        error to pass on."""
        opened = await self.open_decode(d_body)
        if isinstance(opened, Response):
            return opened
        claim, response = opened
        try:
            content = await self.waiting(response.read())
            claim.work_done()
            return claim.worker, content
        except TimedOut:
            self.router.metrics.requests.labels("decode_timeout").inc()
            return timed_out(self.router, "decode")
        except Unreachable:
            self.router.metrics.requests.labels("decode_error").inc()
            return error_response(503, "the decode worker failed before its answer was complete")
        finally:
            claim.release()
            await response.close()

    def unreadable_answer(self) -> Response:
        """D said 200 but its answer is not a JSON object: nothing to pass on."""
        self.router.metrics.requests.labels("decode_error").inc()
        return error_response(502, "the decode worker's answer is not a JSON object")

    async def complete_decode(self, d_body: dict) -> Response:
        answered = await self.decode_answer(d_body)
        if isinstance(answered, Response):
            return answered
        worker, content = answered
        result = self.backend.read_answer(content)
        if result is None:
            return self.unreadable_answer()
        kv = result.pop("kv_transfer_params", None)
        choice = (result.get("choices") or [{}])[0]
        await self.backend.remember(DecodeAnswer(worker.url, choice_text(choice, self.chat, delta=False), kv,
                                                 streamed=False, finish_reason=choice.get("finish_reason")))
        self.backend.strip_ids(result)
        self.backend.honest_usage(result.get("usage"))
        learned = self.learn_and_trace(result.get("kvturn"))
        result["kvturn"] = self.client_report(result.get("kvturn"), worker.url, learned)
        if self.want_kv and kv is not None:
            result["kv_transfer_params"] = kv
        self.router.metrics.requests.labels("ok").inc()
        reply = Response(fast_json.dumps(result), media_type="application/json")
        self.backend.observe_work()
        return reply

    def client_report(self, decode: dict | None, decode_url: str, learned: dict | None) -> dict:
        """The turn's `kvturn` object as the client gets it (answers.concealed unless internals are exposed)."""
        report = self.report(decode, decode_url, learned)
        return report if self.router.config.expose_internals else concealed(report)

    def learn_and_trace(self, decode: dict | None) -> dict | None:
        """The turn's end, once D's account of it (`decode`, its `kvturn` report) is in: teach the cost model what
        the turn cost and write its trace line. Returns what was learned, for the response's `kvturn` object."""
        learned = self.backend.learn(decode)
        self.router.trace.record(self, decode)
        return learned

    @property
    def order(self) -> int:
        """How far the conversation has come (its messages): a store keeps the newest turn's entry."""
        messages = self.body.get("messages")
        return len(messages) if isinstance(messages, list) else 0

    async def remember_answer(self, answer: str | None) -> None:
        """Name the conversation by its history with this answer, so a client resending it finds the lease."""
        if self.history is not None and self.conversation is not None and answer is not None:
            digest = self.history.extended({"role": "assistant", "content": answer})
            await self.router.table.remember_history(digest, self.key, self.conversation.client_id)
