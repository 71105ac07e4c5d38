"""What the router keeps to serve vLLM workers: which workers are vLLM (asked per worker), their KV block size,
the prompt's token ids (a local tokenizer or the prefill worker's /tokenize), streamed turns whose retention
call is still running, and the metrics of the token-space reuse check."""
import asyncio
import functools
import logging
import re
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from yarl import URL

from kvturn.config import RouterConfig
from kvturn.router.upstream import Unreachable, Upstream
from kvturn.router.fast_json import checked_ids, cut_int_list, dumps, encode_with, ids_text, loads

if TYPE_CHECKING:
    from kvturn.model.tokenizer import ChatTokenizer
from kvturn.router.vllm_reuse import OUTCOMES
from kvturn.router.work_clock import WorkClock

log = logging.getLogger("kvturn.router")
KVTURN, VLLM, UNKNOWN = "kvturn", "vllm", "unknown"
DEFAULT_BLOCK_SIZE = 128  # vLLM's block size on CPU and most GPUs; learned from /metrics when it says
RETENTION_WAIT_S = 2.0  # a next turn waits this long at most for the previous streamed turn's retention call
# Fields of a chat request that change how its messages render to tokens: /tokenize must see the same ones.
RENDERING_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                    "chat_template_kwargs", "tools", "documents", "mm_processor_kwargs")
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)
_OWN_BUCKETS = (0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1)


@functools.lru_cache(maxsize=256)
def endpoint(url: str) -> URL:
    """A worker's URL, parsed once: the client would parse the string anew for each of a turn's three requests."""
    return URL(url)


class VLLMMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.reuse = Counter("kvturn_router_vllm_reuse", "Token-space check of a vLLM decode worker's retained KV "
                             "before prefill reads it, by outcome", ["outcome"], registry=registry)
        self.reuse_tokens = Counter("kvturn_router_vllm_reuse_tokens", "Tokens of retained KV: claimed by decode, "
                                    "verified against the new prompt, passed to prefill", ["kind"], registry=registry)
        self.streams = Counter("kvturn_router_vllm_streamed_turns", "Streamed vLLM turns by where the next turn's "
                               "kv_transfer_params came from: stream (vLLM sends them), retention_call (a 1-token "
                               "call after the stream), none (no reuse next turn)", ["kv_params"], registry=registry)
        self.stream_without_kv_params = Counter("kvturn_router_vllm_stream_without_kv_params", "Streamed vLLM turns "
                                                "whose stream carried no kv_transfer_params", registry=registry)
        self.tokenize_seconds = Histogram("kvturn_router_vllm_tokenize_seconds", "Getting a prompt's token ids "
                                          "(local tokenizer or /tokenize)", registry=registry)
        self.own_seconds = Histogram("kvturn_router_own_work_seconds", "The router's own work per vLLM turn: "
                                     "everything but waiting on workers and the client (wall clock)",
                                     buckets=_OWN_BUCKETS, registry=registry)
        self.own_cpu_seconds = Histogram("kvturn_router_own_work_cpu_seconds", "The same stretches of the "
                                         "router's own work, in its thread's CPU time", buckets=_OWN_BUCKETS,
                                         registry=registry)
        for outcome in OUTCOMES:
            self.reuse.labels(outcome)
        for kind in ("claimed", "verified", "passed"):
            self.reuse_tokens.labels(kind)
        for source in ("stream", "retention_call", "none"):
            self.streams.labels(source)


class VLLMBackend:
    def __init__(self, config: RouterConfig, registry: CollectorRegistry, tokenizer: "ChatTokenizer | None" = None):
        """`tokenizer`: the model's ChatTokenizer (--tokenizer), or None to ask prefill's /tokenize."""
        self.config = config
        self.metrics = VLLMMetrics(registry)
        self.block_sizes: dict[str, int] = {}
        self.pending: dict[str, asyncio.Task] = {}  # conversation key -> its retention call still running
        self._tokenizer = tokenizer

    @staticmethod
    def serves(workers) -> bool:
        return any(w.backend == VLLM for w in workers if w.healthy)

    async def detect(self, client: Upstream, workers) -> None:
        """Name each worker's backend once it answers (forced by --backend unless auto)."""
        for worker in workers:
            if worker.backend != UNKNOWN or not worker.healthy:
                continue
            try:
                backend = self.config.backend if self.config.backend != "auto" else await self._ask(client, worker.url)
                if backend == VLLM:
                    self.block_sizes[worker.url] = await self._block_size(client, worker.url)
            except Unreachable:
                continue
            worker.backend = backend
            log.info("%s worker %s is %s", worker.role, worker.url, backend)

    @staticmethod
    async def _ask(client: Upstream, url: str) -> str:
        """kvturn's /health names itself; vLLM's answers with an empty body and has /version."""
        health = await client.get(f"{url}/health", timeout_s=2.0)
        is_json = health.content_type.startswith("application/json")
        if health.content and is_json and health.json().get("backend") == KVTURN:
            return KVTURN
        version = await client.get(f"{url}/version", timeout_s=2.0)
        return VLLM if version.status == 200 and "version" in version.json() else KVTURN

    @staticmethod
    async def _block_size(client: Upstream, url: str) -> int:
        found = _BLOCK_SIZE.search((await client.get(f"{url}/metrics", timeout_s=5.0)).content.decode())
        return int(found.group(1)) if found else DEFAULT_BLOCK_SIZE

    def block_size(self, url: str) -> int:
        return self.block_sizes.get(url, DEFAULT_BLOCK_SIZE)

    async def prompt_ids(self, client: Upstream, prefill_url: str, body: dict, chat: bool,
                         clock: WorkClock, messages_json: bytes | None) -> tuple[str | None, list[int] | None]:
        """(the token ids the request's prompt renders to, as their text "1,2,3" (vllm_reuse.py), or None if unknown;
        the same ids as a list when they came from the local tokenizer: the workers must be handed them to compute
        exactly these)."""
        started = time.perf_counter()
        try:
            prompt = body.get("prompt")
            if not chat and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return ids_text(prompt), None
            if self._tokenizer is not None:
                clock.pause()  # on a thread, off the event loop: the turn waits for it like a worker
                try:
                    local = await asyncio.to_thread(self._local_ids, body, chat)
                finally:
                    clock.resume()
                if local is not None:
                    return local
            request = {"model": body.get("model")}
            if chat:
                request["messages"] = None
                request.update({k: body[k] for k in RENDERING_FIELDS if k in body})
                content = encode_with(request, "messages", messages_json or dumps(body.get("messages")))
            elif isinstance(prompt, str):
                request["prompt"] = prompt
                content = dumps(request)
            else:
                return None, None
            clock.pause()
            try:
                response = await client.post(endpoint(f"{prefill_url}/tokenize"), content)
            finally:
                clock.resume()
            if response.status != 200:
                return None, None
            _, tokens = cut_int_list(response.content.decode(), "tokens")
            if tokens is None:  # not vLLM's compact JSON: parsed whole
                return ids_text(loads(response.content).get("tokens")), None
            return checked_ids(tokens), None
        except (Unreachable, ValueError, AttributeError):  # AttributeError: a reply that is not a JSON object
            return None, None
        finally:
            self.metrics.tokenize_seconds.observe(time.perf_counter() - started)

    def _local_ids(self, body: dict, chat: bool) -> tuple[str, list[int]] | None:
        """(text, list) of the prompt's ids. The local template renders plain text messages only; anything else is
        left to the backend."""
        if body.get("echo") or any(k in body for k in RENDERING_FIELDS if k != "add_generation_prompt"):
            return None
        if chat:
            messages = body.get("messages") or []
            if body.get("add_generation_prompt", True) is not True or \
                    not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                return None
            ids = self._tokenizer.encode(self._tokenizer.apply_chat_template(messages))
        elif isinstance(body.get("prompt"), str):
            ids = self._tokenizer.encode(body["prompt"])
        else:
            return None
        return ids_text(ids), ids

    async def wait_pending(self, key: str | None) -> None:
        """Let the previous streamed turn's retention call land before this turn looks the conversation up."""
        task = self.pending.get(key) if key else None
        if task is not None:
            await asyncio.wait({task}, timeout=RETENTION_WAIT_S)
