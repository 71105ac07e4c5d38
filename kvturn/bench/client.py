"""Replays conversations against an OpenAI-compatible URL and records what each request cost.

Per-request field names follow vLLM's multi-turn benchmark (`ttft_ms`, `tpot_ms`, ...); when the
server is kvturn, the response's `kvturn` block adds the prefill split and the reuse outcome.
"""
import asyncio
import gc
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from rich.progress import Progress

from kvturn.bench.workload import Conversation


@dataclass(slots=True)
class RequestRecord:
    conversation_id: str
    client_id: int
    turn: int
    input_num_turns: int
    start_time_ms: float
    warmup: bool
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    latency_ms: float | None = None
    input_num_tokens: int | None = None
    output_num_tokens: int | None = None
    output_num_chunks: int = 0
    output_num_first_chunk_tokens: int | None = None
    approx_cached_percent: float | None = None
    reuse: str | None = None
    prompt_tokens_computed_prefill: int | None = None
    prompt_tokens_from_decode: int | None = None
    prompt_tokens_cached_prefill: int | None = None  # P's prefix cache (a colocated worker's own)...
    prompt_tokens_cached_prefill_host: int | None = None  # ...of them, from its host tier
    queue_ms: float | None = None
    engine_wait_ms: float | None = None  # P's (a colocated worker's) engine's own wait to run it: queue, read from D
    prefill_compute_ms: float | None = None
    d_to_p_read_ms: float | None = None
    d_to_p_read_step_ms: float | None = None  # of it, P's engine steps for other prompts before it was seen done
    d_to_p_read_hidden_ms: float | None = None  # of it, what P's compute of the turn's own tokens covered
    p_to_d_read_ms: float | None = None
    prefill_request_ms: float | None = None  # the router's round trip to P
    decode_ttft_ms: float | None = None  # D's own, from its receipt of the request
    decode_engine_wait_ms: float | None = None  # ...of it, D's engine's own wait to run it
    decode_compute_ms: float | None = None  # D computing prompt tokens itself (the compute-on-decode path)
    decode_tokens_computed: int | None = None  # ...and how many it computed
    path: str | None = None  # the router's choice: recompute, pull or compute_on_decode
    first_token_from: str | None = None  # "prefill": the router sent P's token ahead, D's part is not in the TTFT
    predicted_ttft_ms: float | None = None  # what the router's cost model expected of that path
    predicted_queue_ms: float | None = None  # ...of it, the work it expected queued ahead of the turn
    predicted_tokens_computed: int | None = None  # ...and the prompt tokens it expected the path to compute
    bytes_d_to_p: int = 0
    bytes_p_to_d: int = 0
    # the tokens the answer's text comes to on its own, as the next turn resends it (a model's text need not
    # tokenize back to the tokens it generated); None: not counted
    answer_text_tokens: int | None = None
    kv_tier: str | None = None  # which tier of D's the history was read from (pool or host)
    prefill_worker: str | None = None  # which P served the turn (placement.py: did it meet its history?)
    side_channel_ms: float | None = None  # P asking D for its lease before the read (none when the record sufficed)
    answer_digest: str | None = None  # of the answer's text: legs' greedy answers compare by it
    error: str | None = None

    @property
    def other_ms(self) -> float | None:
        """TTFT that is neither compute nor transfer: router hops, side channel, queues, bookkeeping."""
        if self.ttft_ms is None:
            return None
        parts = ("prefill_compute_ms", "d_to_p_read_ms", "p_to_d_read_ms", "decode_compute_ms")
        return max(self.ttft_ms - sum(self.in_ttft(p) for p in parts), 0.0)

    def in_ttft(self, part: str) -> float:
        """A part of the time to first token, ms: D's read and compute are not in it when P's token went ahead."""
        if part in ("p_to_d_read_ms", "decode_compute_ms") and self.first_token_from == "prefill":
            return 0.0
        if part == "d_to_p_read_ms":  # read layer by layer, its hidden part is inside the compute's time
            return max((self.d_to_p_read_ms or 0.0) - (self.d_to_p_read_hidden_ms or 0.0), 0.0)
        return getattr(self, part) or 0.0


@dataclass(slots=True)
class SessionRecord:
    conversation_id: str
    client_id: int
    start_s: float
    duration_s: float | None = None
    turns_completed: int = 0
    failed: bool = False


@dataclass(slots=True)
class RunResult:
    requests: list[RequestRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    retained_kv: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, bytes)
    runtime_s: float = 0.0
    # role -> the prefill steps its worker timed at start-up (its /kv/calibration), when the bench launched it
    worker_calibration: dict[str, list] = field(default_factory=dict)
    # role -> the forward steps its worker ran during the run (its /kv/steps), when the bench launched it
    worker_steps: dict[str, list] = field(default_factory=dict)
    transcript: list[dict] = field(default_factory=list)  # the messages of the first conversation, answers included
    # with --hosts netns: bytes each host's link carried during the run, into and out of its namespace
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    # role -> its worker's retention counters at the end of the run (compare.worker_counters), when the bench launched it
    worker_counters: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"requests": [asdict(r) for r in self.requests], "sessions": [asdict(s) for s in self.sessions],
                "retained_kv": self.retained_kv, "runtime_s": self.runtime_s,
                "worker_calibration": self.worker_calibration, "worker_steps": self.worker_steps,
                "transcript": self.transcript, "link_bytes": self.link_bytes, "worker_counters": self.worker_counters}


class RateLimiter:
    """Poisson arrivals at `rate` requests per second (no limit when rate <= 0)."""

    def __init__(self, rate: float, seed: int):
        self.rate = rate
        self.rng = np.random.default_rng(seed)
        self.next_at = time.perf_counter()
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        if self.rate <= 0:
            return
        async with self.lock:
            self.next_at = max(self.next_at, time.perf_counter()) + self.rng.exponential(1 / self.rate)
            delay = self.next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def model_name(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def decode_metric_urls(client: httpx.AsyncClient, url: str) -> list[str]:
    """A kvturn router lists its decode workers in /health; a lone worker is its own decode worker."""
    try:
        health = (await client.get(f"{url}/health")).json()
    except (httpx.HTTPError, ValueError):
        return []
    if "decode" in health:
        return list(health["decode"])
    return [url] if "role" in health else []


async def sample_retained_kv(client: httpx.AsyncClient, urls: list[str], start: float, out: list, stop: asyncio.Event,
                             interval_s: float = 0.5) -> None:
    while not stop.is_set():
        total = 0.0
        for url in urls:
            try:
                for line in (await client.get(f"{url}/metrics", timeout=5)).text.splitlines():
                    if line.startswith("kvturn_kv_retained_bytes "):
                        total += float(line.split()[1])
            except httpx.HTTPError:
                pass
        out.append((time.perf_counter() - start, total))
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


def sse_chunk(line: str) -> dict | None:
    """The JSON chunk of one line of an OpenAI stream; None for any other line (blank, a comment, `[DONE]`). A
    chunk that reports an error raises it."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    chunk = json.loads(line[6:])
    if not isinstance(chunk, dict):
        raise RuntimeError(f"stream chunk is not a JSON object: {line[6:80]!r}")
    if "error" in chunk:
        error = chunk["error"]
        raise RuntimeError(error.get("message", "stream error") if isinstance(error, dict) else str(error))
    return chunk


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], record: RequestRecord,
                   max_tokens: int, ignore_eos: bool) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
            "conversation_id": record.conversation_id}
    headers = {"X-Conversation-Id": record.conversation_id, "X-Session-ID": record.conversation_id}
    sent = time.perf_counter()
    first_at, last_at, answer, kvturn, usage = None, None, [], None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if (chunk := sse_chunk(line)) is None:
                continue
            usage = chunk.get("usage") or usage
            kvturn = chunk.get("kvturn") or kvturn
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    if first_at is None:
                        first_at = now
                        record.output_num_first_chunk_tokens = 1
                    last_at = now
                    record.output_num_chunks += 1
                    answer.append(content)
    done = time.perf_counter()
    record.latency_ms = (done - sent) * 1e3
    record.ttft_ms = ((first_at or done) - sent) * 1e3
    if usage:
        record.input_num_tokens = usage.get("prompt_tokens")
        record.output_num_tokens = usage.get("completion_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None and record.input_num_tokens:
            record.approx_cached_percent = 100.0 * cached / record.input_num_tokens
    if record.output_num_tokens and record.output_num_tokens > 1 and first_at is not None:
        record.tpot_ms = ((last_at or done) - first_at) * 1e3 / (record.output_num_tokens - 1)
    if kvturn:
        timing = kvturn.get("timing") or {}
        record.reuse = kvturn.get("reuse")
        record.prompt_tokens_computed_prefill = kvturn.get("prompt_tokens_computed_prefill")
        record.prompt_tokens_from_decode = kvturn.get("prompt_tokens_from_decode")
        record.prompt_tokens_cached_prefill = kvturn.get("prompt_tokens_cached_prefill",
                                                         kvturn.get("prompt_tokens_cached"))
        record.prompt_tokens_cached_prefill_host = kvturn.get("prompt_tokens_cached_prefill_host",
                                                              kvturn.get("prompt_tokens_cached_host"))
        record.prefill_worker = kvturn.get("prefill_worker") or None
        record.queue_ms = timing.get("queue_ms")
        # P's own account (the router passes it whole), or a colocated worker's, which is its timing
        own = kvturn.get("prefill_timing")
        record.engine_wait_ms = (own if isinstance(own, dict) and own else timing).get("engine_wait_ms")
        record.prefill_compute_ms = timing.get("prefill_compute_ms")
        record.d_to_p_read_ms = timing.get("d_to_p_read_ms")
        record.d_to_p_read_step_ms = timing.get("d_to_p_read_step_ms")
        record.d_to_p_read_hidden_ms = timing.get("d_to_p_read_hidden_ms")
        record.p_to_d_read_ms = timing.get("p_to_d_read_ms")
        record.prefill_request_ms = timing.get("prefill_request_ms")
        record.decode_ttft_ms = timing.get("decode_ttft_ms")
        decode_timing = (kvturn.get("decode") or {}).get("timing") or {}
        record.decode_compute_ms = decode_timing.get("prefill_compute_ms")
        record.decode_engine_wait_ms = decode_timing.get("engine_wait_ms")
        record.decode_tokens_computed = (kvturn.get("decode") or {}).get("prompt_tokens_computed")
        path = kvturn.get("path") or {}
        record.path = path.get("chosen")
        record.first_token_from = kvturn.get("first_token_from")
        record.predicted_ttft_ms = (path.get("predicted_ttft_ms") or {}).get(record.path)
        record.predicted_queue_ms = path.get("predicted_queue_ms")
        record.predicted_tokens_computed = path.get("predicted_tokens_computed")
        record.kv_tier = kvturn.get("kv_tier")
        record.side_channel_ms = (own if isinstance(own, dict) else {}).get("side_channel_ms")
        record.bytes_d_to_p = kvturn.get("bytes_d_to_p", 0) or 0
        record.bytes_p_to_d = kvturn.get("bytes_p_to_d", 0) or 0
    return "".join(answer)


async def run(url: str | list[str], conversations: list[Conversation], sessions: int = 4, request_rate: float = 0.0,
              warmup_turns: int = 0, max_turns: int | None = None, seed: int = 0, ignore_eos: bool = True,
              show_progress: bool = True, request_timeout_s: float = 600.0,
              duration_s: float | None = None, count_tokens: Callable[[str], int] | None = None) -> RunResult:
    """Replay every conversation, at most `sessions` at a time; turns of one conversation run in order.
    With `duration_s`, no turn starts after that many seconds (in-flight turns finish). With several URLs (router
    replicas), each turn of a session goes to the next one. `count_tokens` (the model's tokenizer) records the
    tokens each answer's text comes to."""
    urls = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
    url = urls[0]
    result = RunResult()
    limiter = RateLimiter(request_rate, seed)
    total_turns = sum(min(len(c.turns), max_turns or len(c.turns)) for c in conversations)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=10)) as client:
        model = await model_name(client, url)
        metric_urls = await decode_metric_urls(client, url)
        queue: asyncio.Queue = asyncio.Queue()
        for conv in conversations:
            queue.put_nowait(conv)
        gc.collect()
        gc.freeze()  # the workload and the imports: a full collection over them would stall a turn being timed
        start = time.perf_counter()
        out_of_time = lambda: duration_s is not None and time.perf_counter() - start > duration_s  # noqa: E731
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_retained_kv(client, metric_urls, start, result.retained_kv, stop))
        with Progress(disable=not show_progress, transient=True) as progress:
            task = progress.add_task("turns", total=total_turns)

            async def session_worker(client_id: int):
                while not queue.empty() and not out_of_time():
                    conv = queue.get_nowait()
                    session = SessionRecord(conv.conversation_id, client_id, time.perf_counter() - start)
                    result.sessions.append(session)
                    messages = [{"role": "system", "content": conv.system}] if conv.system else []
                    if conv is conversations[0]:
                        result.transcript = messages
                    for index, turn in enumerate(conv.turns[:max_turns or len(conv.turns)]):
                        if out_of_time():
                            break
                        if turn.gap_s > 0 and index > 0:
                            await asyncio.sleep(turn.gap_s)
                        if turn.edit_history and len(messages) > 2:
                            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
                            messages[first_user] = {**messages[first_user],
                                                    "content": "(revised) " + messages[first_user]["content"]}
                        messages.append({"role": "user", "content": turn.user})
                        await limiter.wait()
                        record = RequestRecord(conv.conversation_id, client_id, index, len(messages),
                                               (time.perf_counter() - start) * 1e3, warmup=index < warmup_turns)
                        result.requests.append(record)
                        try:
                            answer = await one_turn(client, urls[(client_id + index) % len(urls)], model, messages,
                                                    record, turn.answer_tokens, ignore_eos)
                            if count_tokens is not None:
                                record.answer_text_tokens = count_tokens(answer)
                            record.answer_digest = hashlib.sha256(answer.encode()).hexdigest()[:16]
                        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                            record.error = f"{type(exc).__name__}: {exc}"[:300]
                            session.failed = True
                            progress.advance(task, len(conv.turns) - index)
                            break
                        messages.append({"role": "assistant", "content": answer})
                        session.turns_completed += 1
                        progress.advance(task)
                    session.duration_s = time.perf_counter() - start - session.start_s

            await asyncio.gather(*(session_worker(i) for i in range(max(1, sessions))))
        stop.set()
        await sampler
        result.runtime_s = time.perf_counter() - start
    return result
