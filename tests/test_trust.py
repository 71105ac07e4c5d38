"""The trust boundary, with real processes: who a worker may contact, what it believes, how the router scopes
conversations, and the OpenAI surface (logprobs) a client may rely on.

One closed stack (router + P + D sharing a secret, prefix cache off on P so "reused" means KV really moved), two
more routers over the same workers (one with API keys, one with a tiny conversation table), one open colocated
worker (no secret) as the clean reference, and fake peers (tests/fake_peer.py) that log every request they get.
"""
import json
import threading
import time

import httpx
import openai
import pytest

from chat import SYSTEM, metric
from fake_peer import SECRET_HEADER, FakePeer
from kvturn import launch
from kvturn.engine.block_manager import chain_hash
from kvturn.kv_transfer.side_channel import LEASE, PIN, lease_binding
from kvturn.launch import LocalStack
from kvturn.router.keys import scope_of, scoped

K1, K2 = "tenant-one-key-0123456789", "tenant-two-key-9876543210"
MAX_CONVERSATIONS = 3
BOUNDED_SESSION_HEADERS = ("X-Agent-Session", "X-Session-ID")  # the bounded router's own list of session headers
SESSION_HEADERS = ("X-Conversation-Id", "X-Session-ID", "X-Dynamo-Session-ID", "X-SMG-Routing-Key", "X-Correlation-ID",
                   "x-claude-code-session-id", "session-id")  # the documented order
DECLINE = "kvturn_kv_reuse_declines_total"


class Deployment:
    def __init__(self, stack: LocalStack, colocated: str, keyed_router: str, bounded_router: str,
                 fakes: dict[str, FakePeer], logs):
        self.stack, self.colocated, self.logs = stack, colocated, logs
        self.keyed_router, self.bounded_router, self.fakes = keyed_router, bounded_router, fakes
        self.router, self.prefill, self.decode = stack.url, stack.urls["prefill"], stack.urls["decode0"]
        self.secret = {SECRET_HEADER: stack.cluster_secret}
        self.model = httpx.get(f"{self.colocated}/v1/models", timeout=10).json()["data"][0]["id"]

    def agent_info(self, worker_url: str) -> dict:
        return httpx.get(f"{worker_url}/kv/agent", headers=self.secret, timeout=10).json()

    def tokens(self, prompt: str) -> list[int]:
        return httpx.post(f"{self.decode}/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("trust-logs")
    fakes = {name: FakePeer(launch.free_port(), logs) for name in ("untrusted", "for_prefill", "trusted", "bad_agent")}
    stack = LocalStack(tiny_model_dir, kv_cache_mb=64, prefix_caching_on_prefill=False, log_dir=logs,
                       worker_args=["--no-calibrate"], decode_args=["--trusted-peer", fakes["trusted"].address])
    colocated_port = launch.free_port()
    processes = []
    try:
        stack.start_worker_processes()
        colocated = launch.start(["worker", "--role", "both", "--port", str(colocated_port), "--model",
                                  str(tiny_model_dir), "--kv-cache-mb", "32", "--no-calibrate"],
                                 logs / "open-colocated.log", {"KVTURN_CLUSTER_SECRET": ""})
        processes.append(colocated)
        for name, url in stack.urls.items():
            launch.wait_healthy(url, stack.processes[name])
        routers = {}
        for name, extra in (("keyed", ["--api-key", K1, "--api-key", K2]),
                            ("bounded", ["--max-conversations", str(MAX_CONVERSATIONS),
                                         *(a for h in BOUNDED_SESSION_HEADERS for a in ("--session-header", h))])):
            port = launch.free_port()
            routers[name] = f"http://127.0.0.1:{port}"
            processes.append(launch.start(["router", "--port", str(port), "--prefill", stack.urls["prefill"],
                                           "--decode", stack.urls["decode0"], *extra], logs / f"router-{name}.log",
                                          stack.env))
        stack.wait_and_start_router()
        for url, process in zip(routers.values(), processes[1:]):
            launch.wait_healthy(url, process)
        colocated_url = f"http://127.0.0.1:{colocated_port}"
        launch.wait_healthy(colocated_url, colocated)
        for fake in fakes.values():
            fake.wait_listening()
        yield Deployment(stack, colocated_url, routers["keyed"], routers["bounded"], fakes, logs)
    finally:
        for process in processes:
            launch.stop(process)
        stack.stop()
        for fake in fakes.values():
            fake.stop()


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=120)


def complete(url: str, prompt: str, max_tokens: int = 6, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return post(url, "/v1/completions", body, headers)


def chat(url: str, messages: list[dict], max_tokens: int = 4, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return post(url, "/v1/chat/completions", body, headers)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and isinstance(error["type"], str) and "param" in error
    return error


def header(entry: dict, name: str) -> str | None:
    return next((value for key, value in entry["headers"].items() if key.lower() == name.lower()), None)


def remote_prefill_params(fake: FakePeer, handle: str, engine_id: str | None = None) -> dict:
    """What a decode worker is told when P prefilled for it: here, naming the fake peer."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
              "remote_port": fake.port, "handle": handle, "remote_request_id": f"cmpl-{handle}"}
    if engine_id:
        params["remote_engine_id"] = engine_id
    return params


def remote_decode_params(fake: FakePeer, handle: str) -> dict:
    """What a prefill worker is told on a later turn: read the history back from the (fake) decode worker."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_host": "127.0.0.1",
            "remote_port": fake.port, "handle": handle, "remote_block_ids": [1, 2]}


def signed(deployment: Deployment, params: dict, kind: str, binding_key: str) -> dict:
    """`params` with the whole lease record and the MAC a cluster member holding the secret would make for its own
    address (no `remote_blocks_ttl_s`, so the reader still asks the holder): what the router relays from a real
    worker. Only a peer named by such a record is contacted."""
    record = {"handle": params["handle"], "block_ids": params.get("remote_block_ids", [1, 2]),
              "block_hashes": params.get("remote_block_hashes", [11, 12]),
              "block_epochs": params.get("remote_block_epochs", [0, 0]),
              "num_tokens": params.get("remote_num_tokens", 20),
              "expiry_time": params.get("remote_blocks_expiry_time", time.time() + 300),
              "first_token_id": params.get("first_token_id"), "tier": "pool"}
    address = f"{params['remote_host']}:{params['remote_port']}"
    binding = lease_binding(deployment.stack.cluster_secret, kind, params["remote_engine_id"], address, binding_key,
                            record)
    return {**params, "remote_block_ids": record["block_ids"], "remote_block_hashes": record["block_hashes"],
            "remote_block_epochs": record["block_epochs"], "remote_num_tokens": record["num_tokens"],
            "remote_blocks_expiry_time": record["expiry_time"], "binding": binding}


def opening(turn_text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turn_text}]


def next_turn(messages: list[dict], answer: str, turn_text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": turn_text}]


# ---- 3. cache poisoning: first, while the far end of P's pool is untouched (epoch 0), as a forger would find it

def forged_lease(deployment: Deployment, prompt: str, first_token_id: int) -> dict:
    """A lease that names blocks at the far end of P's real pool (zeros) as the KV of `prompt`: if a worker
    believed it, it would take the forged first token and publish those blocks under the prompt's hashes."""
    layout = deployment.agent_info(deployment.prefill)["layout"]
    tokens, size = deployment.tokens(prompt), layout["block_size"]
    hashes = []
    for start in range(0, len(tokens), size):
        hashes.append(chain_hash(hashes[-1] if hashes else 0, tokens[start:start + size]))
    first_block = layout["num_blocks"] - len(hashes)
    return {"block_ids": list(range(first_block, layout["num_blocks"])), "block_hashes": hashes,
            "block_epochs": [0] * len(hashes), "expiry_time": time.time() + 300, "num_tokens": len(tokens),
            "first_token_id": first_token_id}


def arm(deployment: Deployment, fake: FakePeer, handle: str, lease: dict) -> None:
    fake.configure({"agent": {"upstream": deployment.prefill, "secret": deployment.stack.cluster_secret},
                    "leases": {handle: {"status": 200, "json": lease}}})
    fake.clear()


def test_an_untrusted_caller_cannot_poison_the_decode_workers_prefix_cache(deployment):
    d, fake = deployment, deployment.fakes["untrusted"]
    prompt = "Poisoned prefix: the deploy key rotation schedule for the billing cluster is " * 4
    arm(d, fake, "poison", forged_lease(d, prompt, first_token_id=d.tokens("Q")[0]))
    engine_id = httpx.get(f"{d.prefill}/health", timeout=10).json()["engine_id"]
    declines = metric(d.decode, DECLINE, '{reason="untrusted_peer"}')
    attack = ok(complete(d.decode, prompt, kv_transfer_params=remote_prefill_params(fake, "poison", engine_id)))
    assert attack["kvturn"]["reuse"] == "untrusted_peer" and attack["kvturn"]["prompt_tokens_remote"] == 0
    assert fake.requests() == []  # never contacted, so the secret was never shown to it
    assert metric(d.decode, DECLINE, '{reason="untrusted_peer"}') == declines + 1
    victim = prompt + "next Tuesday"
    clean = ok(complete(d.colocated, victim))["choices"][0]["text"]
    assert ok(complete(d.decode, victim))["choices"][0]["text"] == clean
    assert ok(complete(d.router, victim))["choices"][0]["text"] == clean


def test_a_forged_lease_is_believed_only_from_a_peer_the_cluster_trusts_which_is_what_makes_the_attack_real(
        deployment):
    """Control for the test above: from a peer given at start-up (--trusted-peer), the same forgery is read (so its
    payload is a real attack)."""
    d, fake = deployment, deployment.fakes["trusted"]
    prompt = "Another forged prefix: quarterly numbers for the northern region warehouse were " * 4
    forced = d.tokens("Q")[0]
    arm(d, fake, "forged", forged_lease(d, prompt, first_token_id=forced))
    result = ok(complete(d.decode, prompt, headers=d.secret, kv_transfer_params=remote_prefill_params(fake, "forged")))
    assert result["kvturn"]["reuse"] == "reused"
    assert result["kvturn"]["prompt_tokens_remote"] == result["usage"]["prompt_tokens"]
    assert result["choices"][0]["text"].startswith("Q")
    assert "/kv/lease/acquire" in [entry["path"] for entry in fake.requests()]
    victim = prompt + "next Tuesday"
    assert ok(complete(d.decode, victim))["choices"][0]["text"] != ok(complete(d.colocated, victim))["choices"][0]["text"]


def test_a_worker_without_a_secret_warns_that_it_trusts_any_caller(deployment):
    assert "trusts any caller" in (deployment.logs / "open-colocated.log").read_text()
    assert "trusts any caller" not in (deployment.logs / "decode0.log").read_text()


# ---- 1. a worker contacts only trusted peers

@pytest.mark.parametrize("caller", [{}, {SECRET_HEADER: "not-the-cluster-secret-at-all"}], ids=["none", "wrong"])
def test_decode_worker_never_contacts_a_peer_named_without_the_secret(deployment, caller):
    d, fake = deployment, deployment.fakes["untrusted"]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})
    fake.clear()
    before = metric(d.decode, DECLINE, '{reason="untrusted_peer"}')
    result = ok(complete(d.decode, "Decode for me, please: ", headers=caller,
                         kv_transfer_params=remote_prefill_params(fake, "handle-1")))
    assert result["kvturn"]["reuse"] == "untrusted_peer"
    assert fake.requests() == []
    assert metric(d.decode, DECLINE, '{reason="untrusted_peer"}') == before + 1


@pytest.mark.parametrize("caller", [{}, {SECRET_HEADER: "not-the-cluster-secret-at-all"}], ids=["none", "wrong"])
def test_prefill_worker_never_contacts_a_peer_named_without_the_secret(deployment, caller):
    d, fake = deployment, deployment.fakes["for_prefill"]
    fake.configure({"agent": {"upstream": d.decode, "secret": d.stack.cluster_secret}})
    fake.clear()
    before = metric(d.prefill, DECLINE, '{reason="untrusted_peer"}')
    result = ok(complete(d.prefill, "Read my history back from there: ", headers=caller, conversation_id="intruder",
                         kv_transfer_params=remote_decode_params(fake, "handle-2")))
    assert result["kvturn"]["reuse"] == "untrusted_peer"
    assert fake.requests() == []
    assert metric(d.prefill, DECLINE, '{reason="untrusted_peer"}') == before + 1


def test_a_caller_with_the_secret_cannot_make_a_worker_contact_an_address_no_member_signed(deployment):
    """What a store that relays records could do (rewrite a lease's host or port): the worker checks the record's
    MAC, which covers the holder's address, before any contact, and contacts nobody."""
    d, fake = deployment, deployment.fakes["untrusted"]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})
    fake.clear()
    engine_id = httpx.get(f"{d.prefill}/health", timeout=10).json()["engine_id"]
    genuine = signed(d, remote_prefill_params(fake, "h-moved", engine_id), PIN, "cmpl-h-moved")
    before = metric(d.decode, DECLINE, '{reason="unsigned_record"}')
    for params in ({**genuine, "remote_port": genuine["remote_port"] + 1}, {**genuine, "binding": "0" * 64},
                   remote_prefill_params(fake, "h-moved", engine_id)):
        result = ok(complete(d.decode, "Decode for me, please: ", headers=d.secret, kv_transfer_params=params))
        assert result["kvturn"]["reuse"] == "unsigned_record"
    assert fake.requests() == []
    assert metric(d.decode, DECLINE, '{reason="unsigned_record"}') == before + 3


def test_a_caller_with_the_secret_makes_the_worker_contact_the_peer_a_member_signed_and_show_the_secret(deployment):
    d, fake = deployment, deployment.fakes["untrusted"]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})  # no lease: 404
    fake.clear()
    engine_id = httpx.get(f"{d.prefill}/health", timeout=10).json()["engine_id"]
    params = signed(d, remote_prefill_params(fake, "no-such-lease", engine_id), PIN, "cmpl-no-such-lease")
    result = ok(complete(d.decode, "Decode for me, please: ", headers=d.secret, kv_transfer_params=params))
    assert result["kvturn"]["reuse"] == "lease_unknown"
    seen = fake.requests()
    assert [e["path"] for e in seen if e["path"] != "/kv/lease/release"][-1] == "/kv/lease/acquire"
    assert all(header(e, SECRET_HEADER) == d.stack.cluster_secret for e in seen)


def test_a_trusted_peer_from_the_command_line_is_contacted_for_any_caller(deployment):
    d, fake = deployment, deployment.fakes["trusted"]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})
    fake.clear()
    result = ok(complete(d.decode, "Decode for me, please: ",
                         kv_transfer_params=remote_prefill_params(fake, "no-such-lease")))
    assert result["kvturn"]["reuse"] == "lease_unknown"
    acquires = [e for e in fake.requests() if e["path"] == "/kv/lease/acquire"]
    assert len(acquires) == 1 and header(acquires[0], SECRET_HEADER) == d.stack.cluster_secret


def test_kv_transfer_params_sent_to_the_router_never_reach_a_worker(deployment):
    d, fake = deployment, deployment.fakes["untrusted"]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})
    fake.clear()
    for i, params in enumerate((remote_prefill_params(fake, "via-router"), remote_decode_params(fake, "via-router"))):
        result = ok(chat(d.router, opening(f"Route me {i}."), conversation_id=f"smuggler-{i}",
                         kv_transfer_params=params))
        assert result["kvturn"]["reuse"] is None
    assert fake.requests() == []


# ---- 2. a trusted peer's malformed replies: a named decline, a recompute, a 200

def lease_reply(**changes) -> dict:
    lease = {"block_ids": [1020, 1021], "block_hashes": [11, 12], "block_epochs": [0, 0],
             "expiry_time": time.time() + 300, "num_tokens": 20, "first_token_id": 5}
    return {"status": 200, "json": {**lease, **changes}}


MALFORMED_LEASES = {
    "not-json": ({"status": 200, "raw": "<html>surely not JSON</html>"}, "bad_peer_reply"),
    "a-json-list": ({"status": 200, "json": [1, 2, 3]}, "bad_peer_reply"),
    "missing-fields": ({"status": 200, "json": {"block_ids": [1020, 1021]}}, "bad_peer_reply"),
    "unequal-lengths": (lease_reply(block_hashes=[11, 12, 13]), "bad_peer_reply"),
    "blocks-outside-its-pool": (lease_reply(block_ids=[1020, 10**9]), "bad_peer_reply"),
    "negative-block-id": (lease_reply(block_ids=[-1, 1021]), "bad_peer_reply"),
    "boolean-block-id": (lease_reply(block_ids=[True, 1021]), "bad_peer_reply"),  # JSON true is not block 1
    "float-epoch": (lease_reply(block_epochs=[0.0, 0]), "bad_peer_reply"),
    "first-token-outside-vocab": (lease_reply(first_token_id=10**9), "bad_peer_reply"),
    "tokens-beyond-its-blocks": (lease_reply(num_tokens=10**6), "bad_peer_reply"),
    "server-error": ({"status": 500, "raw": "boom"}, "peer_unreachable"),
}
MALFORMED_PROMPT = "Recompute me when the peer talks nonsense: alpha beta gamma delta"


@pytest.fixture(scope="module")
def recomputed(deployment):
    return ok(complete(deployment.colocated, MALFORMED_PROMPT))["choices"][0]["text"]


@pytest.mark.parametrize("case", list(MALFORMED_LEASES))
def test_a_malformed_lease_reply_on_the_decode_path_is_declined_and_recomputed(deployment, recomputed, case):
    d, fake = deployment, deployment.fakes["trusted"]
    reply, reason = MALFORMED_LEASES[case]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}, "leases": {case: reply}})
    fake.clear()
    before = metric(d.decode, DECLINE, f'{{reason="{reason}"}}')
    result = ok(complete(d.decode, MALFORMED_PROMPT, headers=d.secret,
                         kv_transfer_params=remote_prefill_params(fake, case)))
    assert result["kvturn"]["reuse"] == reason and result["kvturn"]["prompt_tokens_remote"] == 0
    assert result["choices"][0]["text"] == recomputed
    assert "/kv/lease/acquire" in [e["path"] for e in fake.requests()]
    assert metric(d.decode, DECLINE, f'{{reason="{reason}"}}') == before + 1


@pytest.mark.parametrize("case", ["not-json", "unequal-lengths", "first-token-outside-vocab"])
def test_a_malformed_lease_reply_on_the_prefill_path_is_declined_and_recomputed(deployment, case):
    d, fake = deployment, deployment.fakes["for_prefill"]
    reply, reason = MALFORMED_LEASES[case]
    fake.configure({"agent": {"upstream": d.decode, "secret": d.stack.cluster_secret}, "leases": {case: reply}})
    fake.clear()
    engine_id = httpx.get(f"{d.decode}/health", timeout=10).json()["engine_id"]
    params = signed(d, {**remote_decode_params(fake, case), "remote_engine_id": engine_id}, LEASE, f"conv-{case}")
    result = ok(complete(d.prefill, MALFORMED_PROMPT, headers=d.secret, conversation_id=f"conv-{case}",
                         kv_transfer_params=params))
    assert result["kvturn"]["reuse"] == reason and result["kvturn"]["prompt_tokens_remote"] == 0
    assert "/kv/lease/acquire" in [e["path"] for e in fake.requests()]


def test_malformed_agent_info_from_a_trusted_peer_is_declined_and_recomputed(deployment, recomputed):
    d, fake = deployment, deployment.fakes["bad_agent"]
    # In this order: a worker remembers agent info that has an engine_id, so that case comes last.
    agents = [{"status": 200, "raw": "not json"},
              {"status": 200, "json": ["engine_id"]},
              {"status": 200, "json": {"layout": {}}},
              {"status": 200, "json": {"engine_id": "forged-engine", "agent_metadata": "%%%", "pool_address": "x",
                                       "epochs_address": 0, "layout": {"num_blocks": -5}}}]
    for agent in agents:
        fake.configure({"agent": agent, "leases": {"h": lease_reply()}})
        fake.clear()
        params = signed(d, remote_prefill_params(fake, "h", "forged-engine"), PIN, "cmpl-h")
        result = ok(complete(d.decode, MALFORMED_PROMPT, headers=d.secret, kv_transfer_params=params))
        assert result["kvturn"]["reuse"] in ("bad_peer_reply", "peer_unreachable", "lease_unknown"), agent
        assert result["choices"][0]["text"] == recomputed
        assert [e["path"] for e in fake.requests() if e["path"] != "/kv/lease/release"] == ["/kv/agent"], agent


# ---- 4. a LocalStack is closed by default

def test_stack_workers_refuse_the_side_channel_without_the_stacks_secret(deployment):
    d = deployment
    for url in (d.prefill, d.decode):
        assert_openai_error(httpx.get(f"{url}/kv/agent", timeout=10), 403)
        assert httpx.get(f"{url}/kv/agent", headers=d.secret, timeout=10).status_code == 200
    assert len(d.stack.cluster_secret) >= 16


def test_each_stack_makes_its_own_secret(tiny_model_dir):
    first, second = LocalStack(tiny_model_dir), LocalStack(tiny_model_dir)
    assert first.cluster_secret != second.cluster_secret
    assert first.env["KVTURN_CLUSTER_SECRET"] == first.cluster_secret and len(first.cluster_secret) >= 16


# ---- 5. conversation ids at the router

@pytest.mark.parametrize("bad", ["x" * 257, 7, ["a"], {"id": "a"}, ""], ids=["257-chars", "int", "list", "object",
                                                                           "empty"])
def test_a_conversation_id_that_is_not_a_string_of_1_to_256_chars_is_refused(deployment, bad):
    assert_openai_error(chat(deployment.router, opening("hi"), conversation_id=bad), 400)


@pytest.mark.parametrize("name", ["X-Conversation-Id", "X-Session-ID"])
def test_a_conversation_id_header_over_256_chars_is_refused(deployment, name):
    assert_openai_error(chat(deployment.router, opening("hi"), headers={name: "h" * 257}), 400)


@pytest.mark.parametrize("where", ["router", "keyed_router"])
def test_a_256_char_conversation_id_is_accepted(deployment, where):
    tenant = {"Authorization": f"Bearer {K1}"}
    response = chat(getattr(deployment, where), opening("A long name."), headers=tenant, conversation_id="n" * 256)
    assert ok(response)["kvturn"]["conversation_id"] == "n" * 256


def test_ids_equal_in_their_first_255_chars_are_separate_conversations(deployment):
    d = deployment
    first, second = "c" * 255 + "A", "c" * 255 + "B"
    messages = opening("First turn of a long-named conversation.")
    turn1 = ok(chat(d.router, messages, conversation_id=first))
    later = next_turn(messages, turn1["choices"][0]["message"]["content"], "And the second turn?")
    other = ok(chat(d.router, later, conversation_id=second))["kvturn"]
    assert other["reuse"] != "reused" and not other["prompt_tokens_from_decode"]
    own = ok(chat(d.router, later, conversation_id=first))["kvturn"]  # the control: the first id does reuse
    assert own["reuse"] == "reused" and own["prompt_tokens_from_decode"] > 0


def test_the_body_id_beats_x_conversation_id_which_beats_x_session_id(deployment):
    d = deployment
    both = {"X-Conversation-Id": "from-header", "X-Session-ID": "from-session"}
    named = lambda response: ok(response)["kvturn"]["conversation_id"]
    assert named(chat(d.router, opening("precedence"), headers=both, conversation_id="from-body")) == "from-body"
    assert named(chat(d.router, opening("precedence"), headers=both)) == "from-header"
    assert named(chat(d.router, opening("precedence"), headers={"X-Session-ID": "from-session"})) == "from-session"


def test_a_conversation_named_by_x_session_id_reuses_on_its_second_turn(deployment):
    d, session = deployment, {"X-Session-ID": "vllm-style-session"}
    messages = opening("A vLLM client names its session in a header.")
    turn1 = ok(chat(d.router, messages, headers=session))
    assert turn1["kvturn"]["reuse"] is None
    later = next_turn(messages, turn1["choices"][0]["message"]["content"], "Next step?")
    turn2 = ok(chat(d.router, later, headers=session))["kvturn"]
    assert turn2["reuse"] == "reused" and turn2["prompt_tokens_from_decode"] > 0


def two_turns(router: str, header: dict, text: str, second_header: dict | None = None) -> tuple[dict, dict]:
    """A conversation's two turns named by `header` (the second by `second_header`, if given): their kvturn objects."""
    messages = opening(text)
    turn1 = ok(chat(router, messages, headers=header))
    later = next_turn(messages, turn1["choices"][0]["message"]["content"], "And then?")
    return turn1["kvturn"], ok(chat(router, later, headers=second_header or header))["kvturn"]


@pytest.mark.parametrize("name", SESSION_HEADERS[2:])
def test_a_conversation_named_by_any_routers_session_header_reuses_on_its_second_turn(deployment, name):
    turn1, turn2 = two_turns(deployment.router, {name: f"{name}-session"}, f"A client that sends only {name}.")
    assert turn1["conversation_id"] == turn2["conversation_id"] == f"{name}-session"
    assert turn2["reuse"] == "reused" and turn2["prompt_tokens_from_decode"] > 0


def test_session_headers_are_taken_in_the_documented_order(deployment):
    headers = {name: f"from-{name}" for name in SESSION_HEADERS}
    for name in SESSION_HEADERS:
        named = ok(chat(deployment.router, opening("order"), headers=headers))["kvturn"]["conversation_id"]
        assert named == f"from-{name}"
        del headers[name]


def test_a_routers_own_session_headers_replace_the_default_list(deployment):
    bounded = deployment.bounded_router
    ours = {"X-Agent-Session": "agent-named", "X-Session-ID": "vllm-named"}
    assert ok(chat(bounded, opening("own list"), headers=ours))["kvturn"]["conversation_id"] == "agent-named"
    unknown = ok(chat(bounded, opening("own list"), headers={"X-Conversation-Id": "not-read-here"}))["kvturn"]
    assert unknown["conversation_id"].startswith("derived-")


def test_a_session_header_names_a_conversation_in_its_tenants_namespace_only(deployment):
    keyed, one, two = deployment.keyed_router, {"Authorization": f"Bearer {K1}"}, {"Authorization": f"Bearer {K2}"}
    session = {"X-Dynamo-Session-ID": "shared-name"}
    _, other = two_turns(keyed, one | session, "One tenant's session.", second_header=two | session)
    assert other["reuse"] != "reused" and not other["prompt_tokens_from_decode"]
    _, own = two_turns(keyed, one | session, "One tenant's session.")  # the control: the owner reuses
    assert own["reuse"] == "reused"


def test_dynamos_session_final_header_releases_the_lease_once_answered(deployment):
    d = deployment
    released = lambda: metric(d.decode, "kvturn_kv_leases_total", '{event="released"}')
    session = {"X-Dynamo-Session-ID": "dynamo-final"}
    messages = opening("A Dynamo client's session.")
    turn1 = ok(chat(d.router, messages, headers=session))
    before = released()
    last = next_turn(messages, turn1["choices"][0]["message"]["content"], "Last step.")
    final = ok(chat(d.router, last, headers=session | {"X-Dynamo-Session-Final": "true"}))
    assert final["kvturn"]["reuse"] == "reused"
    deadline = time.monotonic() + 30  # the release follows the answer, in the router's background
    while released() == before:
        assert time.monotonic() < deadline, "the session's lease was not released"
        time.sleep(0.1)
    again = next_turn(last, final["choices"][0]["message"]["content"], "One more?")
    assert ok(chat(d.router, again, headers=session))["kvturn"]["reuse"] is None  # nothing left to read


# ---- 6. a huge history without an id does not stall the router

TURN_GUARD_S, HEALTH_GUARD_S = 60, 5

def test_ten_thousand_messages_are_answered_fast_and_health_stays_responsive(deployment):
    """Hang guards, not timings: the turn is answered within TURN_GUARD_S and /health, asked meanwhile, each time
    within HEALTH_GUARD_S; a router that stalls on the history misses them, a busy machine does not."""
    d = deployment
    messages = [{"role": "user", "content": "a"}] * 10_000
    outcome = {}

    def send():
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        try:
            outcome["response"] = httpx.post(f"{d.router}/v1/chat/completions", json=body, timeout=TURN_GUARD_S)
        except httpx.TimeoutException as exc:
            outcome["response"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    while True:
        assert httpx.get(f"{d.router}/health", timeout=HEALTH_GUARD_S).status_code == 200
        if not sender.is_alive():
            break
        time.sleep(0.05)
    sender.join()
    response = outcome["response"]
    assert isinstance(response, httpx.Response), f"no answer within {TURN_GUARD_S} s: {response!r}"
    if response.status_code != 200:
        assert "maximum context length" in assert_openai_error(response, 400)["message"]


# ---- 7. API keys at the router

def test_a_missing_or_wrong_api_key_gets_an_openai_shaped_401(deployment):
    d = deployment
    for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": f"Basic {K1}"}):
        assert_openai_error(chat(d.keyed_router, opening("hi"), headers=headers), 401)
        assert_openai_error(complete(d.keyed_router, "hi", headers=headers), 401)
        assert_openai_error(httpx.get(f"{d.keyed_router}/v1/models", headers=headers, timeout=10), 401)
    client = openai.OpenAI(base_url=f"{d.keyed_router}/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=d.model, messages=opening("hi"), max_tokens=2)
    assert ok(chat(d.keyed_router, opening("hi"), headers={"Authorization": f"Bearer {K2}"}))["choices"]


def test_tenants_with_the_same_conversation_id_do_not_share_kv(deployment):
    d = deployment
    tenant1, tenant2 = {"Authorization": f"Bearer {K1}"}, {"Authorization": f"Bearer {K2}"}
    messages = opening("Tenant one's private history.")
    turn1 = ok(chat(d.keyed_router, messages, headers=tenant1, conversation_id="shared"))
    later = next_turn(messages, turn1["choices"][0]["message"]["content"], "Continue.")
    stranger = ok(chat(d.keyed_router, later, headers=tenant2, conversation_id="shared"))["kvturn"]
    assert stranger["reuse"] != "reused" and not stranger["prompt_tokens_from_decode"]
    owner = ok(chat(d.keyed_router, later, headers=tenant1, conversation_id="shared"))["kvturn"]  # the control
    assert owner["reuse"] == "reused" and owner["prompt_tokens_from_decode"] > 0


# ---- 8. the router's conversation table

def test_the_router_drops_a_conversation_whose_lease_prefill_reports_unknown(deployment):
    d, cid = deployment, "lease-goes-away"
    messages = opening("A lease that the decode worker lets go.")
    turn1 = ok(chat(d.router, messages, conversation_id=cid, return_kv_transfer_params=True))
    lease = turn1["kv_transfer_params"]
    released = httpx.post(f"{d.decode}/kv/lease/release", headers=d.secret, timeout=10,
                          json={"handle": lease["handle"], "binding_key": scoped(scope_of(None), cid)}).json()
    assert released == {"released": True}
    messages = next_turn(messages, turn1["choices"][0]["message"]["content"], "Still there?")
    refused_by_decode = chat(d.router, messages, max_tokens=10**6, conversation_id=cid)  # P runs, D refuses
    assert_openai_error(refused_by_decode, 400)
    turn3 = ok(chat(d.router, messages, conversation_id=cid))["kvturn"]
    assert turn3["reuse"] is None  # a kept entry would have sent P the dead lease again: "lease_unknown"


def test_max_conversations_bounds_the_table_dropping_the_oldest_first(deployment):
    d = deployment
    firsts = []
    for i in range(MAX_CONVERSATIONS + 5):
        messages = opening(f"Bounded conversation number {i}.")
        answer = ok(chat(d.bounded_router, messages, conversation_id=f"bounded-{i}"))["choices"][0]["message"]
        firsts.append(next_turn(messages, answer["content"], "Go on."))
        assert metric(d.bounded_router, "kvturn_router_conversations") <= MAX_CONVERSATIONS
    assert metric(d.bounded_router, "kvturn_router_history_digests") <= MAX_CONVERSATIONS
    newest = ok(chat(d.bounded_router, firsts[-1], conversation_id=f"bounded-{len(firsts) - 1}"))["kvturn"]
    assert newest["reuse"] == "reused"
    oldest = ok(chat(d.bounded_router, firsts[0], conversation_id="bounded-0"))["kvturn"]
    assert oldest["reuse"] is None


# ---- 9. logprobs as vLLM's OpenAI server serves them

def check_chat_logprobs(content: list, num_tokens: int, top: int) -> None:
    assert len(content) == num_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == top
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)  # greedy


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_chat_logprobs_with_the_openai_client(deployment, where):
    d = deployment
    client = openai.OpenAI(base_url=f"{getattr(d, where)}/v1", api_key="unused", max_retries=0)
    result = client.chat.completions.create(model=d.model, messages=opening("Log my probabilities."), max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 5
    check_chat_logprobs(result.choices[0].logprobs.content, 5, 3)


def test_chat_logprobs_agree_between_pd_and_colocated(deployment):
    d = deployment
    answers = [ok(chat(url, opening("Same tokens both ways."), max_tokens=5, logprobs=True, top_logprobs=2))
               for url in (d.router, d.colocated)]
    pd, colocated = ([(e["token"], e["logprob"]) for e in a["choices"][0]["logprobs"]["content"]] for a in answers)
    assert [t for t, _ in pd] == [t for t, _ in colocated]
    assert [lp for _, lp in pd] == pytest.approx([lp for _, lp in colocated], abs=1e-3)


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_completion_logprobs_are_parallel_lists(deployment, where):
    result = ok(complete(getattr(deployment, where), "Parallel lists of", max_tokens=5, logprobs=2))
    logprobs = result["choices"][0]["logprobs"]
    lists = [logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")]
    assert [len(x) for x in lists] == [5] * 4
    for token, logprob, top in zip(*lists[:3]):
        assert isinstance(token, str) and logprob <= 0 and 1 <= len(top) <= 2
        assert token in top, top  # keyed by token text, as vLLM does; greedy, so the sampled token is the top one
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)
    offsets = logprobs["text_offset"]
    assert offsets == [offsets[0] + sum(len(t) for t in logprobs["tokens"][:i]) for i in range(5)]


def test_streamed_chunks_carry_the_logprobs_of_their_tokens(deployment):
    d = deployment
    client = openai.OpenAI(base_url=f"{d.router}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=d.model, messages=opening("Stream my probabilities."),
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    content, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                content += choice.logprobs.content
            elif choice.delta.content:
                pytest.fail(f"a chunk with text {choice.delta.content!r} has no logprobs")
    assert usage.completion_tokens == 6
    check_chat_logprobs(content, 6, 3)
    completion = []
    with httpx.stream("POST", f"{d.router}/v1/completions", timeout=120, json={
            "prompt": "Streamed completion", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1,
            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    if choice.get("logprobs"):
                        completion += choice["logprobs"]["token_logprobs"]
    assert len(completion) == 4


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_echo_is_refused_with_a_400_that_says_so(deployment, where):
    client = openai.OpenAI(base_url=f"{getattr(deployment, where)}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=deployment.model, prompt="Echo me", max_tokens=2, echo=True, logprobs=1)
    assert refused.value.status_code == 400 and "echo is not supported" in str(refused.value)


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_top_logprobs_without_logprobs_is_refused(deployment, where):
    response = chat(getattr(deployment, where), opening("hi"), top_logprobs=2)
    assert "logprobs" in assert_openai_error(response, 400)["message"]


# ---- 9. what this round added to what workers accept: a relayed lease record, and the connect-back header

def relayed_pin(deployment: Deployment, fake: FakePeer, handle: str, prompt: str, first_token_id: int) -> dict:
    """P's pin as the router relays it: the whole record, here with a binding no cluster member made."""
    lease = forged_lease(deployment, prompt, first_token_id)
    return {**remote_prefill_params(fake, handle), "remote_block_ids": lease["block_ids"],
            "remote_block_hashes": lease["block_hashes"], "remote_block_epochs": lease["block_epochs"],
            "remote_num_tokens": lease["num_tokens"], "remote_blocks_expiry_time": lease["expiry_time"],
            "first_token_id": first_token_id, "binding": "0" * 64}


def test_a_relayed_first_token_is_taken_only_from_a_caller_of_the_cluster(deployment):
    """A decode worker continues from a relayed first token (the router may have sent it to the client) even
    when it cannot read P's blocks, but only for a caller with the secret: anyone else would pick the answer."""
    d, fake = deployment, deployment.fakes["untrusted"]
    fake.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})  # no lease: 404
    prompt = "Pick my first word for me, worker: the ledger of the western depot shows "
    forced = d.tokens("Q")[0]
    clean = ok(complete(d.colocated, prompt))["choices"][0]["text"]
    assert not clean.startswith("Q")
    fake.clear()
    outsider = ok(complete(d.decode, prompt, kv_transfer_params=relayed_pin(d, fake, "pin-a", prompt, forced)))
    assert outsider["kvturn"]["reuse"] == "untrusted_peer" and outsider["choices"][0]["text"] == clean
    assert fake.requests() == []
    # A peer given with --trusted-peer is contacted for any caller, but its relayed token is not taken from one.
    trusted = d.fakes["trusted"]
    trusted.configure({"agent": {"upstream": d.prefill, "secret": d.stack.cluster_secret}})
    via_trusted = ok(complete(d.decode, prompt, kv_transfer_params=relayed_pin(d, trusted, "pin-t", prompt, forced)))
    assert via_trusted["kvturn"]["reuse"] == "lease_unknown" and via_trusted["choices"][0]["text"] == clean
    # With the secret but a record no member signed (a relay rewrote it): neither the token nor the peer it names.
    unsigned = ok(complete(d.decode, prompt, headers=d.secret,
                           kv_transfer_params=relayed_pin(d, fake, "pin-b", prompt, forced)))
    assert unsigned["kvturn"]["reuse"] == "unsigned_record" and unsigned["choices"][0]["text"] == clean
    assert fake.requests() == []
    # The control: a record its holder signed, relayed with the secret: the token is taken though the holder knows
    # no such lease (the router may have sent the token to the client already).
    engine_id = httpx.get(f"{d.prefill}/health", timeout=10).json()["engine_id"]
    pin = signed(d, {**relayed_pin(d, fake, "pin-c", prompt, forced), "remote_engine_id": engine_id}, PIN, "cmpl-pin-c")
    member = ok(complete(d.decode, prompt, headers=d.secret, kv_transfer_params=pin))
    assert member["kvturn"]["reuse"] == "lease_unknown" and member["kvturn"]["prompt_tokens_remote"] == 0
    assert member["choices"][0]["text"].startswith("Q")
    assert "/kv/lease/acquire" in [e["path"] for e in fake.requests()]


def test_the_connect_back_header_makes_a_worker_call_only_a_caller_that_proved_the_secret(deployment):
    d, fake = deployment, deployment.fakes["untrusted"]
    fake.configure({"agent": {"upstream": d.decode, "secret": d.stack.cluster_secret}})
    fake.clear()
    intro = {"X-Kvturn-Peer": fake.address}
    assert httpx.get(f"{d.prefill}/kv/agent", headers=intro, timeout=10).status_code == 403
    wrong = {**intro, SECRET_HEADER: "not-the-cluster-secret-at-all"}
    assert httpx.get(f"{d.prefill}/kv/agent", headers=wrong, timeout=10).status_code == 403
    for odd in ("127.0.0.1", "127.0.0.1:0", "user@127.0.0.1:80", "h/x:80", "x" * 300 + ":80"):
        assert httpx.get(f"{d.prefill}/kv/agent", headers={**d.secret, "X-Kvturn-Peer": odd},
                         timeout=10).status_code == 200  # answered, and the address ignored
    time.sleep(1.0)
    assert fake.requests() == []
    assert httpx.get(f"{d.prefill}/kv/agent", headers={**intro, **d.secret}, timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while "/kv/agent" not in [e["path"] for e in fake.requests()] and time.monotonic() < deadline:
        time.sleep(0.1)
    calls = fake.requests()
    assert [e["path"] for e in calls] == ["/kv/agent"]
    assert header(calls[0], SECRET_HEADER) == d.stack.cluster_secret


@pytest.mark.parametrize("caller", [{}, {SECRET_HEADER: "not-the-cluster-secret-at-all"}], ids=["none", "wrong"])
def test_a_workers_step_history_is_shown_only_to_a_caller_of_the_cluster(deployment, caller):
    """When other clients' requests ran and how long they were is the cluster's to read, not a client's."""
    reply = httpx.get(f"{deployment.prefill}/kv/steps", headers=caller, timeout=10)
    assert reply.status_code == 403 and reply.json()["error"]["code"] == 403


def test_the_step_history_lists_what_each_step_of_a_request_computed_since_the_time_asked(deployment):
    """On the open worker (no secret: it trusts any caller, as for everything else): one prompt step from scratch,
    then one decode step per token after the first, each on one token more of KV."""
    since = time.time()
    prompt = f"{since} Count the steps, please: " + "step " * 300  # a prefix its cache has not seen
    prompt_tokens = ok(complete(deployment.colocated, prompt, max_tokens=3))["usage"]["prompt_tokens"]
    reply = httpx.get(f"{deployment.colocated}/kv/steps", params={"since": since}, timeout=10).json()
    assert reply["role"] == "both" and reply["dropped"] is False
    steps = reply["steps"]
    assert [step["prompts"] for step in steps] == [[[prompt_tokens, 0]], [], []]
    assert [(s["decodes"], s["decode_context"], s["decode_longest"]) for s in steps] == \
        [(0, 0, 0), (1, prompt_tokens, prompt_tokens), (1, prompt_tokens + 1, prompt_tokens + 1)]
    assert all(since <= step["start_s"] <= time.time() and step["ms"] > 0 and step["cpu_ms"] > 0 for step in steps)
    later = httpx.get(f"{deployment.colocated}/kv/steps", params={"since": time.time()}, timeout=10).json()
    assert later["steps"] == []


@pytest.mark.parametrize("since", ["nan", "inf", "yesterday", ""])
def test_a_step_history_asked_since_no_finite_time_is_a_400(deployment, since):
    reply = httpx.get(f"{deployment.prefill}/kv/steps", params={"since": since}, headers=deployment.secret,
                      timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "since"
