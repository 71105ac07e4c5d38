"""One turn through vLLM prefill and decode workers (NixlConnector, bidirectional): the same flow as `Turn`, plus
what vLLM lacks. Before handing P the decode worker's retained KV, the router checks in token space that the new
prompt starts with the tokens that KV holds, and caps `remote_num_tokens` at the verified prefix. D's params are
passed on unchanged but for the two flags and that cap, and dropped once P has read them (vLLM's handles are single
use). vLLM <= 0.32 streams no `kv_transfer_params`: after a streamed turn one 1-token call asks D to retain
prompt + answer, so the next turn still reuses."""
import asyncio
import json
import logging
import time

from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from yarl import URL

from kvturn.errors import error_body, error_response
from kvturn.router import vllm_reuse
from kvturn.router.conversations import Conversation
from kvturn.router.fast_json import checked_ids, cut_int_list, dumps, encode_with, ids_text, loads
from kvturn.router.answers import answer_object
from kvturn.router.turn import Turn, UpstreamError
from kvturn.router.upstream import Reply, Stream, Unreachable
from kvturn.router.vllm_backend import endpoint
from kvturn.router.vllm_params import PREFILL_STUB, params_for_prefill, stored_params
from kvturn.router.vllm_retention import retain_streamed_turn
from kvturn.router.work_clock import WorkClock
from kvturn.router.workers import Claim
from kvturn.router.answers import choice_text

log = logging.getLogger("kvturn.router")
FINISHED_WITH_RETENTION = ("length", "stop")  # vLLM retains only these ends
class VLLMTurn(Turn):
    def __init__(self, *args, work: WorkClock):
        super().__init__(*args)
        self.vllm = self.router.vllm
        self.outcome = vllm_reuse.NO_PARAMS
        self.tokens_claimed = self.tokens_verified = self.tokens_passed = 0
        self.pinned_ids: list[int] | None = None  # ids from the local tokenizer: the workers must compute these
        self.wants_ids = bool(self.body.get("return_token_ids"))
        self.one_choice = self.body.get("n") in (None, 1)  # with several answers, which one D's KV holds is unclear
        self.work = work  # started once the request's body was in; paused around every wait on a worker or the client
        self.tokenize_s = 0.0
        self.prompt_ids: str | None = None  # as text, "1,2,3" (vllm_reuse.py)
        messages = self.body.get("messages")
        self.messages_json = dumps(messages) if self.chat and messages else None

    def encoded(self, body: dict) -> bytes:
        """A worker request's JSON, the history encoded once for the turn's three calls."""
        if self.messages_json is not None and "messages" in body:
            return encode_with(body, "messages", self.messages_json)
        return dumps(body)

    def echoed_prompt_ids(self, ids: str | None) -> str | None:
        """Decode's prompt ids, cut out of its JSON: most often the very text /tokenize sent, checked once."""
        if ids is None:
            return None
        return self.prompt_ids if ids == self.prompt_ids else checked_ids(ids)

    def observe_work(self) -> None:
        wall_ms, cpu_ms = self.work.totals_ms()
        self.vllm.metrics.own_seconds.observe(wall_ms / 1e3)
        self.vllm.metrics.own_cpu_seconds.observe(cpu_ms / 1e3)

    async def read(self, response: Stream) -> bytes:
        self.work.pause()
        try:
            return await response.read()
        finally:
            self.work.resume()

    async def send(self, url: str | URL, content: bytes) -> Stream:
        """A call to a worker, with its JSON encoded before the wait, as the router's work."""
        self.work.pause()
        try:
            return await self.router.http.open(url, content)
        finally:
            self.work.resume()

    async def run(self) -> Response:
        router = self.router
        self.work.pause()
        await self.vllm.wait_pending(self.key)
        self.work.resume()
        missed_because = None
        if self.key:
            self.entry, missed_because = await router.table.lookup(self.key)
        router.metrics.lookups.labels("hit" if self.entry else (missed_because or "miss")).inc()
        try:
            self.prefill, self.prefill_url = await self.run_prefill()
        except UpstreamError as exc:
            router.metrics.requests.labels("prefill_error").inc()
            return exc.response
        router.metrics.reuse.labels(self.outcome).inc()
        d_params = self.prefill.get("kv_transfer_params")
        if self.pinned_ids is not None and isinstance(d_params, dict):
            d_params = d_params | {"prompt_token_ids": self.pinned_ids}
        d_body = {**self.body, "kv_transfer_params": d_params, "return_token_ids": True}
        if self.key is not None:
            d_body["conversation_id"] = self.key
        if self.body.get("stream"):
            return await self.stream_decode(d_body)
        return await self.complete_decode(d_body)

    async def verify_reuse(self, prefill_url: str) -> None:
        """Decide how many of D's retained tokens P may load, from the token ids on both sides."""
        entry, metrics = self.entry, self.vllm.metrics
        started = time.perf_counter()
        ids, self.pinned_ids = await self.vllm.prompt_ids(self.router.http, prefill_url, self.body, self.chat,
                                                          self.work, self.messages_json)
        self.prompt_ids = ids
        self.tokenize_s = time.perf_counter() - started
        if entry is None or not entry.kv_params:
            self.outcome = vllm_reuse.NO_PARAMS
        elif not entry.prompt_token_ids or not isinstance(entry.prompt_token_ids, str):  # a list: an older router's
            self.outcome = vllm_reuse.NO_TOKEN_IDS
        elif ids is None:
            self.outcome = vllm_reuse.TOKENIZE_FAILED
        else:
            self.tokens_claimed = int(entry.kv_params.get("remote_num_tokens") or 0)
            self.tokens_passed, self.outcome, self.tokens_verified = vllm_reuse.verified_reuse(
                entry.prompt_token_ids, ids, self.tokens_claimed, self.vllm.block_size(prefill_url),
                self.router.config.kv_recompute_threshold_tokens)
            metrics.reuse_tokens.labels("claimed").inc(self.tokens_claimed)
            metrics.reuse_tokens.labels("verified").inc(self.tokens_verified)
            metrics.reuse_tokens.labels("passed").inc(self.tokens_passed)
        metrics.reuse.labels(self.outcome).inc()

    def prefill_body(self, passing: bool) -> dict:
        kv = params_for_prefill(self.entry.kv_params, self.tokens_passed) if passing else dict(PREFILL_STUB)
        if self.pinned_ids is not None:
            kv["prompt_token_ids"] = self.pinned_ids
        body = {**self.body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
        body.pop("stream_options", None)
        body.pop("return_token_ids", None)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        return body

    async def run_prefill(self) -> tuple[dict, str]:
        """Call a prefill worker: verified reuse first; on a 5xx with reuse (an expired or unreachable handle makes
        vLLM's P fail), once more without it; then another P."""
        router = self.router
        tried: set[str] = set()
        failed: Reply | None = None
        verified_on = None
        while True:
            worker = router.prefill.least_loaded(tried)
            if worker is None:
                if failed is not None:
                    raise UpstreamError(Response(failed.content, failed.status, media_type="application/json"))
                raise UpstreamError(error_response(503, "no prefill worker is available"))
            if verified_on is None:
                verified_on = worker.url
                await self.verify_reuse(worker.url)
            passing = self.tokens_passed > 0
            with router.prefill.claim(worker):
                content = self.encoded(self.prefill_body(passing))
                started = time.perf_counter()
                self.work.pause()
                try:
                    response = await router.http.post(endpoint(worker.url + self.path), content)
                    self.prefill_round_trip_s = time.perf_counter() - started
                except Unreachable:
                    router.prefill.mark_dead(worker)
                    tried.add(worker.url)
                    router.metrics.retries.labels("prefill_unreachable").inc()
                    continue
                finally:
                    self.work.resume()
            if passing:
                await router.table.drop(self.key)  # P has read (or tried to read) D's blocks: vLLM frees them
            if response.status == 200:
                return loads(response.content), worker.url
            if response.status < 500:
                raise UpstreamError(Response(response.content, response.status, media_type="application/json"))
            if passing:
                self.tokens_passed, self.outcome = 0, "failed_with_reuse"
                router.metrics.retries.labels("prefill_failed_with_reuse").inc()
                continue
            tried.add(worker.url)
            failed = response
            router.metrics.retries.labels("prefill_failed").inc()

    async def remember_vllm(self, decode_url: str, kv: dict | None, retained_ids: str | None,
                            answer: str | None) -> None:
        """Keep D's params with the token ids its KV holds (`retained_ids`, cut at the params' count); anything else
        means no reuse next turn."""
        if self.key is None:
            return
        router = self.router
        claimed = kv.get("remote_num_tokens") if isinstance(kv, dict) else None
        if isinstance(claimed, int) and claimed > 0 and kv.get("do_remote_decode") and retained_ids and \
                self.one_choice:
            await router.table.put(Conversation(self.key, decode_url, stored_params(kv), 0.0, self.order,
                                                retained_ids))
        else:
            await router.table.drop(self.key)
        await self.remember_answer(answer)

    def merged_kvturn(self, decode: dict | None, decode_url: str) -> dict:
        prefill_usage = self.prefill.get("usage") or {}
        p_kv = self.prefill.get("kv_transfer_params") or {}
        return {
            "conversation_id": self.conversation.client_id if self.conversation else None,
            "backend": "vllm",
            "prefill_worker": self.prefill_url,
            "decode_worker": decode_url,
            "reuse": self.outcome,
            "tokens_claimed": self.tokens_claimed,
            "tokens_verified": self.tokens_verified,
            "tokens_passed": self.tokens_passed,
            "prompt_tokens": prefill_usage.get("prompt_tokens"),
            "prompt_tokens_cached_prefill": p_kv.get("remote_prefill_cached_tokens"),
            "timing": {"prefill_request_ms": self.prefill_round_trip_s * 1e3, "tokenize_ms": self.tokenize_s * 1e3,
                       "router_ms": self.work.totals_ms()[0], "router_cpu_ms": self.work.totals_ms()[1]},
        }

    def strip_ids(self, response: dict) -> None:
        """Token ids were asked for the router's check; the client sees them only if it asked too."""
        if self.wants_ids:
            return
        response.pop("prompt_token_ids", None)
        for choice in response.get("choices") or []:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)  # /v1/completions puts them on the choice

    def decode_request(self, worker, d_body: dict) -> tuple[str | URL, bytes]:
        """As Turn's, with the body encoded once for all the worker calls of the turn."""
        return endpoint(worker.url + self.path), self.encoded(d_body)

    async def complete_decode(self, d_body: dict) -> Response:
        router = self.router
        answered = await self.decode_answer(d_body)
        if isinstance(answered, Response):
            return answered
        worker, content = answered
        text = content.decode()
        rest, echoed = cut_int_list(text, "prompt_token_ids")
        result = answer_object(text if self.wants_ids else rest)
        if result is None:
            return self.unreadable_answer()
        kv = result.pop("kv_transfer_params", None)
        choice = (result.get("choices") or [{}])[0]
        answer = choice_text(choice, self.chat, delta=False)
        prompt_ids = self.echoed_prompt_ids(echoed) or ids_text(result.get("prompt_token_ids") or
                                                                choice.get("prompt_token_ids"))
        retained = vllm_reuse.retained_token_ids(prompt_ids, ids_text(choice.get("token_ids")),
                                                 kv.get("remote_num_tokens") if isinstance(kv, dict) else None)
        await self.remember_vllm(worker.url, kv, retained, answer)
        self.strip_ids(result)
        if self.want_kv and kv is not None:
            result["kv_transfer_params"] = kv
        router.metrics.requests.labels("ok").inc()
        result["kvturn"] = self.merged_kvturn(None, worker.url)
        reply = Response(dumps(result), media_type="application/json")
        self.observe_work()
        return reply

    async def stream_decode(self, d_body: dict) -> Response:
        opened = await self.open_decode(d_body)
        if isinstance(opened, Response):
            return opened
        claim, response = opened
        self.work.pause()  # until decode's first line: Starlette starts the response meanwhile
        return StreamingResponse(self.relay(claim, response), media_type="text/event-stream",
                                 background=BackgroundTask(self.close_stream, claim, response))

    async def relay(self, claim: Claim, response: Stream):
        router, worker_url = self.router, claim.worker.url
        answer, prompt_ids, output_ids = [], None, []
        kv, finish_reason, finished = None, None, False
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
                    finished = True
                    await self.after_stream(worker_url, kv, prompt_ids, output_ids, finish_reason, "".join(answer))
                    router.metrics.requests.labels("ok").inc()
                    self.observe_work()
                    self.work.pause()
                    yield "data: [DONE]\n\n"
                    continue
                if prompt_ids is None:
                    rest, echoed = cut_int_list(payload, "prompt_token_ids")
                    prompt_ids = self.echoed_prompt_ids(echoed)
                    payload = payload if self.wants_ids else rest
                chunk = loads(payload)
                prompt_ids = prompt_ids or ids_text(chunk.get("prompt_token_ids"))
                for choice in chunk.get("choices") or []:
                    prompt_ids = prompt_ids or ids_text(choice.get("prompt_token_ids"))
                    answer.append(choice_text(choice, self.chat, delta=True) or "")
                    output_ids.extend(choice.get("token_ids") or ())
                    finish_reason = choice.get("finish_reason") or finish_reason
                if "kv_transfer_params" in chunk:  # vLLM with streamed params (after 0.32)
                    kv = chunk["kv_transfer_params"] if self.want_kv else chunk.pop("kv_transfer_params")
                self.strip_ids(chunk)
                if finish_reason and "kvturn" not in chunk:
                    chunk["kvturn"] = self.merged_kvturn(None, worker_url)
                out = b"data: %s\n\n" % dumps(chunk)
                self.work.pause()
                yield out
        except (Unreachable, json.JSONDecodeError) as exc:
            log.warning("decode worker %s failed mid-stream: %s", worker_url, exc)
            yield b"data: %s\n\n" % dumps(error_body(503, "the decode worker failed mid-stream"))
        finally:
            self.work.pause()
            await self.end_relay(claim, response, finished)

    async def after_stream(self, decode_url: str, kv: dict | None, prompt_ids: str | None,
                           output_ids: list[int], finish_reason: str | None, answer: str) -> None:
        """Record what the next turn may reuse before the last write: a client may hang up right after [DONE]."""
        metrics, output = self.vllm.metrics, ids_text(output_ids)
        if kv is not None:
            metrics.streams.labels("stream").inc()
            claimed = kv.get("remote_num_tokens") if isinstance(kv, dict) else None  # a broken worker's: not reused
            retained = vllm_reuse.retained_token_ids(prompt_ids, output, claimed)
            await self.remember_vllm(decode_url, kv, retained, answer)
            return
        metrics.stream_without_kv_params.inc()
        if self.key is None or not self.router.config.vllm_retain_streamed_turns or not prompt_ids or \
                finish_reason not in FINISHED_WITH_RETENTION or not self.one_choice:
            metrics.streams.labels("none").inc()
            await self.remember_vllm(decode_url, None, None, answer)
            return
        await self.router.table.drop(self.key)  # until the retention call answers, there is nothing to reuse
        await self.remember_answer(answer)
        task = asyncio.create_task(retain_streamed_turn(self.router, self.key, decode_url, self.body.get("model"),
                                                        vllm_reuse.joined_ids(prompt_ids, output), self.order))
        self.vllm.pending[self.key] = task
        task.add_done_callback(lambda done, key=self.key: self.vllm.pending.pop(key, None)
                               if self.vllm.pending.get(key) is done else None)
