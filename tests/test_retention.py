"""Retention tiers and the session life cycle through real processes: router + P + two D with a tiny retained budget
(1 MiB: every lease moves to the host tier) and a 4 MiB host tier, a colocated worker for the greedy reference, and
two tenants (API keys)."""
import signal
import time

import httpx
import pytest

from chat import SYSTEM, metric, user_message
from kvturn.launch import LocalStack

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
DECODES = ("decode0", "decode1")
NO_CALIBRATION = ["--no-calibrate"]  # the path is fixed (pull): start-up timing would only slow each start


@pytest.fixture(scope="module")
def stacks(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("retention-logs")
    tiered = LocalStack(tiny_model_dir, kv_cache_mb=64, prefix_caching_on_prefill=False, num_decode=2,
                        decode_args=["--retained-kv-budget-mb", "1", "--retained-host-mb", "4"],
                        router_args=["--api-key", KEY_A, "--api-key", KEY_B], worker_args=NO_CALIBRATION,
                        log_dir=logs / "tiered")
    colocated = LocalStack(tiny_model_dir, mode="colocated", kv_cache_mb=64, worker_args=NO_CALIBRATION,
                           log_dir=logs / "colocated")
    try:
        for stack in (tiered, colocated):
            stack.start_worker_processes()
        for stack in (tiered, colocated):
            stack.wait_and_start_router()
        yield tiered, colocated
    finally:
        for stack in (tiered, colocated):
            stack.stop()


def ask(url: str, messages: list[dict], conversation: str | None, key: str | None = KEY_A, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}
    if conversation is not None:
        body["conversation_id"] = conversation
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    result = response.json()
    return {"text": result["choices"][0]["message"]["content"], "kvturn": result.get("kvturn")}


def talk(stacks, conversation: str, turns: int, key: str = KEY_A, start: list[dict] | None = None):
    """`turns` turns through the tiered stack, each answer checked against the colocated worker's greedy one."""
    tiered, colocated = stacks
    messages = list(start) if start else [{"role": "system", "content": SYSTEM}]
    results = []
    for turn in range(turns):
        messages.append(user_message(turn))
        result = ask(tiered.url, messages, conversation, key)
        assert result["text"] == ask(colocated.url, messages, None, key=None)["text"], (conversation, turn)
        results.append(result)
        messages.append({"role": "assistant", "content": result["text"]})
    return messages, results


def total(stack, name: str, labels: str = "") -> float:
    return sum(metric(stack.urls[d], name, labels) for d in DECODES if stack.processes[d].poll() is None)


def test_leases_moved_to_the_host_tier_are_read_from_there_with_identical_greedy_output(stacks):
    tiered, _ = stacks
    moves_before = total(tiered, "kvturn_kv_tier_moves_total", '{from="pool",to="host"}')
    host_reads_before = metric(tiered.urls["prefill"], "kvturn_kv_tier_reads_total", '{tier="host"}')
    _, results = talk(stacks, "host-conv", 3)
    for result in results[1:]:
        assert result["kvturn"]["reuse"] == "reused" and result["kvturn"]["kv_tier"] == "host"
        assert result["kvturn"]["prompt_tokens_from_decode"] > 0
    assert total(tiered, "kvturn_kv_tier_moves_total", '{from="pool",to="host"}') - moves_before >= 3
    assert metric(tiered.urls["prefill"], "kvturn_kv_tier_reads_total", '{tier="host"}') - host_reads_before == 2
    assert total(tiered, "kvturn_kv_tier_retained_bytes", '{tier="host"}') > 0


def test_a_full_host_tier_drops_its_least_recently_used_lease_and_that_conversation_recomputes(stacks):
    tiered, _ = stacks
    started = {}
    for name in ("full-x", "full-y", "full-z", "full-w", "full-v"):  # ~24 blocks each, 64 host blocks per D
        started[name] = talk(stacks, name, 1)
    holder = started["full-x"][1][0]["kvturn"]["decode_worker"]
    others = [n for n in started if started[n][1][0]["kvturn"]["decode_worker"] == holder]
    assert len(others) >= 3, "the decode workers shared five conversations unevenly"
    for name in (others[0], others[-1]):  # the least recently used was dropped; the newest is still there
        messages, _ = started[name]
        messages.append(user_message(1))
        result = ask(tiered.url, messages, name)
        assert result["text"] == ask(stacks[1].url, messages, None, key=None)["text"]
        # the router learns it is gone from D before P is asked; P would from D's answer or the epochs it reads
        expected = ("lease_ended", "lease_unknown", "epoch_mismatch") if name == others[0] else ("reused",)
        assert result["kvturn"]["reuse"] in expected, name


def test_a_session_is_released_by_its_owner_and_refused_to_anyone_else(stacks):
    tiered, _ = stacks
    messages, _ = talk(stacks, "mine", 1)
    released_before = total(tiered, "kvturn_kv_leases_total", '{event="released"}')
    url = f"{tiered.url}/v1/conversations/mine"
    assert httpx.delete(url, timeout=30).status_code == 401
    refused = httpx.delete(url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "conversation_id"
    assert total(tiered, "kvturn_kv_leases_total", '{event="released"}') == released_before
    ended = httpx.delete(url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert ended.status_code == 200 and ended.json()["kv_released"] is True
    assert total(tiered, "kvturn_kv_leases_total", '{event="released"}') == released_before + 1
    messages.append(user_message(1))
    assert ask(tiered.url, messages, "mine")["kvturn"]["reuse"] is None  # nothing left to read


def test_end_session_on_the_last_turn_releases_its_lease_once_answered(stacks):
    tiered, _ = stacks
    messages, _ = talk(stacks, "last-turn", 1)
    released_before = total(tiered, "kvturn_kv_leases_total", '{event="released"}')
    messages.append(user_message(1))
    ask(tiered.url, messages, "last-turn", end_session=True)
    deadline = time.monotonic() + 30  # the release follows the answer, in the router's background
    while total(tiered, "kvturn_kv_leases_total", '{event="released"}') == released_before:
        assert time.monotonic() < deadline, "the session's lease was not released"
        time.sleep(0.1)
    gone = httpx.delete(f"{tiered.url}/v1/conversations/last-turn", headers={"Authorization": f"Bearer {KEY_A}"},
                        timeout=30)
    assert gone.status_code == 404


def test_killing_the_decode_worker_that_holds_a_host_tier_lease_loses_no_answer(stacks):
    tiered, _ = stacks
    messages, results = talk(stacks, "survivor", 2)
    holder = next(n for n in DECODES if tiered.urls[n] == results[-1]["kvturn"]["decode_worker"])
    tiered.kill(holder, signal.SIGKILL)
    _, later = talk(stacks, "survivor", 1, start=messages)
    assert later[0]["kvturn"]["decode_worker"] != tiered.urls[holder]
    assert later[0]["kvturn"]["reuse"] in ("peer_unreachable", "lease_unknown", "read_failed")
