"""The field's outside benchmark clients, unchanged, against `kvturn serve`: NVIDIA's AIPerf and ABench
(agentic-bench), each in multi-turn mode, with bidirectional transfer on and off (P's prefix cache off, so that only
the history read back from D can spare P's compute).

Opt-in: `make test-clients` sets up the clients' own venv (scripts/clients_env.sh) and runs this file with
KVTURN_CLIENTS_VENV set; `make test` skips it. Each client is pointed at the embedded model's tokenizer folder (there
is no model hub here) and names each session in its own header (AIPerf `X-Correlation-ID`, ABench
`X-SMG-Routing-Key`). What is checked is what each client reports itself: no errors, and the usage the server
returned per turn (`usage.prompt_tokens_details.cached_tokens`): every later turn cached with transfer on, nothing
with it off (P computed every prompt).
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from chat import metric
from kvturn import launch

pytestmark = pytest.mark.skipif(not os.environ.get("KVTURN_CLIENTS_VENV"),
                                reason="outside clients: run `make test-clients`")
SESSIONS, TURNS, CONCURRENCY = 4, 4, 2
SYSTEM_TOKENS, NEW_TOKENS, ANSWER_TOKENS = 1000, 200, 16
CLIENT_GUARD_S = 600  # a hang guard: each run takes under a minute on 2 cores


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """`kvturn serve` with bidirectional transfer on and off, started together."""
    logs = tmp_path_factory.mktemp("serve")
    started = {}
    try:
        for mode in ("on", "off"):
            port = launch.free_port()
            args = ["serve", "--port", str(port), "--no-prefix-caching-on-prefill", "--no-calibrate",
                    "--log-dir", str(logs / mode), "--bidirectional" if mode == "on" else "--no-bidirectional"]
            started[mode] = (f"http://127.0.0.1:{port}", launch.start(args, logs / f"serve-{mode}.log"))
        for url, process in started.values():
            launch.wait_healthy(url, process, timeout_s=300)
        yield {mode: url for mode, (url, _) in started.items()}
    finally:
        for _, process in started.values():
            launch.stop(process, timeout_s=60)


@pytest.fixture(scope="module")
def client_env(tiny_model_dir):
    """The clients' venv on PATH, and no HF_HUB_OFFLINE: AIPerf then looks a local tokenizer folder up in the hub
    cache and fails."""
    venv = Path(os.environ["KVTURN_CLIENTS_VENV"]).resolve()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    return {"bin": venv / "bin", "env": env, "tokenizer": str(tiny_model_dir), "model": tiny_model_dir.name}


def run(command: list[str], env: dict, cwd: Path) -> None:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_GUARD_S)
    (cwd / "client.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{command[0]} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"


def check_cached(turns: list[tuple[int, int]], mode: str) -> None:
    """(turn index, cached tokens) of every request: with transfer on every later turn read its history back from
    D; with it off (P's cache off too) none did."""
    assert len(turns) == SESSIONS * TURNS
    later = [cached for index, cached in turns if index > 0]
    assert all(cached == 0 for index, cached in turns if index == 0)
    if mode == "on":
        assert all(cached > SYSTEM_TOKENS for cached in later), later
    else:
        assert all(cached == 0 for cached in later), later


def reused_turns(url: str) -> float:
    try:
        return metric(url, "kvturn_router_prefill_reuse_total", '{outcome="reused"}')
    except KeyError:
        return 0.0


@pytest.mark.parametrize("mode", ["on", "off"])
def test_aiperf_multi_turn_runs_without_errors_and_later_turns_reuse(servers, client_env, tmp_path, mode):
    url, reused_before = servers[mode], reused_turns(servers[mode])
    run([str(client_env["bin"] / "aiperf"), "profile", "--model", client_env["model"], "--url", url,
         "--endpoint-type", "chat", "--streaming", "--tokenizer", client_env["tokenizer"],
         "--conversation-num", str(SESSIONS), "--conversation-turn-mean", str(TURNS), "--conversation-turn-stddev", "0",
         "--shared-system-prompt-length", str(SYSTEM_TOKENS), "--isl", str(NEW_TOKENS), "--isl-stddev", "0",
         "--osl", str(ANSWER_TOKENS), "--osl-stddev", "0", "--concurrency", str(CONCURRENCY),
         "--request-count", str(SESSIONS * TURNS), "--artifact-dir", str(tmp_path / "out"), "--export-level",
         "records", "--ui-type", "simple"], client_env["env"], tmp_path)
    summary = json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["request_count"]["avg"] == SESSIONS * TURNS
    records = [json.loads(line) for line in (tmp_path / "out" / "profile_export.jsonl").read_text().splitlines()]
    assert all(not record.get("error") for record in records)
    check_cached([(r["metadata"]["turn_index"], r["metrics"]["usage_prompt_cache_read_tokens"]["value"])
                  for r in records], mode)
    reused = reused_turns(url) - reused_before
    assert reused == (SESSIONS * (TURNS - 1) if mode == "on" else 0)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_abench_multi_turn_runs_without_errors_and_later_turns_reuse(servers, client_env, tmp_path, mode):
    url, reused_before = servers[mode], reused_turns(servers[mode])
    run([str(client_env["bin"] / "abench"), "run", "--base-url", url, "--model", client_env["model"],
         "--tokenizer", client_env["tokenizer"], "--dataset-name", "random", "--turns", str(TURNS),
         "--input-increment", str(NEW_TOKENS), "--output-len", str(ANSWER_TOKENS), "--system-prompt-len",
         str(SYSTEM_TOKENS), "--num-sessions", str(SESSIONS), "--max-concurrency", str(CONCURRENCY),
         "--gap-policy", "zero", "--routing-key", "--warmup-requests", "0", "--disable-tqdm",
         "--output-file", str(tmp_path / "abench.jsonl")], client_env["env"], tmp_path)
    result = json.loads((tmp_path / "abench.jsonl").read_text().splitlines()[-1])
    assert result["metrics"]["completed_sessions"] == SESSIONS and result["metrics"]["completion_rate"] == 1.0
    turns = [turn for session in result["sessions"] for turn in session["turns"]]
    assert all(turn["success"] and not turn["error"] for turn in turns)
    check_cached([(turn["turn_index"], turn["server_cached_tokens"]) for turn in turns], mode)
    reused = reused_turns(url) - reused_before
    assert reused == (SESSIONS * (TURNS - 1) if mode == "on" else 0)
