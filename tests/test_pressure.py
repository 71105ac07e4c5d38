"""Retention under pool pressure through real processes: router + P (prefix cache on) + D with bidirectional transfer,
both pools 56 blocks (a first turn here is ~23 blocks), D running one request at a time. Whatever retention holds
must yield to the requests: D's leases are reclaimed, never a running request preempted or a prompt recomputed on
D; P's pins (D is about to read them) are never taken; and a lease D let go is withdrawn by the router, never handed
to P."""
import threading

import httpx
import pytest

from chat import SYSTEM, metric, user_message
from kvturn.launch import LocalStack

POOL = ["--num-kv-blocks", "56", "--no-calibrate"]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with LocalStack(tiny_model_dir, kv_cache_mb=64, prefix_caching_on_prefill=True, worker_args=POOL,
                    decode_args=["--max-num-seqs", "1"], log_dir=tmp_path_factory.mktemp("pressure-logs")) as stack:
        yield stack


def first_turn(name: str) -> list[dict]:
    return [{"role": "system", "content": f"Session {name}. {SYSTEM}"}, user_message(0)]


def ask(stack, messages: list[dict], conversation: str) -> dict:
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "conversation_id": conversation}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    result = response.json()
    return {"text": result["choices"][0]["message"]["content"], "kvturn": result["kvturn"]}


def counter(stack, worker: str, name: str, labels: str = "") -> float:
    return metric(stack.urls[worker], name, labels)


def test_a_lease_decode_let_go_is_withdrawn_by_the_router_not_handed_to_prefill(stack):
    first = ask(stack, first_turn("a"), "conv-a")
    for name in ("b", "c"):  # two more histories: the decode pool holds two leases and a turn, not three leases
        ask(stack, first_turn(name), f"conv-{name}")
    assert counter(stack, "decode0", "kvturn_kv_leases_total", '{event="reclaimed"}') >= 1
    mismatches = counter(stack, "prefill", "kvturn_kv_reuse_declines_total", '{reason="epoch_mismatch"}')
    messages = first_turn("a") + [{"role": "assistant", "content": first["text"]}, user_message(1)]
    second = ask(stack, messages, "conv-a")
    assert second["kvturn"]["reuse"] == "lease_ended"
    assert second["kvturn"]["bytes_d_to_p"] == 0
    assert counter(stack, "prefill", "kvturn_kv_reuse_declines_total", '{reason="epoch_mismatch"}') == mismatches
    assert metric(stack.url, "kvturn_router_prefill_reuse_total", '{outcome="lease_ended"}') == 1


def test_under_pressure_leases_yield_and_no_decode_is_slowed_by_a_preemption_or_a_recompute(stack):
    computed_before = counter(stack, "decode0", "kvturn_prompt_tokens_computed_total")
    errors = []

    def session(name: str) -> None:
        try:
            messages = first_turn(name)
            for turn in range(2):
                result = ask(stack, messages, f"conv-{name}")
                messages += [{"role": "assistant", "content": result["text"]}, user_message(turn + 1)]
        except Exception as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(f"p{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert counter(stack, "decode0", "kvturn_kv_leases_total", '{event="reclaimed"}') >= 2  # the pressure was real
    assert counter(stack, "decode0", "kvturn_preemptions_total") == 0
    # D read every prompt from P's pins (none was let go under P's own pressure): it computed none itself
    assert counter(stack, "decode0", "kvturn_kv_reuse_declines_total", '{reason="epoch_mismatch"}') == 0
    assert counter(stack, "decode0", "kvturn_prompt_tokens_computed_total") == computed_before
    assert counter(stack, "prefill", "kvturn_kv_leases_total", '{event="reclaimed"}') == 0
