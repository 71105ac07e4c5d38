"""A turn's backend on vLLM workers (NixlConnector, bidirectional): what vLLM lacks, the router does. Before handing
P the decode worker's retained KV, it checks in token space that the new prompt starts with the tokens that KV holds,
and caps `remote_num_tokens` at the verified prefix (vllm_reuse.py). D's params are passed on unchanged but for the
two flags and that cap, and dropped once P has read them (vLLM's handles are single use). D is asked for the token ids
its KV holds, which the client sees only if it asked too. vLLM <= 0.32 streams no `kv_transfer_params`: after a
streamed turn one 1-token call asks D to retain prompt + answer (vllm_retention.py), so the next turn still reuses.
The router's own work on the turn is counted (work_clock.py). What the router keeps across turns is
vllm_backend.py's."""
import asyncio
import time

from yarl import URL

from kvturn.router import vllm_reuse
from kvturn.router.answers import DecodeAnswer, answer_object
from kvturn.router.conversations import Conversation
from kvturn.router.fast_json import checked_ids, cut_int_list, dumps, encode_with, ids_text, loads
from kvturn.router.turn_backend import TurnBackend
from kvturn.router.vllm_backend import endpoint
from kvturn.router.vllm_params import PREFILL_STUB, params_for_prefill, stored_params
from kvturn.router.vllm_retention import retain_streamed_turn

FINISHED_WITH_RETENTION = ("length", "stop")  # vLLM retains only these ends


class VLLMWorkers(TurnBackend):
    reports_own_work = True

    def __init__(self, turn):
        super().__init__(turn)
        self.vllm = turn.router.vllm
        self.outcome = vllm_reuse.NO_PARAMS
        self.tokens_claimed = self.tokens_verified = self.tokens_passed = 0
        self.pinned_ids: list[int] | None = None  # ids from the local tokenizer: the workers must compute these
        self.prompt_ids: str | None = None  # the new prompt's, as text "1,2,3" (vllm_reuse.py)
        self.tokenize_s = 0.0
        self.wants_ids = bool(turn.body.get("return_token_ids"))
        self.one_choice = turn.body.get("n") in (None, 1)  # with several answers, which one D's KV holds is unclear
        messages = turn.body.get("messages")
        self.messages_json = dumps(messages) if turn.chat and messages else None
        self.answered_prompt_ids: str | None = None  # the prompt's ids as D echoed them
        self.output_ids: list[int] = []  # the answer's, as D streamed them

    async def previous_turn_settled(self) -> None:
        """Let the previous streamed turn's retention call land before this turn looks the conversation up."""
        await self.vllm.wait_pending(self.turn.key)

    async def verify_reuse(self, prefill_url: str) -> None:
        """Decide how many of D's retained tokens P may load, from the token ids on both sides."""
        turn, metrics = self.turn, self.vllm.metrics
        entry = turn.entry
        started = time.perf_counter()
        self.prompt_ids, self.pinned_ids = await self.vllm.prompt_ids(turn.router.http, prefill_url, turn.body,
                                                                      turn.chat, turn.work, self.messages_json)
        self.tokenize_s = time.perf_counter() - started
        if entry is None or not entry.kv_params:
            self.outcome = vllm_reuse.NO_PARAMS
        elif not entry.prompt_token_ids or not isinstance(entry.prompt_token_ids, str):  # a list: an older router's
            self.outcome = vllm_reuse.NO_TOKEN_IDS
        elif self.prompt_ids is None:
            self.outcome = vllm_reuse.TOKENIZE_FAILED
        else:
            self.tokens_claimed = int(entry.kv_params.get("remote_num_tokens") or 0)
            self.tokens_passed, self.outcome, self.tokens_verified = vllm_reuse.verified_reuse(
                entry.prompt_token_ids, self.prompt_ids, self.tokens_claimed, self.vllm.block_size(prefill_url),
                turn.router.config.kv_recompute_threshold_tokens)
            metrics.reuse_tokens.labels("claimed").inc(self.tokens_claimed)
            metrics.reuse_tokens.labels("verified").inc(self.tokens_verified)
            metrics.reuse_tokens.labels("passed").inc(self.tokens_passed)
        metrics.reuse.labels(self.outcome).inc()

    @property
    def reusing(self) -> bool:
        return self.tokens_passed > 0

    def prefill_body(self, body: dict) -> dict:
        kv = params_for_prefill(self.turn.entry.kv_params, self.tokens_passed) if self.reusing else dict(PREFILL_STUB)
        if self.pinned_ids is not None:
            kv["prompt_token_ids"] = self.pinned_ids
        body["kv_transfer_params"] = kv
        body.pop("return_token_ids", None)
        return body

    def request(self, url: str, body: dict) -> tuple[URL, bytes]:
        """As the default, with the history encoded once for the turn's three calls."""
        if self.messages_json is not None and "messages" in body:
            return endpoint(url), encode_with(body, "messages", self.messages_json)
        return endpoint(url), dumps(body)

    async def prefill_read_lease(self) -> None:
        await self.turn.router.table.drop(self.turn.key)  # vLLM frees the blocks P read: nothing is left to reuse

    def give_up_reuse(self) -> None:
        self.tokens_passed, self.outcome = 0, "failed_with_reuse"

    async def count_reuse(self, missed_because: str | None) -> None:
        self.turn.router.metrics.reuse.labels(self.outcome).inc()

    def decode_body(self) -> dict:
        """P's params for D, with the ids the workers must compute, and D asked for the token ids it answers."""
        d_params = self.turn.prefill.get("kv_transfer_params")
        if self.pinned_ids is not None and isinstance(d_params, dict):
            d_params = d_params | {"prompt_token_ids": self.pinned_ids}
        return {**self.turn.body, "kv_transfer_params": d_params, "return_token_ids": True}

    def echoed_prompt_ids(self, ids: str | None) -> str | None:
        """D's prompt ids, cut out of its JSON: most often the very text /tokenize sent, checked once."""
        if ids is None:
            return None
        return self.prompt_ids if ids == self.prompt_ids else checked_ids(ids)

    def read_answer(self, content: bytes) -> dict | None:
        """D's answer with the prompt's ids cut out as text, unparsed (most often thousands of them)."""
        text = content.decode()
        rest, echoed = cut_int_list(text, "prompt_token_ids")
        result = answer_object(text if self.wants_ids else rest)
        if result is None:
            return None
        choice = (result.get("choices") or [{}])[0]
        self.answered_prompt_ids = self.echoed_prompt_ids(echoed) or ids_text(result.get("prompt_token_ids") or
                                                                              choice.get("prompt_token_ids"))
        self.output_ids = choice.get("token_ids")
        return result

    def read_chunk(self, payload: str) -> dict:
        """A chunk of D's stream, the prompt's ids cut out of the first, the answer's collected."""
        if self.answered_prompt_ids is None:
            rest, echoed = cut_int_list(payload, "prompt_token_ids")
            self.answered_prompt_ids = self.echoed_prompt_ids(echoed)
            payload = payload if self.wants_ids else rest
        chunk = loads(payload)
        self.answered_prompt_ids = self.answered_prompt_ids or ids_text(chunk.get("prompt_token_ids"))
        for choice in chunk.get("choices") or []:
            self.answered_prompt_ids = self.answered_prompt_ids or ids_text(choice.get("prompt_token_ids"))
            self.output_ids.extend(choice.get("token_ids") or ())
        return chunk

    def strip_ids(self, response: dict) -> None:
        """Token ids were asked for the router's check; the client sees them only if it asked too."""
        if self.wants_ids:
            return
        response.pop("prompt_token_ids", None)
        for choice in response.get("choices") or []:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)  # /v1/completions puts them on the choice

    def cached_tokens(self) -> int | None:
        """What P did not compute (its prefix-cache hits and what it loaded from D): vLLM's P says it in its params;
        D's count would include what D loaded from P. Else P's usage, if it gave details."""
        prefill = self.turn.prefill
        cached = (prefill.get("kv_transfer_params") or {}).get("remote_prefill_cached_tokens")
        if not isinstance(cached, int):
            cached = ((prefill.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return cached if isinstance(cached, int) and not isinstance(cached, bool) else None

    def reports_on(self, chunk: dict, finish_reason: str | None) -> bool:
        return bool(finish_reason) and "kvturn" not in chunk

    async def remember(self, answer: DecodeAnswer) -> None:
        """Keep D's params with the token ids its KV holds; a stream without them (vLLM <= 0.32) is retained by a
        call of its own."""
        metrics, kv, output = self.vllm.metrics, answer.kv, ids_text(self.output_ids)
        if answer.streamed and kv is None:
            metrics.stream_without_kv_params.inc()
            await self.retain_after_stream(answer, output)
            return
        if answer.streamed:
            metrics.streams.labels("stream").inc()
        retained = vllm_reuse.retained_token_ids(self.answered_prompt_ids, output,
                                                 kv.get("remote_num_tokens") if isinstance(kv, dict) else None)
        await self.keep(answer, retained)

    async def keep(self, answer: DecodeAnswer, retained_ids: str | None) -> None:
        """Keep D's params with the token ids its KV holds (`retained_ids`, cut at the params' count); anything else
        means no reuse next turn."""
        turn, kv = self.turn, answer.kv
        if turn.key is None:
            return
        claimed = kv.get("remote_num_tokens") if isinstance(kv, dict) else None
        if isinstance(claimed, int) and claimed > 0 and kv.get("do_remote_decode") and retained_ids and \
                self.one_choice:
            await turn.router.table.put(Conversation(turn.key, answer.decode_url, stored_params(kv), 0.0, turn.order,
                                                     retained_ids))
        else:
            await turn.router.table.drop(turn.key)
        await turn.remember_answer(answer.text)

    async def retain_after_stream(self, answer: DecodeAnswer, output_ids: str | None) -> None:
        """A stream that carried no params: one retention call after it, where vLLM retains such a turn."""
        turn, vllm = self.turn, self.vllm
        if turn.key is None or not turn.router.config.vllm_retain_streamed_turns or not self.answered_prompt_ids \
                or answer.finish_reason not in FINISHED_WITH_RETENTION or not self.one_choice:
            vllm.metrics.streams.labels("none").inc()
            await self.keep(answer, None)
            return
        await turn.router.table.drop(turn.key)  # until the retention call answers, there is nothing to reuse
        await turn.remember_answer(answer.text)
        task = asyncio.create_task(retain_streamed_turn(
            turn.router, turn.key, answer.decode_url, turn.body.get("model"),
            vllm_reuse.joined_ids(self.answered_prompt_ids, output_ids), turn.order))
        vllm.pending[turn.key] = task
        task.add_done_callback(lambda done, key=turn.key: vllm.pending.pop(key, None)
                               if vllm.pending.get(key) is done else None)

    def report(self, decode: dict | None, decode_url: str, learned: dict | None) -> dict:
        turn = self.turn
        prefill_usage = turn.prefill.get("usage") or {}
        p_kv = turn.prefill.get("kv_transfer_params") or {}
        router_ms, router_cpu_ms = turn.work.totals_ms()
        return {
            "conversation_id": turn.conversation.client_id if turn.conversation else None,
            "backend": "vllm",
            "prefill_worker": turn.prefill_url,
            "decode_worker": decode_url,
            "reuse": self.outcome,
            "tokens_claimed": self.tokens_claimed,
            "tokens_verified": self.tokens_verified,
            "tokens_passed": self.tokens_passed,
            "prompt_tokens": prefill_usage.get("prompt_tokens"),
            "prompt_tokens_cached_prefill": p_kv.get("remote_prefill_cached_tokens"),
            "timing": {"prefill_request_ms": turn.prefill_round_trip_s * 1e3, "tokenize_ms": self.tokenize_s * 1e3,
                       "router_ms": router_ms, "router_cpu_ms": router_cpu_ms},
        }

    def observe_work(self) -> None:
        wall_ms, cpu_ms = self.turn.work.totals_ms()
        self.vllm.metrics.own_seconds.observe(wall_ms / 1e3)
        self.vllm.metrics.own_cpu_seconds.observe(cpu_ms / 1e3)

