"""One turn of a conversation through the router: look up the conversation, prefill (handing P the decode
worker's lease so it can read the history back), decode (streamed or whole), and remember the new lease."""
import logging
import time

from fastapi.responses import JSONResponse, Response
from yarl import URL

from kvturn.errors import error_response
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.params import BadKVParams, KVTransferParams
from kvturn.router.answers import answer_object, choice_text
from kvturn.router.conversations import Conversation
from kvturn.router.first_token import may_send_ahead
from kvturn import costmodel
from kvturn.costmodel.reports import own_read_ms, reported_prompt_tokens, shared_steps
from kvturn.router import fast_json, keys, lease_tier
from kvturn.router.keys import ConversationKey, History, message_size
from kvturn.router.streaming import Streaming
from kvturn.router.upstream import Reply, Stream, Unreachable
from kvturn.router.workers import Claim, UpstreamError, WorkerState

log = logging.getLogger("kvturn.router")
LEASE_GONE = (policy.LEASE_UNKNOWN, policy.EXPIRED, policy.EPOCH_MISMATCH)  # the decode worker let it go


class Turn(Streaming):
    def __init__(self, router, path: str, chat: bool, body: dict, conversation: ConversationKey | None,
                 history: History | None, want_kv: bool):
        self.router, self.path, self.chat, self.body = router, path, chat, body
        self.conversation, self.history, self.want_kv = conversation, history, want_kv
        self.key = conversation.key if conversation else None
        self.entry: Conversation | None = None
        self.prefill: dict = {}
        self.prefill_url = ""
        self.prefill_round_trip_s = 0.0
        self.choice: costmodel.PathChoice | None = None
        # Tokens of the text of the messages the estimate counted (text_tokens): those sent after the answer the
        # lease holds, or all of them when there is no lease.
        self.counted_tokens: int | None = None
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.first_token_from = "decode"  # or "prefill": P's token, sent ahead of D's stream (first_token.py)
        prompt = body.get("prompt")
        self.prompt_size = history.size if history else len(prompt) if isinstance(prompt, str) else 0

    async def run(self) -> Response:
        router = self.router
        missed_because = None
        if self.key:
            self.entry, missed_because = await router.table.lookup(self.key)
        router.metrics.lookups.labels("hit" if self.entry else (missed_because or "miss")).inc()
        self.choice = costmodel.choose(router.costs, self.view(), router.config.path_policy, router.config.stall_weight)
        router.costs.chosen(self.choice.path)
        router.metrics.paths.labels(self.choice.path).inc()
        if self.choice.path == costmodel.COMPUTE_ON_DECODE:
            return await self.decode(dict(self.body))  # D computes the new tokens on the history it retained
        started = time.perf_counter()
        try:
            self.prefill, self.prefill_url = await self.run_prefill()
        except UpstreamError as exc:
            router.metrics.requests.labels("prefill_error").inc()
            return exc.response
        self.prefill_round_trip_s = time.perf_counter() - started
        p_kvturn = self.prefill.setdefault("kvturn", {})
        if missed_because and p_kvturn.get("reuse") is None:
            p_kvturn["reuse"] = missed_because  # the lease ended before this turn came
        reuse = p_kvturn.get("reuse")
        router.metrics.reuse.labels(str(reuse)).inc()
        if self.entry is not None and reuse in LEASE_GONE:
            await router.table.drop(self.key)  # nothing left to read there; keep no stale entry
        return await self.decode({**self.body, "kv_transfer_params": self.prefill.get("kv_transfer_params")})

    async def decode(self, d_body: dict) -> Response:
        if self.key is not None:
            d_body["conversation_id"] = self.key
        if self.body.get("stream"):
            return await self.stream_decode(d_body)
        return await self.complete_decode(d_body)

    def view(self) -> costmodel.TurnView:
        """What the path policy needs to know of this turn, from the table and the workers' load."""
        router, entry = self.router, self.entry
        retained, running, available, decode_backlog, step_ms = 0, 0, False, 0.0, 0.0
        if entry is not None:
            retained = int(entry.kv_params.get("remote_num_tokens") or 0)
            holder = router.decode.find(entry.decode_url)
            if holder is not None:
                running, decode_backlog, step_ms = holder.in_flight, holder.backlog_ms(), holder.step_ms
                available = holder.healthy and holder.in_flight < router.config.max_in_flight_per_decode
        prefill = router.prefill.least_loaded()
        tier = lease_tier.guess(entry, router.decode.find(entry.decode_url) if entry else None)
        return costmodel.TurnView(self.estimated_prompt_tokens(), retained, running, available,
                              prefill.in_flight if prefill else 0, prefill.backlog_ms() if prefill else 0.0,
                              decode_backlog, may_send_ahead(self.body, self.chat), step_ms, retained_tier=tier)

    def estimated_prompt_tokens(self) -> int:
        """The prompt's tokens: counted with the model's tokenizer where the router has it (--tokenizer) and the
        text is short enough, the rest estimated from the bytes (costmodel.tokens.TokenEstimator.prompt_tokens)."""
        prompt, messages, costs = self.body.get("prompt"), self.body.get("messages"), self.router.costs
        if isinstance(prompt, list):
            return len(prompt)
        if isinstance(prompt, str) and self.router.tokenizer is not None and len(prompt) <= keys.MAX_COUNTED_BYTES:
            if len(prompt.encode("utf-8", "surrogatepass")) <= keys.MAX_COUNTED_BYTES:
                return self.router.tokenizer.count(prompt)  # a completion's prompt has no template
        known_bytes, known_tokens = self.known_history()
        if known_tokens:
            added = keys.added_since(messages, self.entry.order)
            self.counted_tokens = self.text_tokens(added, self.prompt_size - known_bytes)
            if self.counted_tokens is not None:
                return known_tokens + costs.tokens.added_tokens(self.counted_tokens)
        elif isinstance(messages, list):
            self.counted_tokens = self.text_tokens(messages, self.prompt_size)
            if self.counted_tokens is not None:
                return costs.tokens.templated_tokens(self.counted_tokens, len(messages))
        return costs.tokens.prompt_tokens(self.prompt_size, known_bytes, known_tokens)

    def text_tokens(self, messages: list | None, size: int) -> int | None:
        """Tokens of the text of `messages` (`size` bytes), counted with the model's tokenizer; None without one,
        or when keys.countable_texts finds them not worth counting here."""
        texts = keys.countable_texts(messages, size)
        counts = self.router.text_tokens
        if counts is None or texts is None:
            return None
        return sum(counts.count(text, self.key) for text in texts)

    def known_history(self) -> tuple[int, int]:
        """(bytes, tokens) of the history whose KV the conversation's lease holds; (0, 0) if none is known."""
        entry = self.entry
        if entry is None or not entry.history_bytes:
            return 0, 0
        return entry.history_bytes, int(entry.kv_params.get("remote_num_tokens") or 0)

    def learn(self, decode: dict | None) -> dict:
        """Teach the cost model what this turn cost, and describe the path for the response."""
        costs, choice = self.router.costs, self.choice
        prefill = self.prefill.get("kvturn") or {}
        for role, report in (("prefill", prefill), ("decode", decode or {})):
            costs.observe_prefill(role, report)
        d_timing, p_timing = (decode or {}).get("timing", {}), prefill.get("timing", {})
        if self.first_token_at is not None:
            actual = (self.first_token_at - self.started) * 1e3
        else:
            actual = self.prefill_round_trip_s * 1e3 + (d_timing.get("ttft_ms") or 0.0)
        timed = {"prefill": p_timing}  # what the TTFT holds: D's part too, unless P's first token went ahead
        if self.first_token_from != "prefill":
            timed["decode"] = d_timing
        explained = sum((t.get("prefill_compute_ms") or 0.0) + own_read_ms(role, t) for role, t in timed.items())
        shared = any(shared_steps(report) for report in (prefill, decode or {}))
        costs.observe_turn(choice, actual, explained, shared)
        if self.prefill_round_trip_s:
            costs.prefill_request_ms.add(self.prefill_round_trip_s * 1e3)
        prompt_tokens = reported_prompt_tokens(decode)
        known_bytes, known_tokens = self.known_history()
        costs.tokens.observe_prompt(self.prompt_size, prompt_tokens, known_bytes, known_tokens)
        if self.counted_tokens is not None and prompt_tokens:
            if known_tokens:
                costs.tokens.observe_added(prompt_tokens - known_tokens, self.counted_tokens)
            else:
                costs.tokens.observe_template(prompt_tokens, self.counted_tokens, len(self.body["messages"]))
        costs.observe_reuse(known_tokens, (decode or {}).get("prompt_tokens_cached") or 0)
        predicted = choice.predicted_ms[choice.path]
        if actual > 0:
            self.router.metrics.prediction_error.labels(choice.path).observe(abs(predicted - actual) / actual)
        return {"chosen": choice.path, "policy": self.router.config.path_policy,
                "predicted_ttft_ms": {p: round(ms, 2) for p, ms in choice.predicted_ms.items()},
                "predicted_queue_ms": round(choice.estimate.queue_ms, 2),
                "predicted_tokens_computed": choice.estimate.tokens_computed,
                "actual_ttft_ms": round(actual, 2), "other_ms": round(max(actual - explained, 0.0), 2),
                "stall_ms": round(choice.stall_ms, 2)}

    async def run_prefill(self) -> tuple[dict, str]:
        """Call a prefill worker; returns (its JSON, its URL). Retries another P, and once without reuse."""
        router = self.router
        tried: set[str] = set()
        lease = self.entry.kv_params if self.entry and self.choice.path == costmodel.PULL else None
        failed: Reply | None = None  # the last 5xx, passed on when no worker is left to try
        while True:
            worker = router.prefill.least_loaded(tried)
            if worker is None and failed is not None:
                raise UpstreamError(Response(failed.content, failed.status, media_type="application/json"))
            if worker is None:
                raise UpstreamError(error_response(503, "no prefill worker is available"))
            kv = KVTransferParams.parse(lease).for_next_prefill() if lease else {"do_remote_decode": True,
                                                                                   "do_remote_prefill": False}
            p_body = {**self.body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
            p_body.pop("stream_options", None)
            if "max_completion_tokens" in p_body:
                p_body["max_completion_tokens"] = 1
            if self.key is not None:
                p_body["conversation_id"] = self.key
            with router.prefill.claim(worker, self.choice.work_ms) as claim:
                try:
                    response = await router.http.post(worker.url + self.path, fast_json.dumps(p_body))
                except Unreachable:
                    router.prefill.mark_dead(worker)
                    tried.add(worker.url)
                    router.metrics.retries.labels("prefill_unreachable").inc()
                    continue
                if response.status == 200:
                    claim.work_done()
            if response.status == 200:
                return fast_json.loads(response.content), worker.url
            if response.status < 500:
                raise UpstreamError(Response(response.content, response.status, media_type="application/json"))
            if lease is not None:
                lease = None
                router.metrics.retries.labels("prefill_failed_with_reuse").inc()
                continue
            tried.add(worker.url)
            failed = response
            router.metrics.retries.labels("prefill_failed").inc()

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
            on_decode = self.choice is not None and self.choice.path == costmodel.COMPUTE_ON_DECODE
            claim = router.decode.claim(worker, self.choice.work_ms if on_decode else 0.0)
            try:
                response = await self.send(*self.decode_request(worker, d_body))
            except Unreachable:
                claim.release()
                router.decode.mark_dead(worker)
                tried.add(worker.url)
                router.metrics.retries.labels("decode_unreachable").inc()
                continue
            except BaseException:  # cancelled: the client left while the stream was opening D
                claim.release()
                raise
            if response.status == 200:
                return claim, response
            claim.release()
            try:
                content = await response.read()
            except Unreachable:
                content = b""
            finally:
                await response.close()
            return self.decode_refused(content, response.status)

    def decode_request(self, worker: WorkerState, d_body: dict) -> tuple[str | URL, bytes]:
        """(URL, JSON body) of the turn's call to a decode worker."""
        return worker.url + self.path, fast_json.dumps(d_body)

    async def send(self, url: str | URL, content: bytes) -> Stream:
        """Open a call to a worker: its status is in, its body is read by the caller."""
        return await self.router.http.open(url, content)

    async def remember(self, decode_url: str, kv: dict | None, answer: str | None) -> None:
        if self.key is None:
            return
        router = self.router
        try:
            params = KVTransferParams.parse(kv)
        except BadKVParams:
            params = KVTransferParams()
        if params.handle:
            answered = self.prompt_size + (len(answer or "") if self.body.get("messages") is None else
                                           message_size({"role": "assistant", "content": answer or ""}))
            await router.table.put(Conversation(self.key, decode_url, kv, 0.0, self.order, history_bytes=answered))
        else:
            await router.table.drop(self.key)  # the old lease is superseded or gone
        await self.remember_answer(answer)

    @property
    def order(self) -> int:
        """How far the conversation has come (its messages): a store keeps the newest turn's entry."""
        messages = self.body.get("messages")
        return len(messages) if isinstance(messages, list) else 0

    async def remember_answer(self, answer: str | None) -> None:
        """Name the conversation by its history with this answer, so a client resending it finds the lease."""
        if self.history is not None and answer is not None:
            digest = self.history.extended({"role": "assistant", "content": answer})
            await self.router.table.remember_history(digest, self.key)

    def decode_refused(self, content: bytes, status: int) -> Response:
        """D answered with an error: pass it on. The conversation keeps its previous lease, which is still
        valid on a live D, so a retried turn can reuse it."""
        self.router.metrics.requests.labels("decode_error").inc()
        return Response(content, status, media_type="application/json")

    def merged_kvturn(self, decode: dict | None, decode_url: str) -> dict:
        """One timing breakdown for the turn, from P's and D's own accounts."""
        self.router.trace.record(self, decode)
        prefill = self.prefill.get("kvturn") or {}
        p_timing, d_timing = prefill.get("timing", {}), (decode or {}).get("timing", {})
        return {
            "conversation_id": self.conversation.client_id if self.conversation else None,
            "prefill_worker": self.prefill_url,
            "decode_worker": decode_url,
            "reuse": prefill.get("reuse"),
            "kv_tier": prefill.get("kv_tier"),  # which tier of D's P read the history from (pool or host)
            "first_token_from": self.first_token_from,
            "prompt_tokens_computed_prefill": prefill.get("prompt_tokens_computed"),
            "prompt_tokens_from_decode": prefill.get("prompt_tokens_remote"),
            "prompt_tokens_cached_prefill": prefill.get("prompt_tokens_cached"),
            "bytes_d_to_p": prefill.get("kv_read_bytes", 0),
            "bytes_p_to_d": (decode or {}).get("kv_read_bytes", 0),
            "timing": {
                "prefill_request_ms": self.prefill_round_trip_s * 1e3,
                "queue_ms": p_timing.get("queue_ms"),
                "d_to_p_read_ms": p_timing.get("kv_read_ms"),
                "d_to_p_read_step_ms": p_timing.get("kv_read_step_ms"),  # of it, P's steps for other prompts
                "prefill_compute_ms": p_timing.get("prefill_compute_ms"),
                "p_to_d_read_ms": d_timing.get("kv_read_ms"),
                "decode_ttft_ms": d_timing.get("ttft_ms"),
            },
            "path": self.learn(decode),
            "decode": decode,
            "prefill_timing": p_timing,
        }

    async def decode_answer(self, d_body: dict) -> tuple[WorkerState, bytes] | Response:
        """A non-streamed turn's whole answer from a decode worker, with the worker's load released; or the counted
        error to pass on."""
        opened = await self.open_decode(d_body)
        if isinstance(opened, Response):
            return opened
        claim, response = opened
        try:
            content = await self.read(response)
            claim.work_done()
            return claim.worker, content
        except Unreachable:
            self.router.metrics.requests.labels("decode_error").inc()
            return error_response(503, "the decode worker failed before its answer was complete")
        finally:
            claim.release()
            await response.close()

    async def read(self, response: Stream) -> bytes:
        return await response.read()

    def unreadable_answer(self) -> Response:
        """D said 200 but its answer is not a JSON object: nothing to pass on."""
        self.router.metrics.requests.labels("decode_error").inc()
        return error_response(502, "the decode worker's answer is not a JSON object")

    async def complete_decode(self, d_body: dict) -> Response:
        router = self.router
        answered = await self.decode_answer(d_body)
        if isinstance(answered, Response):
            return answered
        worker, content = answered
        result = answer_object(content)
        if result is None:
            return self.unreadable_answer()
        kv = result.pop("kv_transfer_params", None)
        choice = (result.get("choices") or [{}])[0]
        answer = choice_text(choice, self.chat, delta=False)
        await self.remember(worker.url, kv, answer)
        result["kvturn"] = self.merged_kvturn(result.get("kvturn"), worker.url)
        if self.want_kv and kv is not None:
            result["kv_transfer_params"] = kv
        router.metrics.requests.labels("ok").inc()
        return JSONResponse(result)
