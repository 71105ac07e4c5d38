"""Workload generation and parsing for the multi-turn benchmark."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvturn.bench import workload
from kvturn.bench.client import RequestRecord, RunResult, SessionRecord, sse_chunk
from kvturn.bench.catalog import SCENARIOS
from kvturn.bench.distributions import Distribution
from kvturn.bench.report import summarize
from kvturn.config import ConnectorConfig
from kvturn.model.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ChatTokenizer(tiny_model_dir)


@pytest.mark.parametrize("spec", [
    {"distribution": "constant", "value": 7},
    {"distribution": "uniform", "min": 2, "max": 9},
    {"distribution": "lognormal", "average": 100, "median_ratio": 0.8, "max": 300},
    {"distribution": "lognormal", "mean": 3.0, "sigma": 0.5},
    {"distribution": "zipf", "alpha": 1.5, "max": 40},
    {"distribution": "poisson", "alpha": 10, "max": 30},
])
def test_distributions_are_seeded_and_bounded(spec):
    draw = lambda: [Distribution(spec).sample_int(np.random.default_rng(3), 1) for _ in range(50)]  # noqa: E731
    values = draw()
    assert values == draw()
    assert min(values) >= 1 and max(values) <= spec.get("max", spec.get("value", 10**9))


def test_lognormal_average_is_roughly_the_requested_mean():
    rng = np.random.default_rng(0)
    dist = Distribution({"distribution": "lognormal", "average": 200, "median_ratio": 0.7})
    assert 170 < np.mean([dist.sample(rng) for _ in range(20000)]) < 230


@pytest.mark.parametrize("spec", [{"distribution": "gauss"}, {"distribution": "uniform", "min": 5},
                                  {"distribution": "zipf", "alpha": 0.5}, "ten"])
def test_bad_distributions_are_refused_with_a_clear_error(spec):
    with pytest.raises(ValueError):
        Distribution(spec, "num_tokens")


def test_synthetic_sessions_have_the_requested_shape(tokenizer):
    source = workload.TextSource(tokenizer)
    spec = workload.SyntheticSpec(num_sessions=3, system_tokens=400, num_turns=4, new_tokens=50, answer_tokens=8)
    conversations = workload.synthetic(spec, source, seed=1)
    assert len(conversations) == 3 and all(len(c.turns) == 4 for c in conversations)
    assert all(abs(len(tokenizer.encode(c.system)) - 400) < 40 for c in conversations)
    assert [c.system for c in conversations] == [c.system for c in workload.synthetic(spec, source, seed=1)]


def test_vllm_conversation_list_is_replayed_turn_by_turn(tokenizer, tmp_path):
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps([{"id": "a", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there friend"}, {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done"}]}]))
    [conv] = workload.load_file(path, tokenizer, seed=0)
    assert conv.conversation_id == "a" and conv.system == "be brief"
    assert [t.user for t in conv.turns] == ["hi", "and?"]
    assert conv.turns[0].answer_tokens == len(tokenizer.encode("hello there friend"))


def test_vllm_generate_conversations_config(tokenizer, tmp_path):
    path = tmp_path / "generate.json"
    path.write_text(json.dumps({
        "filetype": "generate_conversations", "num_conversations": 4, "text_files": ["missing.txt"],
        "prompt_input": {"num_turns": {"distribution": "uniform", "min": 4, "max": 6},
                         "common_prefix_num_tokens": {"distribution": "constant", "value": 100},
                         "prefix_num_tokens": {"distribution": "lognormal", "average": 200, "max": 400},
                         "num_tokens": {"distribution": "uniform", "min": 20, "max": 40}},
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 5, "max": 10}}}))
    conversations = workload.load_file(path, tokenizer, seed=0)
    assert len(conversations) == 4
    assert all(2 <= len(c.turns) <= 3 for c in conversations)  # num_turns counts user + assistant messages
    assert all(5 <= t.answer_tokens <= 10 for c in conversations for t in c.turns)
    common = conversations[0].system[:200]
    assert all(c.system.startswith(common) for c in conversations)


def test_unknown_workload_file_is_refused(tokenizer, tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"filetype": "something"}))
    with pytest.raises(ValueError):
        workload.load_file(path, tokenizer, seed=0)


def test_summary_leaves_out_warmup_and_counts_failures():
    result = RunResult(runtime_s=2.0)
    for i in range(6):
        result.requests.append(RequestRecord("c", 0, i, 2 * i + 1, 0.0, warmup=i == 0, ttft_ms=10.0 * (i + 1),
                                             latency_ms=50.0, reuse="reused" if i > 2 else None,
                                             error="HTTP 500" if i == 5 else None))
    result.sessions.append(SessionRecord("c", 0, 0.0, duration_s=1.5, turns_completed=5))
    summary = summarize("leg", result)
    assert summary["requests"] == 5 and summary["failed"] == 1
    assert summary["ttft_ms"]["p50"] == 35.0  # turns 1..4: 20, 30, 40, 50 ms
    assert summary["reuse_outcomes"] == {"none": 2, "reused": 2}


def test_the_report_leads_with_a_verdict_and_shows_the_time_outside_compute_and_transfer(tmp_path):
    from kvturn.bench.report import ttft_split, write_html

    def run(ttft_ms: float, compute_ms: float, retained: float) -> RunResult:
        result = RunResult(runtime_s=1.0, retained_kv=[(0.0, retained)])
        result.requests.append(RequestRecord("c", 0, 0, 1, 0.0, warmup=False, ttft_ms=ttft_ms, latency_ms=ttft_ms,
                                             prefill_compute_ms=compute_ms, path="pull"))
        return result
    results = {"pd/P-cache-off": run(400.0, 380.0, 0.0), "bidir/P-cache-off": run(100.0, 70.0, 8 * 2**20)}
    page = write_html(tmp_path / "report.html", "t", [summarize(leg, r) for leg, r in results.items()], {},
                      {"machine": {"cores": 2}}, splits={leg: ttft_split(r) for leg, r in results.items()}).read_text()
    verdict = page.index("bidirectional transfer cut TTFT: TTFT p50 from 400 to 100 ms (0.25x), holding up to 8.0 MiB")
    assert verdict < page.index("<table>")
    assert "30 ms of its 100 ms TTFT p50 is outside compute and transfer" in page
    assert "<th>other: router, side channel, queues</th>" in page  # its own column of where TTFT goes
    assert "<pre>" not in page and "<td>cores</td><td>2</td>" in page


def test_the_verdict_calls_a_leg_slower_when_its_sessions_got_slower_whatever_ttft_did():
    """The run that started this: P's first token went out ahead of a stalled decode worker's stream."""
    from kvturn.bench.report import verdict

    def run(ttft_ms: float, tpot_ms: float, session_s: float) -> RunResult:
        result = RunResult(runtime_s=1.0, retained_kv=[(0.0, 0.0)])
        result.requests.append(RequestRecord("c", 0, 0, 1, 0.0, warmup=False, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                                             latency_ms=ttft_ms + 40 * tpot_ms))
        result.sessions.append(SessionRecord("c", 0, 0.0, duration_s=session_s, turns_completed=1))
        return result
    words = verdict([summarize("pd/P-cache-on", run(8075.0, 14.2, 65.5)),
                     summarize("bidir/P-cache-on", run(2409.0, 278.0, 114.3))])
    assert ("With prefix caching on on prefill, bidirectional transfer made sessions slower though it cut TTFT: "
            "session p50 from 65.5 to 114.3 s (1.75x), TPOT p50 from 14.2 to 278.0 ms (19.58x), "
            "TTFT p50 from 8075 to 2409 ms (0.30x)") in words
    assert "made sessions faster: session p50 from 114.3 to 65.5 s" in verdict(
        [summarize("pd/P-cache-on", run(2409.0, 278.0, 114.3)), summarize("bidir/P-cache-on", run(8075.0, 14.2, 65.5))])


def test_the_split_of_ttft_adds_up_to_the_ttft_when_ps_first_token_went_ahead():
    """D's read and compute come after the client's first token then: they are not parts of the TTFT."""
    from kvturn.bench.report import ttft_split
    result = RunResult(runtime_s=1.0)
    result.requests.append(RequestRecord("c", 0, 0, 1, 0.0, warmup=False, ttft_ms=100.0, latency_ms=150.0,
                                         prefill_compute_ms=60.0, p_to_d_read_ms=30.0, decode_compute_ms=20.0,
                                         first_token_from="prefill"))
    split = ttft_split(result)
    assert split["p_to_d_read_ms"] == split["decode_compute_ms"] == 0.0
    assert sum(split.values()) == 100.0 and split["other_ms"] == 40.0


def test_the_ideal_speedup_is_taken_at_each_conversations_longest_prompt():
    """One row per prompt length of a sweep: the OFF leg's longest turn of each conversation beside the same turn of
    the ON leg, shortest first, and the ratio of measured to ideal speedup from their parts."""
    from kvturn.bench.compare import ideal_row, longest_turns
    off, on = RunResult(runtime_s=1.0), RunResult(runtime_s=1.0)
    for conv, tokens in (("long", 8000), ("short", 1000)):
        for turn in range(2):
            off.requests.append(RequestRecord(conv, 0, turn, 1, 0.0, warmup=False, ttft_ms=tokens / 10 + turn,
                                              input_num_tokens=tokens + 200 * turn, prefill_compute_ms=tokens / 10))
            on.requests.append(RequestRecord(conv, 0, turn, 1, 0.0, warmup=False, ttft_ms=50.0, tpot_ms=9.0,
                                             input_num_tokens=tokens + 200 * turn, prefill_compute_ms=30.0,
                                             d_to_p_read_ms=12.0, bytes_d_to_p=tokens * 4096))
    pairs = longest_turns(off, on)
    assert [(r.conversation_id, r.turn, row["bytes_d_to_p"]) for r, row in pairs] == [
        ("short", 1, 1000 * 4096), ("long", 1, 8000 * 4096)]
    row = ideal_row(*pairs[1], raw_read_ms=10.0, layers=4)
    assert row["ideal_speedup"] == 800 / 40 and row["measured_speedup"] == 801 / 50
    assert row["overlapped_ideal_speedup"] == 800 / (30 + 10 / 4)  # the read beside the suffix, a layer's share left
    assert row["fraction_of_ideal"] == (801 / 50) / 20 and row["other_ms"] == 8.0 and row["tpot_on_ms"] == 9.0


def test_sse_chunk_reads_data_lines_and_raises_error_chunks():
    assert sse_chunk('data: {"choices": [{"delta": {"content": "hi"}}]}') == {"choices": [{"delta": {"content": "hi"}}]}
    for other in ("", ": keep-alive", "data: [DONE]", "event: ping"):
        assert sse_chunk(other) is None
    with pytest.raises(RuntimeError, match="pool is full"):
        sse_chunk('data: {"error": {"message": "pool is full", "type": "server_error"}}')
    with pytest.raises(RuntimeError, match="plain words"):
        sse_chunk('data: {"error": "plain words"}')
    for junk in ("data: 5", 'data: "error"', "data: [1, 2]"):
        with pytest.raises(RuntimeError, match="not a JSON object"):
            sse_chunk(junk)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_starts_workers_whose_settings_are_accepted(name):
    """A scenario's extra worker settings pass the workers' own start-up checks: resume-after-ttl's 4 s lease was
    refused beside the default 5 s expiry margin, and `kvturn bench --compare --scenario resume-after-ttl` died."""
    scenario = SCENARIOS[name]
    defaults = {field.name: field.default for field in dataclasses.fields(ConnectorConfig)}
    for args in (scenario.worker_args, scenario.worker_args + scenario.decode_args):  # prefill's, decode's
        flags = dict(zip(args[::2], args[1::2]))
        names = {flag: flag.removeprefix("--").replace("-", "_") for flag in flags}
        assert set(names.values()) <= set(defaults), f"{name}: only connector settings are checked here"
        ConnectorConfig(**{names[flag]: type(defaults[names[flag]])(value) for flag, value in flags.items()})


def test_bench_help_lists_every_scenario_and_leg_and_each_scenarios_default_legs():
    from typer.testing import CliRunner

    from kvturn.bench.catalog import LEGS, RETENTION_LEGS
    from kvturn.cli import app
    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "2000"}, terminal_width=2000)
    text = " ".join(result.output.replace("│", " ").split())  # the help box's lines joined
    for name in SCENARIOS:
        assert f"{name}: {SCENARIOS[name].description}" in text, name
        assert f"{name}" in text.split("(default, by scenario:")[1], name
    for leg in LEGS:
        assert leg in text, leg
    assert f"memory-pressure: {','.join(RETENTION_LEGS)}" in text


def test_a_scenarios_default_legs_are_the_ones_it_is_about():
    from kvturn.bench.catalog import DEFAULT_LEGS, RETENTION_LEGS, default_legs
    assert default_legs("memory-pressure") == RETENTION_LEGS
    assert default_legs("coding-agent") == ("pd/P-cache-off", "bidir/P-cache-off", "adaptive")
    assert default_legs("sweep") == DEFAULT_LEGS


@pytest.mark.parametrize("content, message", [
    ('{"filetype": "kvturn_synthetic", "num_sessions": 2.5}', "num_sessions must be a whole number"),
    ('{"filetype": "kvturn_synthetic", "new_tokens": {"distribution": "uniform", "min": 1, "max": NaN}}',
     "new_tokens: 'max' must be finite numbers"),
    ('[{"id": 1, "messages": [{"role": "user", "content": ["parts"]}]}]', "each message must be"),
    ("{not json", "cannot read a JSON workload"),
])
def test_the_bench_refuses_a_bad_workload_file_with_a_usage_error(tmp_path, monkeypatch, tiny_model_dir, content,
                                                                  message):
    from typer.testing import CliRunner

    from kvturn.cli import app
    monkeypatch.chdir(tmp_path)  # a short path, which the error's box does not break
    Path("bad.json").write_text(content)
    result = CliRunner().invoke(app, ["bench", "--compare", "--workload", "bad.json", "--model", str(tiny_model_dir),
                                      "--out", "out"])
    assert result.exit_code == 2, (result.output, result.exception)  # a usage error, before any stack starts
    said = " ".join(result.output.replace("│", " ").split())
    assert "bad.json" in said and message in said, result.output


def test_the_report_says_what_decode_retained_gave_up_and_why_and_what_it_cost_others():
    from kvturn.bench.report import retention_words
    result = RunResult(runtime_s=1.0, worker_counters={
        "decode": {'kvturn_kv_leases_total{event="created"}': 56.0, 'kvturn_kv_leases_total{event="reclaimed"}': 40.0,
                   'kvturn_kv_retention_choices_total{reason="ended"}': 4.0,
                   'kvturn_kv_retention_choices_total{reason="least_recent"}': 36.0,
                   'kvturn_kv_retention_choices_total{reason="covered"}': 0.0,
                   "kvturn_preemptions_total": 0.0, "kvturn_prompt_tokens_computed_total": 0.0},
        "prefill": {'kvturn_kv_leases_total{event="reclaimed"}': 0.0,
                    'kvturn_kv_reuse_declines_total{reason="lease_ended"}': 6.0,
                    'kvturn_kv_reuse_declines_total{reason="epoch_mismatch"}': 1.0},
        "router": {'kvturn_router_prefill_reuse_total{outcome="lease_ended"}': 38.0}})
    summary = summarize("bidir/P-cache-on", result)
    assert summary["retention"]["choices"] == {"ended": 4.0, "least_recent": 36.0}
    assert retention_words([summary, summarize("pd/P-cache-on", RunResult(runtime_s=1.0))]) == (
        "bidir/P-cache-on: decode retained 56 leases and gave up 40 under pressure (chosen as ended 4, least_recent "
        "36); of the leases it had let go, the router withdrew 32 and prefill saw 6 before reading, 1 after; decode "
        "preempted 0 requests and computed 0 prompt tokens itself; prefill let 0 pins go.")
