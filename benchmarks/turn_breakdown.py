"""Where one pull turn's time to first token goes, part by part, from the workers' own `kvturn.timing`.

A fresh P/D stack (bidirectional, P's prefix cache off so every later turn reads its history from D), a short
first conversation (whose second turn is the first reuse of this P-D pair), then one conversation whose system
prompt has `--prompt-tokens` tokens, streamed, 150 new tokens and 32 answer tokens a turn.

    python benchmarks/turn_breakdown.py [--prompt-tokens 8192] [--turns 5] [--out results/turn_breakdown.json]

Prints a table and writes JSON with the machine it ran on.
"""
import argparse
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from kvturn.bench.client import sse_chunk
from kvturn.bench.machine import machine, write_json
from kvturn.bench.workload import TextSource
from kvturn.launch import LocalStack
from kvturn.model.make_model import default_model_dir
from kvturn.model.tokenizer import ChatTokenizer

COLUMNS = {"conversation": "conversation", "turn": "turn", "prompt_tokens": "prompt", "ttft_ms": "TTFT", "p_tokenize_ms": "P tokenize",
           "p_side_channel_ms": "P side channel", "p_read_ms": "P read", "p_admission_ms": "P admission",
           "p_compute_ms": "P compute", "p_round_trip_ms": "P round trip", "d_ttft_ms": "D TTFT",
           "other_ms": "other", "tpot_ms": "TPOT"}


def streamed_turn(http: httpx.Client, url: str, messages: list[dict],
                  conversation_id: str) -> tuple[float, float | None, str, dict]:
    """(client TTFT in ms, TPOT in ms, the answer, the final chunk's kvturn object)."""
    body = {"messages": messages, "max_tokens": 32, "stream": True, "conversation_id": conversation_id,
            "ignore_eos": True, "temperature": 0}
    started, first_at, last_at, answer, kvturn = time.perf_counter(), None, None, [], {}
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if (chunk := sse_chunk(line)) is None:
                continue
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    answer.append(choice["delta"]["content"])
                    last_at = time.perf_counter()
                    first_at = first_at or last_at
            kvturn = chunk.get("kvturn") or kvturn
    tokens = (kvturn.get("decode") or {}).get("completion_tokens") or len(answer)
    tpot_ms = (last_at - first_at) * 1e3 / (tokens - 1) if tokens > 1 else None
    return (first_at - started) * 1e3, tpot_ms, "".join(answer), kvturn


def breakdown(conversation: str, turn: int, ttft_ms: float, tpot_ms: float | None, kvturn: dict) -> dict:
    p, timing = kvturn.get("prefill_timing") or {}, kvturn.get("timing") or {}
    d = (kvturn.get("decode") or {}).get("timing") or {}
    in_ttft = [p.get("prefill_compute_ms") or 0.0, p.get("kv_read_ms") or 0.0]
    if kvturn.get("first_token_from") != "prefill":  # D's read and first step are in the TTFT only then
        in_ttft += [d.get("kv_read_ms") or 0.0, d.get("prefill_compute_ms") or 0.0]
    return {"conversation": conversation, "turn": turn, "ttft_ms": ttft_ms, "p_tokenize_ms": p.get("tokenize_ms"),
            "p_side_channel_ms": p.get("side_channel_ms"), "p_read_ms": p.get("kv_read_ms"),
            "p_admission_ms": (p.get("engine_wait_ms") or 0.0) - (p.get("kv_read_ms") or 0.0),
            "p_compute_ms": p.get("prefill_compute_ms"), "p_round_trip_ms": timing.get("prefill_request_ms"),
            "d_ttft_ms": d.get("ttft_ms"), "first_token_from": kvturn.get("first_token_from"),
            "reuse": kvturn.get("reuse"), "other_ms": ttft_ms - sum(in_ttft), "tpot_ms": tpot_ms,
            "prompt_tokens": (kvturn.get("decode") or {}).get("prompt_tokens_computed", 0)
            + ((kvturn.get("decode") or {}).get("prompt_tokens_cached") or 0)
            + ((kvturn.get("decode") or {}).get("prompt_tokens_remote") or 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--out", default="results/turn_breakdown.json")
    parser.add_argument("--pin-workers", action="store_true", help="prefill and decode on their own cores")
    args = parser.parse_args()
    model = str(default_model_dir("tiny"))
    source = TextSource(ChatTokenizer(model))
    rng = np.random.default_rng(0)
    rows = []
    # A long prompt computed from scratch may take minutes on a busy machine: the router waits for it.
    with LocalStack(model, mode="pd", bidirectional=True, prefix_caching_on_prefill=False, kv_cache_mb=2048,
                    router_args=["--upstream-timeout-s", "900"], pin_workers=args.pin_workers, log_dir=Path(args.out).with_suffix("") / "logs") as stack, httpx.Client(timeout=300) as http:
        for conversation, system_tokens, turns in (("first-pair", 600, 2), ("long", args.prompt_tokens, args.turns)):
            messages = [{"role": "system", "content": source.text(rng, system_tokens)}]
            for turn in range(turns):
                messages.append({"role": "user", "content": source.text(rng, 150)})
                ttft_ms, tpot_ms, answer, kvturn = streamed_turn(http, stack.url, messages, conversation)
                messages.append({"role": "assistant", "content": answer})
                rows.append(breakdown(conversation, turn, ttft_ms, tpot_ms, kvturn))
    table = Table(title=f"one pull turn, part by part ({machine()['cpu']}); ms")
    for title in COLUMNS.values():
        table.add_column(title, justify="right")
    for row in rows:
        table.add_row(*(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c] if row[c] is not None else "-")
                        for c in COLUMNS))
    Console(width=160).print(table)
    print(f"JSON: {write_json(args.out, {'machine': machine(), 'args': vars(args), 'turns': rows})}")


if __name__ == "__main__":
    main()
