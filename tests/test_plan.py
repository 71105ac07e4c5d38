"""`kvturn plan`: reading workloads and traces, calibrating from a bench run, the simulation's invariants, plan.json,
the router's --trace-out through real processes, and the command's errors."""
import json
import statistics
from dataclasses import fields, replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from chat import conversation
from kvturn.bench.catalog import LEGS
from kvturn.cli import app
from kvturn.kv_transfer.params import SECRET_HEADER
from kvturn.launch import LocalStack
from kvturn.plan import calibration, endpoints, fit, planner, report, trace
from kvturn.plan import predict
from kvturn.plan.predict import simulate
from kvturn.plan.rows import Row, rows_of
from kvturn.plan.sim import Deployment, RouterPool, Simulation
from kvturn.plan.step_samples import Step, parse_step
from kvturn.plan.steps import Job, StepLoop
from kvturn.plan.trace import Session, TraceError, TurnDemand, Workload

FIXTURE = Path(__file__).parent / "fixtures" / "plan_bench_results.json"
PLAN_FIELDS = {"ttft_p50_ms", "ttft_p90_ms", "session_p50_s", "peak_retained_mib", "reuse_share"}


@pytest.fixture(scope="module")
def cost_model():
    return calibration.load(FIXTURE)


def agent_sessions(sessions: int, turns: int, think_s: float = 1.0, history: int = 3000, clients: int | None = 4):
    """Sessions whose every turn extends the last by 200 new tokens and a 32-token answer."""
    workload = []
    for i in range(sessions):
        demands, prompt = [], history + 97 * i
        for turn in range(turns):
            shared = demands[-1].prompt_tokens + 32 if demands else 0
            demands.append(TurnDemand(prompt, 32, shared, think_s if turn else 0.0))
            prompt += 32 + 200
        workload.append(Session(f"s{i}", demands, None if clients else i * 0.5))
    return Workload("agents", workload, clients)


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_a_trace_groups_requests_by_conversation_with_think_time_and_shared_history(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 100.0, "conversation_id": "a", "prompt_tokens": 1000, "output_tokens": 50, "finished": 101.0},
        {"timestamp": 100.5, "conversation_id": "b", "prompt_tokens": 400, "output_tokens": 20},
        {"timestamp": 104.0, "conversation_id": "a", "prompt_tokens": 1300, "output_tokens": 40, "finished": 105.0},
        {"timestamp": 110.0, "conversation_id": "a", "prompt_tokens": 900, "output_tokens": 10},
        {"timestamp": 103.5, "conversation_id": "b", "prompt_tokens": 600, "output_tokens": 20},
    ])
    workload = trace.load(path, lambda: "unused", 0, 1)
    a, b = workload.sessions
    assert (a.start_s, b.start_s) == (0.0, 0.5) and workload.clients is None
    assert [t.think_s for t in a.turns] == [0.0, 3.0, 5.0]  # from the previous answer's end
    assert [t.shared_tokens for t in a.turns] == [0, 1050, 0]  # the third prompt is shorter: edited, not extended
    assert b.turns[1].think_s == 3.0  # no 'finished': the gap between arrivals


def test_a_trace_prompt_shorter_than_the_history_shares_the_previous_prompt_or_what_the_line_says(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 0.0, "conversation_id": "c", "prompt_tokens": 1000, "output_tokens": 200, "shared_tokens": 300},
        {"timestamp": 1.0, "conversation_id": "c", "prompt_tokens": 1100, "output_tokens": 300},
        {"timestamp": 2.0, "conversation_id": "c", "prompt_tokens": 1500, "output_tokens": 50, "shared_tokens": 1160},
        {"timestamp": 3.0, "conversation_id": "c", "prompt_tokens": 3000, "output_tokens": 10, "shared_tokens": 2900},
    ])
    turns = trace.load(path, lambda: "unused", 0, 1).sessions[0].turns
    # A first turn has no previous turn to share with; 1100 < 1000 + 200 (the thinking dropped): the previous
    # prompt; the line's own count; the line's count, within the previous prompt and answer (1500 + 50).
    assert [t.shared_tokens for t in turns] == [0, 1000, 1160, 1550]
    assert trace.reusable(turns[0], turns[1], 1.0) == 1000


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('["a list"]', "expected an object"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 10}', "'output_tokens' missing"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": true, "output_tokens": 3}', "'prompt_tokens'"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 0, "output_tokens": 3}', "at least 1"),
    ('{"timestamp": 5, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3, "finished": 2}', "finished"),
    ('{"timestamp": 0, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3, "finished": true}', "finished"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3, "shared_tokens": 10}',
     "shared_tokens"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3, "shared_tokens": -1}',
     "shared_tokens"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3, "shared_tokens": 2.5}',
     "shared_tokens"),
])
def test_a_malformed_trace_line_is_refused_naming_its_line(tmp_path, line, message):
    good = {"timestamp": 0, "conversation_id": "a", "prompt_tokens": 10, "output_tokens": 2}
    path = write_lines(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{message}"):
        trace.load(path, lambda: "unused", 0, 1)


def test_bench_workload_formats_become_token_counts(tmp_path, tiny_model_dir):
    vllm_list = [{"id": "c1", "messages": [{"role": "system", "content": "be brief " * 50},
                                           {"role": "user", "content": "hello there " * 20},
                                           {"role": "assistant", "content": "hi " * 10},
                                           {"role": "user", "content": "more please " * 20}]}]
    generator = {"filetype": "generate_conversations", "num_conversations": 2,
                 "prompt_input": {"num_turns": 6, "common_prefix_num_tokens": 100, "prefix_num_tokens": 50,
                                  "num_tokens": 30}, "prompt_output": {"num_tokens": 12}}
    synthetic = {"filetype": "kvturn_synthetic", "num_sessions": 3, "system_tokens": 200, "num_turns": 2,
                 "new_tokens": 40, "answer_tokens": 8}
    for name, data, sessions, turns in (("list", vllm_list, 1, 2), ("gen", generator, 2, 3), ("syn", synthetic, 3, 2)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        workload = trace.load(path, lambda: str(tiny_model_dir), 0, 2)
        assert len(workload.sessions) == sessions and all(len(s.turns) == turns for s in workload.sessions)
        for s in workload.sessions:
            first, second = s.turns[:2]
            assert second.prompt_tokens > first.prompt_tokens + first.output_tokens  # history + new user text
            assert second.shared_tokens == first.prompt_tokens + first.output_tokens


def test_a_bench_run_with_junk_in_its_requests_fits_what_is_plausible_or_is_refused_by_name(cost_model, tmp_path):
    results = json.loads(FIXTURE.read_text())
    junk = ["12", None, True, -5, float("nan"), 1e300, [1], {"ms": 1}]
    fields = ["ttft_ms", "input_num_tokens", "output_num_tokens", "prefill_compute_ms", "d_to_p_read_ms",
              "p_to_d_read_ms", "bytes_d_to_p", "prompt_tokens_from_decode", "tpot_ms", "latency_ms", "turn",
              "start_time_ms", "prompt_tokens_computed_prefill", "approx_cached_percent", "queue_ms"]
    poisoned = 0
    for run in results["legs"].values():
        for index, request in enumerate(run["requests"]):
            if index % 5 == 0:  # one request in five has one field of junk
                request[fields[index % len(fields)]] = junk[index % len(junk)]
                poisoned += 1
        run["requests"].append("not a request")
    assert poisoned > 10
    (tmp_path / "junk.json").write_text(json.dumps(results))
    model = calibration.load(tmp_path / "junk.json")  # fitted from the plausible rest, as a saved one would load
    assert calibration.load(model.save(tmp_path / "saved.json")) == model
    assert model.kv_bytes_per_token == cost_model.kv_bytes_per_token
    # A byte a read: what fits to values no saved calibration may hold is refused naming the file, not planned with.
    for run in results["legs"].values():
        for request in run["requests"]:
            if isinstance(request, dict) and request.get("bytes_d_to_p"):
                request["bytes_d_to_p"] = 1
    (tmp_path / "tiny.json").write_text(json.dumps(results))
    with pytest.raises(fit.CalibrationError, match=r"tiny\.json: (kv_bytes_per_token|read_ms_per_mib) must"):
        calibration.load(tmp_path / "tiny.json")


def test_the_tokens_an_answers_text_comes_to_over_those_generated_are_fitted_from_what_the_bench_counted(
        cost_model, tmp_path):
    assert cost_model.resent_answer_ratio is None  # the checked-in run did not count them: answers as generated
    results = json.loads(FIXTURE.read_text())
    counted = 0
    for run in results["legs"].values():
        for index, request in enumerate(run["requests"]):
            # Half the answers come back whole, half as a quarter of their tokens; junk counts are left out.
            request["answer_text_tokens"] = [request["output_num_tokens"], request["output_num_tokens"] // 4,
                                             "12", -3, True, 2**40][index % 6]
            counted += index % 6 < 2
    rows = rows_of(results)
    kept = [row for row in rows if row.answer_text_tokens is not None]
    assert 0 < len(kept) <= counted
    expected = sum(row.answer_text_tokens for row in kept) / sum(row.output_tokens for row in kept)
    assert 0.5 < expected < 0.75
    model = calibration.Calibration(**fit.fitted(results))
    assert model.resent_answer_ratio == pytest.approx(expected)
    assert calibration.load(model.save(tmp_path / "resent.json")) == model
    # Never more of an answer is reused from retention than comes back.
    assert replace(model, answer_reuse_share=1.0).answer_share == pytest.approx(expected)
    assert replace(model, answer_reuse_share=0.05).answer_share == 0.05


def test_a_workload_of_conversations_resends_each_answer_at_the_calibrated_share_of_its_tokens(tiny_model_dir,
                                                                                              tmp_path):
    path = tmp_path / "syn.json"
    path.write_text(json.dumps({"filetype": "kvturn_synthetic", "num_sessions": 2, "system_tokens": 200,
                                "num_turns": 4, "new_tokens": 40, "answer_tokens": 20}))
    workload = trace.load(path, lambda: str(tiny_model_dir), 0, 2)
    assert workload.answers_as_generated
    resent = trace.resend_answers(workload, 0.5)
    assert not resent.answers_as_generated and trace.resend_answers(resent, 0.5) == resent  # once only
    for before, after in zip(workload.sessions, resent.sessions):
        for index, (planned, sent) in enumerate(zip(before.turns, after.turns)):
            # Each answer before the turn comes back as 10 of its 20 tokens.
            assert planned.prompt_tokens - sent.prompt_tokens == 10 * index
            assert (sent.output_tokens, sent.think_s) == (planned.output_tokens, planned.think_s)
        for previous, turn in zip(after.turns, after.turns[1:]):
            # The turn still continues the previous prompt and answer: what it can reuse is the previous prompt
            # and the reused share of the answer, never more than comes back, nor its own last token.
            assert trace.reusable(previous, turn, 1.0) == min(previous.prompt_tokens + 20, turn.prompt_tokens - 1)
            assert trace.reusable(previous, turn, 0.05) == previous.prompt_tokens + 1
    # Answers come back as round(ratio x) the tokens generated so far, not rounded one by one (12.8 tokens of each
    # 20 is 38 of 60 after three answers, not 39).
    for before, after in zip(workload.sessions, trace.resend_answers(workload, 0.64).sessions):
        for index, (planned, sent) in enumerate(zip(before.turns, after.turns)):
            assert planned.prompt_tokens - sent.prompt_tokens == 20 * index - round(0.64 * 20 * index)
    # A trace counted what was sent; no ratio measured keeps the workload as planned.
    assert trace.resend_answers(agent_sessions(2, 3), 0.5) == agent_sessions(2, 3)
    assert trace.resend_answers(workload, None) is workload


def test_the_plan_simulates_the_prompts_as_resent(cost_model, tiny_model_dir, tmp_path):
    path = tmp_path / "syn.json"
    path.write_text(json.dumps({"filetype": "kvturn_synthetic", "num_sessions": 2, "system_tokens": 300,
                                "num_turns": 5, "new_tokens": 50, "answer_tokens": 200}))
    workload = trace.load(path, lambda: str(tiny_model_dir), 0, 2)
    leg = "pd/P-cache-off"
    plans = {ratio: planner.plan(workload, replace(cost_model, resent_answer_ratio=ratio), Deployment(), [leg],
                                 "pull", False, [60.0], ()) for ratio in (None, 1.0, 0.25)}
    assert plans[None]["legs"][leg] == plans[1.0]["legs"][leg]  # answers that come back whole change nothing
    assert [plans[ratio]["workload"]["answers_resent_at"] for ratio in (None, 1.0, 0.25)] == [None, 1.0, 0.25]
    # Each answer resent as a quarter of its 200 tokens: later prompts are 150 tokens a turn shorter, and a leg
    # that recomputes the whole prompt answers sooner.
    assert plans[0.25]["legs"][leg]["ttft_p50_ms"] < plans[None]["legs"][leg]["ttft_p50_ms"]
    sim = Simulation(workload, LEGS[leg], Deployment(), replace(cost_model, resent_answer_ratio=0.25)).run()
    planned = {(i, t): turn.prompt_tokens for i, s in enumerate(workload.sessions) for t, turn in enumerate(s.turns)}
    assert all(planned[(r.session, r.turn)] - r.prompt_tokens == 150 * r.turn for r in sim.results)
    # Pulled back from D: the previous prompt as resent and the 50 tokens of its answer that come back (whatever
    # share of the answer as generated the calibration reuses), in whole blocks; never the 200 D holds.
    pulled = Simulation(workload, LEGS["bidir/P-cache-off"], Deployment(),
                        replace(cost_model, resent_answer_ratio=0.25, answer_reuse_share=1.0)).run()
    sent = {(r.session, r.turn): r.prompt_tokens for r in pulled.results}
    later = [r for r in pulled.results if r.turn > 0]
    assert sum(r.reused_tokens > 0 for r in later) >= len(later) // 2
    assert all(r.reused_tokens in (0, (sent[r.session, r.turn - 1] + 50) // 16 * 16) for r in later)


def test_calibration_fits_the_checked_in_bench_run_and_round_trips(cost_model, tmp_path):
    assert cost_model.kv_bytes_per_token == 4096  # the tiny model: 4 layers x K,V x 2 heads x 64 x fp32
    assert set(cost_model.compute_fits) == {"prefill", "decode", "colocated"}
    assert cost_model.prefill_ms(4000, 0) > cost_model.prefill_ms(200, 3800) > 0  # reuse saves compute
    assert cost_model.read_ms_per_mib["d_to_p"] > 0 and set(cost_model.other_ms) == set(
        json.loads(FIXTURE.read_text())["legs"])
    again = calibration.load(cost_model.save(tmp_path / "calibration.json"))
    assert again == cost_model


def test_the_workers_start_up_steps_calibrate_beside_the_requests(cost_model):
    # A bench run keeps each leg's workers' /kv/calibration. Here they say D computes prompts alone twice as fast
    # as its requests (computed beside its decodes) made it seem: D's fit becomes theirs, and a step of D's then
    # pays its decodes' step on top. P's steps join P's requests.
    results = json.loads(FIXTURE.read_text())
    shapes = [(512, 0), (2048, 0), (4096, 0), (256, 2048), (256, 4096)]
    decode_steps = [{"new_tokens": n, "context_tokens": c, "ms": cost_model.prefill_ms(n, c, "decode") / 2}
                    for n, c in shapes]
    prefill_steps = [{"new_tokens": n, "context_tokens": c, "ms": cost_model.prefill_ms(n, c) * 3} for n, c in shapes]
    for run in results["legs"].values():
        run["worker_calibration"] = {"prefill": prefill_steps, "decode": decode_steps + [{"ms": "bogus"}]}
    refitted = calibration.Calibration(**fit.fitted(results))
    assert refitted.decode_fit_alone and not cost_model.decode_fit_alone
    for n, c in shapes:
        assert refitted.prefill_ms(n, c, "decode") == pytest.approx(cost_model.prefill_ms(n, c, "decode") / 2, rel=0.05)
    assert refitted.prefill_ms(256, 4096) > 1.2 * cost_model.prefill_ms(256, 4096)
    workload = agent_sessions(6, 4)
    later_ttft_ms = [sum(r.ttft_ms for r in Simulation(workload, LEGS["compute-on-D"], Deployment(),
                                                      replace(refitted, decode_fit_alone=alone)).run().results
                         if r.turn > 0) for alone in (False, True)]
    assert later_ttft_ms[1] > later_ttft_ms[0]


def test_a_saved_calibration_of_three_compute_terms_still_loads_and_a_malformed_one_is_refused(cost_model, tmp_path):
    saved = json.loads(cost_model.save(tmp_path / "calibration.json").read_text())
    saved["compute_fits"] = {kind: [a, b, (c + q) / 2] for kind, (a, b, c, q) in saved["compute_fits"].items()}
    (tmp_path / "old.json").write_text(json.dumps(saved))
    old = calibration.load(tmp_path / "old.json")
    assert all(fit_[2] == fit_[3] for fit_ in old.compute_fits.values())
    for junk in ({**saved["compute_fits"], "prefill": [1.0, "fast"]}, {**saved["compute_fits"], "gpu": [1.0] * 4}):
        (tmp_path / "bad.json").write_text(json.dumps({**saved, "compute_fits": junk}))
        with pytest.raises(fit.CalibrationError, match="compute_fits"):
            calibration.load(tmp_path / "bad.json")
    # Saved before these were fitted (or with the ratio fitted once instead): steps after idling cost what others
    # do, or that times 1 + the slowdown with the other role busy.
    del saved["idle_step_ms"], saved["busy_idle_step_ms"], saved["answer_reuse_share"], saved["run_spread"]
    (tmp_path / "older.json").write_text(json.dumps({**saved, "compute_fits": old.compute_fits,
                                                     "idle_step_ratio": 1.2}))
    older = calibration.load(tmp_path / "older.json")
    assert older.idle_step_ms == 0.0 and older.busy_idle_step_ms is None
    assert older.answer_reuse_share is None and older.answer_share == 1.0  # unmeasured: every answer reusable
    assert older.after_idle_ms(100.0, True) == pytest.approx(100.0 * (1 + older.contention["prefill_slowdown"]))
    for name, value in [("idle_step_ms", v) for v in ("x", True, float("nan"), -0.5, 5000.0)] + \
                       [("busy_idle_step_ms", v) for v in ("x", False, float("inf"), -1.0, 5000.0)] + \
                       [("other_ms", v) for v in ([], {"colocated": -1.0}, {"colocated": "5"})] + \
                       [("other_ms_per_request", v) for v in ("x", {"colocated": float("nan")})] + \
                       [("other_load_seen", v) for v in (None, -1.0, True)] + \
                       [("answer_reuse_share", v) for v in ("x", True, float("nan"), -0.1, 1.5)] + \
                       [("run_spread", v) for v in ([], {"gpu": 0.1}, {"colocated": -0.1}, {"prefill": "1"})] + \
                       [("seen", v) for v in ([], {"decode_batch": -1}, {"gpu_batch": 4.0}, {"prompt_tokens": 0},
                                               {"decode_batch": float("nan")})] + \
                       [("compute_fits", v) for v in ({"prefill": [float("nan")] * 4}, {"decode": [1.0] * 4},
                                                       {"prefill": [1.0, 2.0, -1e9, 0.0]})] + \
                       [("decode_step_fit", v) for v in (None, [1.0, 2.0], [1.0, float("inf"), 0.0])] + \
                       [("colocated_step_fit", v) for v in ("x", [1.0, "2", 3.0])] + \
                       [("contention", v) for v in ({}, {"prefill_slowdown": -0.5, "decode_step_ms": 0.0},
                                                     {"prefill_slowdown": 0.1, "decode_step_ms": float("nan")})] + \
                       [("read_ms_per_mib", v) for v in ({"d_to_p": 1.0}, {"d_to_p": 1.0, "p_to_d": None},
                                                          {"d_to_p": -1.0, "p_to_d": 1.0})] + \
                       [("kv_bytes_per_token", v) for v in (0, float("nan"), "4096", 2.0**40)] + \
                       [("step_scatter", v) for v in ({"prefill": []}, {"prefill": [0.0]}, {"gpu": [1.0]})] + \
                       [("source", v) for v in (None, 3)] + \
                       [("samples", v) for v in ([], {"prefill": -1}, {"prefill": 2.5})]:
        (tmp_path / "bad.json").write_text(json.dumps({**saved, "compute_fits": old.compute_fits, name: value}))
        with pytest.raises(fit.CalibrationError, match=f"{name} must"):
            calibration.load(tmp_path / "bad.json")


def test_every_field_of_a_saved_calibration_is_checked_on_load(cost_model, tmp_path):
    assert set(calibration.SAVED_FIELDS) == {f.name for f in fields(calibration.Calibration)}
    saved = json.loads(cost_model.save(tmp_path / "calibration.json").read_text())
    (tmp_path / "extra.json").write_text(json.dumps({**saved, "gpu_count": 8}))
    with pytest.raises(fit.CalibrationError, match="unknown fields: gpu_count"):
        calibration.load(tmp_path / "extra.json")


def test_several_bench_runs_pool_into_one_calibration_and_a_saved_one_is_not_pooled(cost_model, tmp_path):
    # The same run twice, the second twice as slow: the pooled fit lies between. Each run keeps its own clock, so
    # requests of one are never taken as overlapping those of the other (as contention, or as shared steps).
    results = json.loads(FIXTURE.read_text())
    slower = json.loads(FIXTURE.read_text())
    for run in slower["legs"].values():
        for request in run["requests"]:
            for key in ("prefill_compute_ms", "decode_compute_ms", "ttft_ms", "latency_ms", "tpot_ms"):
                if request.get(key):
                    request[key] *= 2
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (results, slower)):
        path.write_text(json.dumps(data))
    assert replace(calibration.load_many(paths[:1]), source=cost_model.source) == cost_model
    twice = calibration.load_many([paths[0], paths[0]])
    assert twice.compute_fits["prefill"] == pytest.approx(cost_model.compute_fits["prefill"], rel=1e-6)
    assert twice.contention == pytest.approx(cost_model.contention)
    assert twice.samples["prefill"] == 2 * cost_model.samples["prefill"]
    pooled = calibration.load_many(paths)
    for n, context in ((4000, 0), (200, 3800)):
        assert cost_model.prefill_ms(n, context) < pooled.prefill_ms(n, context) < 2 * cost_model.prefill_ms(n, context)
    # ...and says how far apart the runs' own fits lie, which the verdict names past SPREAD_SAID
    assert cost_model.run_spread == {} and twice.run_spread["prefill"] == pytest.approx(0.0, abs=1e-9)
    assert pooled.run_spread["prefill"] == pytest.approx(1.0, rel=0.15)  # one run at twice the times: about 100% apart
    assert planner.spread_words(twice) is None
    words = planner.spread_words(pooled)
    assert f"{pooled.run_spread['prefill']:.0%} apart on the prefill worker" in words
    assert "1000 new tokens after 3000" in words
    assert calibration.load(pooled.save(tmp_path / "pooled.json")).run_spread == pooled.run_spread
    plan = planner.plan(agent_sessions(2, 3), pooled, Deployment(), ["pd/P-cache-off"], "pull", False, [60.0], ())
    assert words in plan["verdict"]["text"]
    # The time outside compute and transfer grows with the requests in flight: a run whose requests all arrived
    # together (eleven others in flight), each 22 ms slower outside compute, says what each of them adds.
    crowded = json.loads(FIXTURE.read_text())
    for request in crowded["legs"]["pd/P-cache-on"]["requests"]:
        request["start_time_ms"], request["ttft_ms"] = 0.0, request["ttft_ms"] + 22.0
    (tmp_path / "crowded.json").write_text(json.dumps(crowded))
    both = calibration.load_many([paths[0], tmp_path / "crowded.json"])
    assert cost_model.other_load_seen == 1 and both.other_load_seen == 11
    assert both.other("pd/P-cache-on", 11) - both.other("pd/P-cache-on", 1) == pytest.approx(22.0, abs=3.0)
    assert both.other("pd/P-cache-on", 30) == both.other("pd/P-cache-on", 11)  # no further than the runs saw
    with pytest.raises(fit.CalibrationError, match="only kvturn bench results"):
        calibration.load_many([paths[0], cost_model.save(tmp_path / "saved.json")])
    (tmp_path / "empty.json").write_text(json.dumps({"legs": {}}))
    with pytest.raises(fit.CalibrationError, match="empty.json: not a kvturn bench results JSON"):
        calibration.load_many([paths[0], tmp_path / "empty.json"])


PROMPT_FIT = (12.0, 0.10, 0.09, 0.08)  # the steps below cost exactly this (a, b, c, q) on P
DECODE_STEP = (1.0, 0.5, 3.5)  # ...and D's decode steps a + b batch + k batch x longest context / 1e3


def served_step(start_s: float, ms: float, prompts: list, decodes: int = 0, context: int = 0, longest: int = 0) -> dict:
    """One step as a worker's /kv/steps lists it."""
    return {"start_s": start_s, "ms": ms, "cpu_ms": ms, "prompts": prompts, "decodes": decodes,
            "decode_context": context, "decode_longest": longest}


def worker_steps(prompt_scale: float, step: tuple[float, float, float], start_s: float, prompts: bool,
                 decodes_beside: bool) -> list:
    """A worker's /kv/steps of one leg: prompt steps of known cost (every other one beside two decodes when
    `decodes_beside`, which add their per-request and attention terms: one forward pass, one fixed cost), then
    decode-only steps of batches 1-4, as they ran one after another."""
    a, b, k = step
    shapes = [(4000, 0), (900, 0), (2500, 0), (300, 4400), (120, 2000), (350, 7000), (60, 900), (200, 3000)]
    steps, now = [], start_s
    for i, (n, context) in enumerate(shapes if prompts else []):
        decodes, longest = (2, 3000) if decodes_beside and i % 2 else (0, 0)
        ms = prompt_scale * replace_fits(PROMPT_FIT).prefill_ms(n, context)
        ms += b * decodes + k * decodes * longest / 1e3
        steps.append(served_step(now, ms, [[n, context]], decodes, 2 * longest - 500 if decodes else 0, longest))
        now += ms / 1e3 + 0.5
    for i, batch in enumerate((1, 2, 3, 4) * 6):
        longest = 2500 + 700 * (i % 5)
        ms = a + b * batch + k * batch * longest / 1e3
        steps.append(served_step(now, ms, [], batch, batch * longest - 100 * (batch - 1), longest))
        now += ms / 1e3 + 0.01
    return steps


def replace_fits(coefficients) -> calibration.Calibration:
    """A calibration whose every kind computes prompts at `coefficients` (for its step_prefill_ms)."""
    return calibration.Calibration({"prefill": coefficients}, (0.0, 0.0, 0.0), {}, {}, 0.0, {})


def with_worker_steps(results: dict) -> dict:
    """The fixture's bench run as a bench that keeps each worker's steps in service records it: P at PROMPT_FIT, D's
    prompts (compute-on-D) at 0.8 of it, a colocated worker's at half; D's decode steps at DECODE_STEP, a colocated
    worker's at half of it."""
    half_step = tuple(c / 2 for c in DECODE_STEP)
    for leg, run in results["legs"].items():
        if LEGS[leg].mode == "colocated":
            run["worker_steps"] = {"both": worker_steps(0.5, half_step, 1000.0, True, True)}
        else:
            run["worker_steps"] = {"prefill": worker_steps(1.0, DECODE_STEP, 1000.0, True, False)[:8],
                                   "decode": worker_steps(0.8, DECODE_STEP, 2000.0, leg == "compute-on-D", True)}
    return results


JUNK_STEPS = ["junk", [1.0, 2.0], {"start_s": 1.0}, served_step(float("nan"), 5.0, [[10, 0]]),
              served_step(10**400, 5.0, [[10, 0]]), served_step(1.0, 5e-324, [], 1, 10, 10),
              served_step(1.0, 5.0, [[1, 10]]), served_step(1.0, 5.0, [[10, -1]]), served_step(1.0, 5.0, [[True, 0]]),
              served_step(1.0, 5.0, [], True, 10, 10), served_step(1.0, 5.0, [], 2, 0, 0),
              served_step(1.0, 5.0, [], 2, 100, 40), served_step(1.0, 5.0, [], 2, 100, 101),
              served_step(1.0, 5.0, [], 1, 2**30, 2**30), {**served_step(1.0, 5.0, [], 1, 10, 10), "cpu_ms": "fast"}]


def test_a_step_in_service_that_is_not_a_plausible_one_is_left_out():
    # Not a dict; missing fields; a NaN or overflowing start; a time too short for its tokens; a one-token prompt
    # chunk (the engine runs that as a decode); a negative or boolean count; decodes with no context, or a longest
    # context that the batch's total is short of or below; a context past any model's; a CPU time not a number.
    assert [parse_step(raw) for raw in JUNK_STEPS] == [None] * len(JUNK_STEPS)
    assert parse_step(served_step(1.0, 5.0, [[10, 0]], 2, 150, 100)) == Step(1.0, 5.0, ((10, 0),), 2, 150, 100)


def test_a_bench_run_that_kept_the_workers_steps_calibrates_from_them_alone(cost_model, tmp_path):
    results = with_worker_steps(json.loads(FIXTURE.read_text()))
    results["legs"]["pd/P-cache-on"]["worker_steps"]["decode"] += JUNK_STEPS
    results["legs"]["pd/P-cache-on"]["worker_steps"]["prefill"] += JUNK_STEPS
    stepped = calibration.Calibration(**fit.fitted(results))
    for n, context in ((4000, 0), (300, 4400), (60, 900)):
        expected = replace_fits(PROMPT_FIT).prefill_ms(n, context)
        assert stepped.prefill_ms(n, context) == pytest.approx(expected, rel=1e-3)
        assert stepped.prefill_ms(n, context, "decode") == pytest.approx(0.8 * expected, rel=1e-3)
        assert stepped.prefill_ms(n, context, "colocated") == pytest.approx(0.5 * expected, rel=1e-3)
    assert stepped.decode_step_fit == pytest.approx(DECODE_STEP, rel=1e-3) and stepped.decode_step_padded
    assert stepped.step_fit("colocated") == pytest.approx(tuple(c / 2 for c in DECODE_STEP), rel=1e-3)
    # What beside the other role and after idling cost is in the steps themselves, as the run saw it.
    assert stepped.contention["prefill_slowdown"] == 0 and stepped.idle_step_ms == stepped.busy_idle_step_ms == 0
    p_legs = sum(LEGS[leg].mode != "colocated" for leg in results["legs"])
    assert stepped.decode_fit_alone and stepped.samples["prefill"] == 8 * p_legs  # the junk is left out
    assert stepped.decodes_share_fixed_cost  # a prompt step pays the decodes beside it their terms, not a second a
    # The shapes it measured at their most: P's (350, 7000) chunk, and D's batch of 4 at a longest context of 5300.
    assert stepped.seen == {"prompt_tokens": 4000, "prompt_context": 7350, "decode_batch": 4, "decode_attended": 21200}
    # What steps do not say still comes from the requests; from requests alone, only what prompts reached.
    assert set(cost_model.seen) == {"prompt_tokens", "prompt_context"}
    assert stepped.other_ms == cost_model.other_ms and stepped.read_ms_per_mib == cost_model.read_ms_per_mib
    assert calibration.load(stepped.save(tmp_path / "stepped.json")) == stepped


SECRET = "s" * 32
P_URL, D_URL = "http://p.example:8100", "http://d.example:8200"


def running_workers(mib_read: tuple[float, float] = (10, 5), read_s: tuple[float, float] = (0.02, 0.05)) -> dict:
    """What `kvturn plan --calibration URL` reads of a P and a D worker that served turns: url -> {path: reply}.
    P's steps as the fixture's bench legs keep them (PROMPT_FIT), D's decode steps at DECODE_STEP; P read
    `mib_read[0]` MiB from D in `read_s[0]` s, D the others from P."""
    def about(role: str, index: int) -> dict:
        return {"role": role, "prefill_steps": [], "kv_bytes_per_token": 4096.0,
                "kv_reads": {"reads": 3, "bytes": int(mib_read[index] * 2**20), "seconds": read_s[index]}}
    return {P_URL: {"/kv/calibration": about("prefill", 0),
                    "/kv/steps": {"role": "prefill", "steps": worker_steps(1.0, DECODE_STEP, 1000.0, True, False)[:8],
                                  "dropped": False}},
            D_URL: {"/kv/calibration": about("decode", 1),
                    "/kv/steps": {"role": "decode", "steps": worker_steps(0.8, DECODE_STEP, 2000.0, False, True)
                                  + JUNK_STEPS, "dropped": False}}}


def serving(workers: dict) -> httpx.Client:
    """A client whose requests the `workers` answer (in-process, as peers: a reply may be anything); /kv/steps only
    to a caller with SECRET."""
    def answer(request: httpx.Request) -> httpx.Response:
        reply = workers.get(f"http://{request.url.host}:{request.url.port}", {}).get(request.url.path)
        if isinstance(reply, Exception):
            raise reply
        if reply is None:
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        if request.url.path == "/kv/steps" and request.headers.get(SECRET_HEADER) != SECRET:
            return httpx.Response(403, json={"error": {"message": "wrong or missing cluster secret"}})
        return httpx.Response(200, content=reply if isinstance(reply, bytes) else json.dumps(reply).encode())
    return httpx.Client(transport=httpx.MockTransport(answer))


def test_running_workers_calibrate_from_their_steps_in_service_and_reads(cost_model, tmp_path):
    workers = running_workers()
    model = calibration.Calibration(**endpoints.fitted([P_URL, D_URL + "/", P_URL], SECRET, serving(workers)))
    for n, context in ((4000, 0), (300, 4400), (60, 900)):
        assert model.prefill_ms(n, context) == pytest.approx(replace_fits(PROMPT_FIT).prefill_ms(n, context), rel=1e-3)
    assert model.decode_step_fit == pytest.approx(DECODE_STEP, rel=1e-3) and model.decode_step_padded
    # P's reads are D's KV read back (10 MiB in 20 ms), D's are P's prompts (5 MiB in 50 ms).
    assert model.read_ms_per_mib == pytest.approx({"d_to_p": 2.0, "p_to_d": 10.0})
    assert model.kv_bytes_per_token == 4096.0 and model.source == f"{P_URL}, {D_URL}"
    assert model.seen["decode_batch"] == 4 and model.samples["workers"] == 2 and model.samples["prefill"] == 8
    # No worker measures the router's, HTTP's and tokenizing's time: none is added, and the verdict says so.
    leg = "bidir/P-cache-off"
    assert model.other_ms == {} and model.other(leg, 3) == 0.0
    plan = planner.plan(agent_sessions(2, 3), model, Deployment(), [leg], "pull", False, [60.0], ())
    assert planner.OTHER_UNMEASURED in plan["verdict"]["text"] and planner.OTHER_UNMEASURED in plan["left_out"]
    from_bench = planner.plan(agent_sessions(2, 3), cost_model, Deployment(), [leg], "pull", False, [60.0], ())
    assert planner.OTHER_UNMEASURED not in from_bench["verdict"]["text"] + " ".join(from_bench["left_out"])
    # Nor how much of an answer comes back: every answer is planned as reusable, and the verdict says that too.
    assert model.answer_reuse_share is None and model.answer_share == 1.0
    assert planner.ANSWER_UNMEASURED in plan["verdict"]["text"] and planner.ANSWER_UNMEASURED in plan["left_out"]
    assert cost_model.answer_reuse_share is not None
    assert planner.ANSWER_UNMEASURED not in from_bench["verdict"]["text"] + " ".join(from_bench["left_out"])
    # Reads one way only stand for both.
    one_way = calibration.Calibration(**endpoints.fitted([P_URL, D_URL], SECRET, serving(running_workers((10, 0)))))
    assert one_way.read_ms_per_mib == pytest.approx({"d_to_p": 2.0, "p_to_d": 2.0})
    # A read timed at 0 s is a rate of 0 ms a MiB, not a direction unread: it neither takes the other's rate nor is
    # lost where the other read nothing.
    instant = calibration.Calibration(**endpoints.fitted([P_URL, D_URL], SECRET,
                                                         serving(running_workers((10, 0), read_s=(0.0, 0.05)))))
    assert instant.read_ms_per_mib == {"d_to_p": 0.0, "p_to_d": 0.0}
    # Of P's 20 ms reading 10 MiB, 15 ms were its own steps for other prompts before it saw the reads done.
    stepped = running_workers()
    stepped[P_URL]["/kv/calibration"]["kv_reads"]["step_seconds"] = 0.015
    read_alone = calibration.Calibration(**endpoints.fitted([P_URL, D_URL], SECRET, serving(stepped)))
    assert read_alone.read_ms_per_mib == pytest.approx({"d_to_p": 0.5, "p_to_d": 10.0})
    assert calibration.load(instant.save(tmp_path / "instant.json")).read_ms_per_mib == instant.read_ms_per_mib


def _set(path: tuple, value):
    def change(workers: dict) -> None:
        *keys, last = path
        target = workers
        for key in keys:
            target = target[key]
        target[last] = value
    return change


@pytest.mark.parametrize("change, urls, secret, message", [
    (None, [P_URL, D_URL], None, "is for cluster members: give the cluster's secret"),
    (None, [P_URL], SECRET, "give a prefill and a decode worker's URL"),
    (None, [P_URL, "http://router.example:8000"], SECRET, "not a kvturn worker (GET /kv/calibration answered 404)"),
    (_set((P_URL, "/kv/calibration"), [1, 2]), [P_URL, D_URL], SECRET, "something other than a JSON object"),
    (_set((P_URL, "/kv/calibration"), b"{oops"), [P_URL, D_URL], SECRET, "something other than a JSON object"),
    (_set((P_URL, "/kv/calibration", "role"), "admin"), [P_URL, D_URL], SECRET, "names no worker role"),
    (_set((D_URL, "/kv/calibration"), b'{"role": "decode", "kv_bytes_per_token": NaN, "kv_reads": {}}'),
     [P_URL, D_URL], SECRET, "says no KV bytes per token"),
    (_set((D_URL, "/kv/calibration", "kv_reads", "bytes"), -1), [P_URL, D_URL], SECRET, "whole bytes and seconds"),
    (_set((D_URL, "/kv/calibration", "kv_reads", "seconds"), "fast"), [P_URL, D_URL], SECRET, "whole bytes"),
    (_set((P_URL, "/kv/calibration", "kv_reads", "step_seconds"), 0.5), [P_URL, D_URL], SECRET,
     "step_seconds must be a number from 0 to its seconds"),
    (_set((P_URL, "/kv/calibration", "kv_reads", "step_seconds"), float("nan")), [P_URL, D_URL], SECRET,
     "step_seconds must"),
    (_set((D_URL, "/kv/calibration", "kv_bytes_per_token"), 8192.0), [P_URL, D_URL], SECRET, "not one model"),
    (_set((P_URL, "/kv/steps", "role"), "decode"), [P_URL, D_URL], SECRET, "answered no steps of its prefill"),
    (_set((D_URL, "/kv/steps", "steps"), JUNK_STEPS), [P_URL, D_URL], SECRET, "the decode workers 0 decode steps"),
    (_set((D_URL, "/kv/steps"), httpx.ConnectError("refused")), [P_URL, D_URL], SECRET, "cannot reach the worker"),
])
def test_a_worker_url_that_answers_wrong_is_refused_naming_it(change, urls, secret, message):
    workers = running_workers()
    if change:
        change(workers)
    with pytest.raises(fit.CalibrationError) as raised:
        endpoints.fitted(urls, secret, serving(workers))
    assert message in str(raised.value)


def test_workers_that_read_nothing_yet_or_answer_too_much_are_refused(monkeypatch):
    with pytest.raises(fit.CalibrationError, match="no worker has read KV from a peer yet"):
        endpoints.fitted([P_URL, D_URL], SECRET, serving(running_workers((0, 0))))
    monkeypatch.setattr(endpoints, "MAX_REPLY_BYTES", 1000)
    with pytest.raises(fit.CalibrationError, match=f"{P_URL}: GET /kv/steps answered more than 1,000 bytes"):
        endpoints.fitted([P_URL, D_URL], SECRET, serving(running_workers()))
    with pytest.raises(fit.CalibrationError, match="not both"):
        calibration.load_many([FIXTURE, P_URL])


def test_a_saved_calibration_says_its_decode_step_is_padded_with_a_bool(cost_model, tmp_path):
    saved = json.loads(replace(cost_model, decode_step_padded=True).save(tmp_path / "padded.json").read_text())
    assert calibration.load(tmp_path / "padded.json").decode_step_padded is True
    saved["decode_step_padded"] = "false"
    (tmp_path / "bad.json").write_text(json.dumps(saved))
    with pytest.raises(fit.CalibrationError, match="decode_step_padded must be true or false"):
        calibration.load(tmp_path / "bad.json")
    del saved["decode_step_padded"]  # saved before the field
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert calibration.load(tmp_path / "old.json").decode_step_padded is False


def test_a_saved_calibration_says_whether_decodes_share_a_prompt_steps_fixed_cost_with_a_bool(cost_model, tmp_path):
    saved = json.loads(replace(cost_model, decodes_share_fixed_cost=True).save(tmp_path / "shared.json").read_text())
    assert calibration.load(tmp_path / "shared.json").decodes_share_fixed_cost is True
    saved["decodes_share_fixed_cost"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(saved))
    with pytest.raises(fit.CalibrationError, match="decodes_share_fixed_cost must be true or false"):
        calibration.load(tmp_path / "bad.json")
    del saved["decodes_share_fixed_cost"]  # saved before the field: a whole decode step, as fitted then
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert calibration.load(tmp_path / "old.json").decodes_share_fixed_cost is False


@pytest.mark.parametrize("shared", [True, False])
def test_a_prompt_step_beside_running_decodes_pays_one_fixed_cost_when_fitted_so(cost_model, shared):
    # A colocated worker decodes one request (3000 tokens of context), then a 200-token prompt arrives: its step
    # costs the prompt's compute plus the decode's per-request and attention terms, and the decode step's fixed
    # cost too only where the calibration says a prompt step pays it again (fitted from requests, or saved so).
    model = replace(cost_model, colocated_step_fit=(6.0, 0.5, 2.0), decode_step_padded=True,
                    decodes_share_fixed_cost=shared)
    sim = Simulation(Workload("none", [], None), LEGS["colocated"], Deployment(), model)
    worker, first_token = sim.decode[0], {}
    sim.at(0.0, worker.submit_decode, Job(0, 3000, 400))
    prompt = Job(200, 0, 1, on_first_token=lambda job, now: first_token.setdefault("at", now))
    sim.at(0.0, worker.submit_prefill, prompt)
    sim.run()
    # The prompt arrives as the decode's first step starts, and computes in the step after it.
    first_step_ms = model.decode_steps_ms("colocated", 1, 1, 3000, 3000)
    beside_ms = 0.5 + 2.0 * 3001 / 1e3 + (0.0 if shared else 6.0)
    assert model.decodes_beside_prompts_ms("colocated", 1, 3001, 3001) == pytest.approx(beside_ms)
    expected_ms = first_step_ms + model.prefill_ms(200, 0, "colocated") + beside_ms
    assert first_token["at"] == pytest.approx(expected_ms / 1e3)


def prefill_with(cost_model, jobs: dict[str, tuple[int, int, float]]):
    """(the calibration with every step at its fit's time, the simulation, its P of bidir/P-cache-off, `jobs` made
    from (new tokens, context, ms of a peer's KV to read) by name, the time of each one's first token by name)."""
    model = replace(cost_model, step_scatter={}, idle_step_ms=0.0)
    sim = Simulation(Workload("none", [], None), LEGS["bidir/P-cache-off"], Deployment(), model)
    first_token = {}
    made = {name: Job(new, context, 1, on_first_token=lambda job, now, name=name: first_token.setdefault(name, now),
                      read_ms=read_ms) for name, (new, context, read_ms) in jobs.items()}
    return model, sim, sim.prefill[0], made, first_token


def test_a_read_from_d_runs_on_ps_thread_before_the_step_that_admits_it_delaying_every_prompt_in_it(cost_model):
    # kvturn's scheduler starts the reads of the prompts it admits as it schedules a step, on the engine's own
    # thread (over shared memory UCX copies inside the post), and the step's forward pass waits for them: a read
    # does not run beside a step in progress, and a prompt admitted beside one that reads waits for that read too.
    model, sim, prefill, jobs, first_token = prefill_with(cost_model, {
        "first": (300, 0, 0.0), "pulled": (200, 2000, 40.0), "plain": (100, 0, 0.0)})
    sim.at(0.0, prefill.submit_prefill, jobs["first"])
    sim.at(0.001, prefill.submit_prefill, jobs["pulled"])  # both arrive while the first step computes
    sim.at(0.001, prefill.submit_prefill, jobs["plain"])
    sim.run()
    assert first_token["first"] == pytest.approx(model.prefill_ms(300, 0) / 1e3)
    together_ms = model.step_prefill_ms([(200, 2000), (100, 0)])
    expected_s = first_token["first"] + (40.0 + together_ms) / 1e3
    assert first_token["pulled"] == pytest.approx(expected_s) and first_token["plain"] == pytest.approx(expected_s)
    assert jobs["pulled"].compute_ms == pytest.approx(together_ms)  # the read is not compute
    assert prefill.in_flight == 0


def test_a_pulled_prompt_behind_one_that_finds_no_room_is_read_when_the_scheduler_reaches_it(cost_model):
    # kvturn's scheduler admits waiting prompts in turn and stops at one without a peer's KV that finds the step's
    # pack full: a pulled prompt behind it is not read in that step. In the next, it is read and joins last, after
    # the prompt ahead of it, in what room that one left.
    model, sim, prefill, jobs, first_token = prefill_with(cost_model, {
        "first": (300, 0, 0.0), "long": (600, 0, 0.0), "plain": (100, 0, 0.0), "pulled": (200, 2000, 40.0)})
    sim.at(0.0, prefill.submit_prefill, jobs["first"])
    for name in ("long", "plain", "pulled"):  # queued in this order while the first step computes
        sim.at(0.001, prefill.submit_prefill, jobs[name])
    sim.run()
    long_s = first_token["first"] + model.prefill_ms(600, 0) / 1e3  # alone: it fills the pack, the others wait
    assert first_token["long"] == pytest.approx(long_s)
    together_s = long_s + (40.0 + model.step_prefill_ms([(100, 0), (200, 2000)])) / 1e3
    assert first_token["plain"] == pytest.approx(together_s) and first_token["pulled"] == pytest.approx(together_s)


def test_a_pulled_prompt_is_read_whatever_the_packs_room_and_then_waits_among_the_running_for_room(cost_model):
    # Directly behind a prompt that fills the pack, a pulled prompt is admitted anyway: its read holds up that
    # step, and it computes in the next, before the plain prompt that queued behind it and found no room.
    model, sim, prefill, jobs, first_token = prefill_with(cost_model, {
        "first": (300, 0, 0.0), "long": (600, 0, 0.0), "pulled": (200, 2000, 40.0), "plain": (100, 0, 0.0),
        "later": (50, 1000, 30.0)})
    sim.at(0.0, prefill.submit_prefill, jobs["first"])
    for name in ("long", "pulled", "plain"):
        sim.at(0.001, prefill.submit_prefill, jobs[name])
    long_s = first_token_s = model.prefill_ms(300, 0) / 1e3
    long_s += (40.0 + model.prefill_ms(600, 0)) / 1e3
    sim.at(long_s - 0.001, prefill.submit_prefill, jobs["later"])  # arrives as the long prompt's step ends
    sim.run()
    assert first_token["first"] == pytest.approx(first_token_s) and first_token["long"] == pytest.approx(long_s)
    # The next step: the pulled prompt (read already) and the plain one; the later pull is read before it.
    next_s = long_s + (30.0 + model.step_prefill_ms([(200, 2000), (100, 0), (50, 1000)])) / 1e3
    assert first_token["pulled"] == first_token["plain"] == first_token["later"] == pytest.approx(next_s)


def test_a_read_prompt_that_finds_no_room_does_not_hold_back_the_reads_of_pulls_behind_it(cost_model):
    # A pulled prompt read in a step whose pack was full waits among the running for room; it does not stop the
    # scheduler from admitting, and reading, a pull that arrives behind it.
    model, sim, prefill, jobs, first_token = prefill_with(cost_model, {
        "first": (300, 0, 0.0), "y": (500, 0, 0.0), "x": (1000, 0, 0.0), "r1": (200, 2000, 40.0),
        "r2": (100, 1000, 30.0)})
    sim.at(0.0, prefill.submit_prefill, jobs["first"])
    for name in ("y", "x", "r1"):  # queued while the first step computes
        sim.at(0.001, prefill.submit_prefill, jobs[name])
    step1_s = model.prefill_ms(300, 0) / 1e3
    # Step 2: y, then 12 tokens of x (the pack's room), and r1's read; r1 finds no room left.
    step2_s = step1_s + (40.0 + model.step_prefill_ms([(500, 0), (12, 0)])) / 1e3
    sim.at(step2_s - 0.001, prefill.submit_prefill, jobs["r2"])
    sim.run()
    assert first_token["y"] == pytest.approx(step2_s)
    # Step 3: the rest of x fills the pack; r1 waits, and r2 behind it is read all the same.
    step3_s = step2_s + (30.0 + model.prefill_ms(988, 12)) / 1e3
    assert first_token["x"] == pytest.approx(step3_s)
    step4_s = step3_s + model.step_prefill_ms([(200, 2000), (100, 1000)]) / 1e3
    assert first_token["r1"] == pytest.approx(step4_s) and first_token["r2"] == pytest.approx(step4_s)


def test_a_compute_fit_runs_through_the_median_of_scattered_samples():
    # Prompts that cost exactly 10 + 0.1 n ms, measured 0.7-1.3x that: least relative squares alone come out low
    # (they weigh a fast sample more than a slow one); the fit is scaled so half ran slower and half faster.
    scatter = (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3)
    samples = [(((n, 0),), factor * (10 + 0.1 * n)) for n in (100, 400, 1600) for factor in scatter]
    fitted_ = fit.fit_through_median(samples)
    ratios = sorted(ms / fit.predict_compute(fitted_, chunks) for chunks, ms in samples)
    assert ratios[len(ratios) // 2] == pytest.approx(1.0)
    unscaled = fit.fit_compute(samples)
    assert fit.predict_compute(unscaled, ((400, 0),)) < 0.95 * fit.predict_compute(fitted_, ((400, 0),))
    assert fit.predict_compute(fitted_, ((400, 0),)) == pytest.approx(50.0, rel=0.02)


def test_the_prompt_fit_from_steps_in_service_runs_through_their_median():
    # P's steps as the fixture's bench would keep them, each measured 0.7-1.3x its cost.
    results = with_worker_steps(json.loads(FIXTURE.read_text()))
    scatter = (0.7, 1.3, 0.8, 1.2, 0.9, 1.1, 1.0)
    p_steps = []
    for run in results["legs"].values():
        for step in run["worker_steps"].get("prefill", []):
            if step["prompts"]:
                step["ms"] *= scatter[len(p_steps) % len(scatter)]
                p_steps.append(step)
    stepped = calibration.Calibration(**fit.fitted(results))
    ratios = [step["ms"] / stepped.step_prefill_ms([tuple(c) for c in step["prompts"]]) for step in p_steps]
    assert statistics.median(ratios) == pytest.approx(1.0) and min(ratios) < 0.75 and max(ratios) > 1.25


def test_a_calibration_from_steps_in_service_keeps_how_they_scattered_about_the_fit(tmp_path):
    results = with_worker_steps(json.loads(FIXTURE.read_text()))
    scatter = (0.7, 1.3, 0.8, 1.2, 0.9, 1.1, 1.0)
    count = 0
    for run in results["legs"].values():
        for step in run["worker_steps"].get("prefill", []):
            if step["prompts"]:
                step["ms"] *= scatter[count % len(scatter)]
                count += 1
    stepped = calibration.Calibration(**fit.fitted(results))
    quantiles = stepped.step_scatter["prefill"]
    assert len(quantiles) == len(fit.SCATTER_QUANTILES) and quantiles == sorted(quantiles)
    assert statistics.median(quantiles) == pytest.approx(1.0, abs=0.05) and quantiles[0] < 0.8 < 1.2 < quantiles[-1]
    assert stepped.scatter("colocated") == pytest.approx([1.0] * len(quantiles))  # exactly at its own fit
    # D's prompts ran exactly at 0.8 of PROMPT_FIT; their fit scales P's, which the scatter bent a little
    assert 0.85 < min(stepped.scatter("decode")) <= max(stepped.scatter("decode")) < 1.15
    assert calibration.load(stepped.save(tmp_path / "scattered.json")) == stepped
    saved = json.loads((tmp_path / "scattered.json").read_text())
    for junk in ([], "wide", {"prefill": []}, {"prefill": [0.0, 1.0]}, {"prefill": [1.0, float("inf")]},
                 {"prefill": [True]}, {"prefill": [1.0] * 1001}, {"prefil": [1.0]}):
        (tmp_path / "bad.json").write_text(json.dumps({**saved, "step_scatter": junk}))
        with pytest.raises(fit.CalibrationError, match="step_scatter must map"):
            calibration.load(tmp_path / "bad.json")
    del saved["step_scatter"]  # saved before the field: every step takes the fit's time
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert calibration.load(tmp_path / "old.json").scatter("prefill") == []


def test_prompt_steps_draw_their_times_from_the_scatter_seeded_and_a_small_workload_is_simulated_again(cost_model):
    workload, leg = agent_sessions(4, 3), LEGS["pd/P-cache-off"]
    scattered = replace(cost_model, step_scatter={"prefill": [0.5, 1.0, 2.0]})

    def ttfts(model: calibration.Calibration, seed: int = 0) -> list[float]:
        return [r.ttft_ms for r in Simulation(workload, leg, Deployment(), model, seed).run().results]
    assert ttfts(scattered, 1) == ttfts(scattered, 1) != ttfts(scattered, 2)
    assert ttfts(replace(scattered, step_scatter={"prefill": [1.0]})) == ttfts(cost_model)
    # A workload of few turns is simulated MAX_REPLICATIONS times, each figure the median of the simulations';
    # one of many turns, or without a scatter, once.
    assert predict.replications(workload, scattered) == predict.MAX_REPLICATIONS
    assert predict.replications(workload, cost_model) == 1
    assert predict.replications(workload, replace(cost_model, step_scatter={"prefill": [1.0, 1.0]})) == 1
    assert predict.replications(agent_sessions(predict.SCATTER_TURNS, 1), scattered) == 1
    p50s = [predict.predict(Simulation(workload, leg, Deployment(), scattered, seed)).ttft_p50_ms
            for seed in range(predict.MAX_REPLICATIONS)]
    assert simulate(workload, leg, Deployment(), scattered).ttft_p50_ms == statistics.median(p50s)
    assert len(set(p50s)) > 1


def test_the_time_outside_compute_and_transfer_leaves_out_the_queue_p_reported():
    request = {"conversation_id": "c", "turn": 1, "start_time_ms": 0.0, "ttft_ms": 300.0, "latency_ms": 400.0,
               "input_num_tokens": 1000, "output_num_tokens": 8, "prompt_tokens_computed_prefill": 1000,
               "prefill_compute_ms": 150.0, "first_token_from": "prefill", "queue_ms": 120.0}
    assert rows_of({"legs": {"pd/P-cache-off": {"requests": [request]}}})[0].other_ms == pytest.approx(30.0)
    for junk in (None, "120", float("nan"), -5.0, True, 1e300):
        row = rows_of({"legs": {"pd/P-cache-off": {"requests": [{**request, "queue_ms": junk}]}}})[0]
        assert row.queue_ms == 0.0 and row.other_ms == pytest.approx(150.0)
    # Computed on D: D's own wait for its steps (its first token less its read and compute) is left out too.
    on_decode = {**request, "queue_ms": None, "prefill_compute_ms": None, "first_token_from": "decode",
                 "decode_ttft_ms": 280.0, "decode_compute_ms": 200.0, "p_to_d_read_ms": 0.0}
    assert rows_of({"legs": {"compute-on-D": {"requests": [on_decode]}}})[0].other_ms == pytest.approx(20.0)
    # D's wait is not the simulation's when D only read P's blocks (the first token not sent ahead): it stays.
    read_only = {**request, "first_token_from": "decode", "decode_ttft_ms": 40.0, "decode_compute_ms": 0.0,
                 "p_to_d_read_ms": 10.0}
    assert rows_of({"legs": {"pd/P-cache-off": {"requests": [read_only]}}})[0].other_ms == pytest.approx(20.0)
    # With the engine's own wait recorded, only that wait (less a read from D, done before the prompt's first step)
    # is a queue: the workers' tokenizing and handling stay in the time outside compute and transfer.
    def other(leg: str, **fields) -> float:
        return rows_of({"legs": {leg: {"requests": [{**request, **fields}]}}})[0].other_ms
    assert other("pd/P-cache-off", engine_wait_ms=112.0) == pytest.approx(38.0)
    assert other("bidir/P-cache-off", d_to_p_read_ms=20.0, queue_ms=100.0, engine_wait_ms=50.0) == pytest.approx(100.0)
    assert other("compute-on-D", **{**on_decode, "decode_engine_wait_ms": 50.0}) == pytest.approx(50.0)
    for junk in (None, "5", float("nan"), -1.0, True):
        assert other("pd/P-cache-off", engine_wait_ms=junk) == pytest.approx(30.0)
        assert other("compute-on-D", **{**on_decode, "decode_engine_wait_ms": junk}) == pytest.approx(20.0)


def test_the_time_outside_compute_is_a_line_through_the_median_of_each_load():
    scatter = (0.8, 0.9, 1.0, 1.1, 1.2, 1.0)
    samples = [(load, (8.0 + 2.0 * load) * factor) for load in range(4) for factor in scatter]
    samples += [(load, 150.0) for load in range(4)]  # first turns' long prompts, tokenized and sent
    samples += [(9, 500.0)] * (fit.MIN_FIT_SAMPLES - 1)  # too few at that load to count
    assert fit.fit_other(samples)[:2] == pytest.approx((8.0, 2.0), rel=0.1)
    assert fit.fit_other(samples)[2] == 3  # the highest load with enough requests
    assert fit.fit_other([(3, ms) for ms in (10.0, 11.0, 30.0)]) == (11.0, 0.0, 0)  # one load: its median
    assert fit.fit_other([(load, 20.0 - load) for load in range(4) for _ in range(5)])[1] == 0.0  # never negative


def test_a_turns_time_outside_compute_grows_with_the_turns_in_flight_beside_it(cost_model):
    leg = LEGS["pd/P-cache-off"]
    loaded = replace(cost_model, other_ms_per_request={leg.name: 40.0}, other_load_seen=2.0)

    def ttfts(workload, model: calibration.Calibration) -> list[float]:
        return [r.ttft_ms for r in Simulation(workload, leg, Deployment(), model).run().results]
    alone = agent_sessions(1, 3)
    assert ttfts(alone, loaded) == ttfts(alone, cost_model)
    # Sessions 0.2 s apart, each a short prompt and a long answer: each finds P idle and those before it decoding,
    # and its turn takes 40 ms more for each, up to two.
    staggered = Workload("staggered", [Session(f"s{i}", [TurnDemand(100, 500, 0, 0.0)], 0.2 * i) for i in range(4)])
    added = [b - a for a, b in zip(ttfts(staggered, cost_model), ttfts(staggered, loaded))]
    assert added == pytest.approx([0.0, 40.0, 80.0, 80.0])


def test_a_decode_step_beside_the_other_roles_prompts_gains_the_fitted_ms():
    samples = [(batch, longest, busy, 1.0 + 0.5 * batch + 3.5 * batch * longest / 1e3 + 2.0 * busy)
               for batch in (1, 2, 4, 8) for longest in (1000, 4000, 9000) for busy in (0.0, 0.5, 1.0)]
    assert fit.fit_decode_steps(samples) == (pytest.approx(DECODE_STEP), pytest.approx(2.0))


def test_a_decode_step_fit_runs_through_the_median_of_scattered_steps():
    scatter = (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3)
    samples = [(batch, longest, 0.0, scatter[(batch + longest // 1000) % 7] * (1.0 + 0.5 * batch + 3.5 * batch *
                                                                               longest / 1e3))
               for batch in (1, 2, 3, 4, 6, 8) for longest in range(1000, 9001, 1000)]
    (a, b, k), _ = fit.fit_decode_steps(samples)
    ratios = [ms / (a + b * batch + k * batch * longest / 1e3) for batch, longest, _, ms in samples]
    assert statistics.median(ratios) == pytest.approx(1.0)


def test_a_decode_step_fit_weighs_errors_relatively_so_a_few_long_steps_do_not_decide_the_short_ones():
    true = lambda batch, longest: 1.0 + 0.5 * batch + 3.5 * batch * longest / 1e3  # noqa: E731
    short = [(batch, longest, 0.0, true(batch, longest)) for batch in (1, 2) for longest in (500, 1000, 1500)] * 3
    samples = short + [(8, 9000, 0.0, true(8, 9000) * scatter) for scatter in (0.7, 1.3, 1.4)]

    def worst(step: tuple[float, float, float]) -> float:
        a, b, k = step
        return max(abs((a + b * batch + k * batch * longest / 1e3) / ms - 1) for batch, longest, _, ms in short)
    assert worst(fit.fit_decode_steps(samples)[0]) < 0.04
    x = np.array([[1.0, batch, batch * longest / 1e3, busy] for batch, longest, busy, _ in samples])
    assert worst(fit._decode_step_lstsq(x, np.array([ms for *_, ms in samples]))[0]) > 0.08  # absolute: 9% off


def test_a_colocated_decode_step_takes_ds_shape_with_its_own_fixed_cost():
    # A calibration run's colocated leg decodes batches of 1-4 at nearly one longest context (8.8-9.2k tokens, times
    # scattered by 5%): its own steps cannot tell a request's cost from its attention's. Its worker is D's engine on
    # more cores: its fixed cost and one scale of D's other terms are fitted, and a batch of 8 at 2.5k tokens, which
    # the run never saw, comes out as it runs.
    _, b, k = DECODE_STEP
    true = lambda batch, longest: 9.0 + 0.6 * (b * batch + k * batch * longest / 1e3)  # noqa: E731
    scatter = (0.95, 1.05, 1.0, 0.97, 1.03)
    samples = [(batch, longest, 0.0, scatter[i % 5] * true(batch, longest))
               for i, (batch, longest) in enumerate((batch, longest) for batch in (1, 2, 3, 4)
                                                    for longest in (8800, 9000, 9200))]
    own, per_request, attention = fit.fit_colocated_decode_steps(samples, DECODE_STEP)
    assert per_request / attention == pytest.approx(b / k)
    predicted = own + per_request * 8 + attention * 8 * 2500 / 1e3
    assert predicted == pytest.approx(true(8, 2500), rel=0.05)
    alone, _ = fit.fit_decode_steps(samples)  # fitted to its own steps alone: 1.6x
    assert alone[0] + alone[1] * 8 + alone[2] * 8 * 2500 / 1e3 > 1.3 * true(8, 2500)
    assert fit.fit_colocated_decode_steps(samples, (1.0, 0.0, 0.0)) == pytest.approx(alone)  # no shape to borrow


def test_steps_in_service_calibrate_only_when_every_leg_kept_them_for_every_worker(cost_model):
    results = with_worker_steps(json.loads(FIXTURE.read_text()))
    del results["legs"]["bidir/P-cache-on"]["worker_steps"]["decode"]  # a worker that did not answer
    assert replace(calibration.Calibration(**fit.fitted(results)), source=cost_model.source) == cost_model


def test_too_few_prompt_steps_of_p_calibrate_from_the_requests():
    results = with_worker_steps(json.loads(FIXTURE.read_text()))
    results["legs"] = {"bidir/P-cache-off": results["legs"]["bidir/P-cache-off"]}
    results["legs"]["bidir/P-cache-off"]["worker_steps"]["prefill"] = worker_steps(
        1.0, DECODE_STEP, 1000.0, True, False)[:fit.MIN_FIT_SAMPLES - 1]
    without = json.loads(json.dumps(results))
    del without["legs"]["bidir/P-cache-off"]["worker_steps"]
    assert fit.fitted(results) == fit.fitted(without)


def test_too_few_prompt_steps_of_d_leave_it_computing_prompts_as_p_does():
    results = with_worker_steps(json.loads(FIXTURE.read_text()))
    steps = results["legs"]["compute-on-D"]["worker_steps"]
    steps["decode"] = [s for s in steps["decode"] if not s["prompts"]] + [
        s for s in steps["decode"] if s["prompts"]][:fit.MIN_FIT_SAMPLES - 1]
    stepped = calibration.Calibration(**fit.fitted(results))
    assert "decode" not in stepped.compute_fits
    assert stepped.prefill_ms(300, 4400, "decode") == stepped.prefill_ms(300, 4400)


def test_prompts_computed_in_the_same_steps_calibrate_as_one_sample_paying_the_fixed_cost_once():
    def row(conversation: str, start_ms: float, tokens: int, compute_ms: float) -> Row:
        return Row("pd/P-cache-off", conversation, 0, start_ms, compute_ms + 5, compute_ms + 50, tokens, 8, 6.0,
                   tokens, compute_ms, 0.0, 0.0, 0.0, 0, 0, 0)
    # d took as long as a and b's shared steps, but seconds later: steps of its own
    rows = [row("a", 0.0, 1000, 300.0), row("b", 0.0, 2000, 300.0), row("c", 1000.0, 500, 90.0),
            row("d", 5000.0, 700, 300.0)]
    samples = fit.compute_samples({"pd/P-cache-off": rows})["prefill"]
    assert sorted((chunks, ms) for chunks, ms, _, _ in samples) == [(((500, 0),), 90.0), (((700, 0),), 300.0),
                                                                    (((1000, 0), (2000, 0)), 300.0)]
    terms = a, b, c, q = (10.0, 0.1, 0.08, 0.05)
    together = fit.predict_compute(terms, ((1000, 100), (2000, 0)))
    assert together == pytest.approx(a + b * 3000 + c * 1000 * 100 / 1e3 + q * (1000 * 500 + 2000 * 1000) / 1e3)


def test_a_prompt_computed_on_decode_calibrates_with_the_tokens_d_said_it_computed():
    # Turn 1 extends turn 0 (1000 prompt + 40 answer) by 200 tokens. D retained 1024 tokens in full blocks; it said
    # it computed 420 (its answer came back as other tokens). Without its count the fit assumes 1240 - 1024.
    request = {"conversation_id": "a", "ttft_ms": 300.0, "latency_ms": 400.0, "input_num_tokens": 1000,
               "output_num_tokens": 40, "prompt_tokens_computed_prefill": 1000, "prefill_compute_ms": 250.0}
    on_decode = {**request, "turn": 1, "start_time_ms": 1000.0, "input_num_tokens": 1240, "decode_compute_ms": 90.0,
                 "prompt_tokens_computed_prefill": None, "prefill_compute_ms": None}

    def computed_on_decode(told) -> tuple:
        rows = rows_of({"legs": {"compute-on-D": {"requests": [request, {**on_decode, **told}]}}})
        (chunks, _, _, _), = fit.compute_samples({"compute-on-D": rows})["decode"]
        return chunks

    assert computed_on_decode({"decode_tokens_computed": 420}) == ((420, 820),)
    assert computed_on_decode({}) == ((216, 1024),)
    for junk in (0, 5000, -3, 2.5, True, "420"):  # not a count of this prompt's tokens: the estimate stands
        assert computed_on_decode({"decode_tokens_computed": junk}) == ((216, 1024),)


def test_a_prompt_step_after_idling_takes_the_ms_measured_on_requests_that_started_idle(cost_model):
    # Which prompts found their worker idle: a does; b arrives while a computes and waits behind it (starting right
    # after it, back to back); c shares a's steps; d arrives long after.
    def row(conversation: str, start_ms: float, ttft_ms: float, compute_ms: float) -> Row:
        return Row("pd/P-cache-off", conversation, 0, start_ms, ttft_ms, ttft_ms + 50, 1000, 8, 6.0,
                   1000, compute_ms, 0.0, 0.0, 0.0, 0, 0, 0)
    rows = [row("a", 0.0, 305.0, 300.0), row("b", 100.0, 305.0, 100.0), row("c", 3.0, 302.0, 300.0),
            row("d", 1000.0, 125.0, 120.0)]
    samples = fit.compute_samples({"pd/P-cache-off": rows})["prefill"]
    assert sorted((ms, idle) for _, ms, _, idle in samples) == [(100.0, False), (120.0, True), (300.0, True)]
    # Steps back to back (the workers' start-up steps, prompts queued behind others) against prompts started idle
    # 12 ms longer, whatever their size; a prompt computed beside D's decodes (busy) says nothing about idling.
    terms = cost_model.compute_fits["prefill"]
    shapes = [((n, context),) for n in (200, 500, 1000, 3000) for context in (0, 2000, 6000)]
    start_up = [(chunks, fit.predict_compute(terms, chunks), 0.0) for chunks in shapes[::2]]
    requests = [(chunks, fit.predict_compute(terms, chunks) + (12.0 if idle else 0.0), 0.0, idle)
                for i, chunks in enumerate(shapes) for idle in (i % 2 == 0, i % 3 == 0)]
    requests.append((shapes[0], fit.predict_compute(terms, shapes[0]) * 3, 0.9, True))
    assert fit.idle_step_ms(requests, start_up) == pytest.approx(12.0)
    assert fit.idle_step_ms([r for r in requests if not r[3]], start_up) == 0.0  # none started idle
    # Idle-started prompts count in the fit less those ms: a run whose every prompt took 20 ms more than its
    # workers' start-up steps, all of them found P idle, fits those steps.
    results = json.loads(FIXTURE.read_text())
    fitted_once = calibration.Calibration(**fit.fitted(results))
    timed = ((512, 0), (2048, 0), (4096, 0), (256, 2048), (256, 4096))
    for run in results["legs"].values():
        run["worker_calibration"] = {"prefill": [{"new_tokens": n, "context_tokens": c,
                                                  "ms": fitted_once.prefill_ms(n, c) - 20.0} for n, c in timed]}
    refitted = calibration.Calibration(**fit.fitted(results))
    assert refitted.idle_step_ms == pytest.approx(20.0, rel=0.1)
    for n, context in ((512, 0), (256, 2048), (256, 4096)):  # short prompts, whose time the idle ms weigh most in
        back_to_back = refitted.prefill_ms(n, context)
        assert back_to_back < fitted_once.prefill_ms(n, context) - 10.0
        assert refitted.after_idle_ms(back_to_back, False) == pytest.approx(fitted_once.prefill_ms(n, context), rel=0.1)

    one = Workload("one", [Session("s", [TurnDemand(3000, 32, 0)], 0.0), Session("t", [TurnDemand(2000, 32, 0)], 0.0)])
    ttft = {ms: sorted(r.ttft_ms for r in Simulation(one, LEGS["pd/P-cache-off"], Deployment(),
                                                     replace(cost_model, idle_step_ms=ms)).run().results)
            for ms in (0.0, 30.0)}
    assert ttft[30.0][0] - ttft[0.0][0] == pytest.approx(30.0)  # alone in P's first step
    assert ttft[30.0][1] - ttft[0.0][1] == pytest.approx(30.0)  # its own step followed: back to back


def test_a_prompt_p_starts_idle_while_d_is_busy_costs_fixed_ms_beyond_the_fit(cost_model):
    # P's prompts: back to back with D quiet on the fit; back to back with D busy 1.1x; started idle with D busy 15 ms
    # beyond the fit, whatever their size (a step reloading what D's decodes pushed out of the caches).
    terms = cost_model.compute_fits["prefill"]
    shapes = [((n, context),) for n in (200, 500, 1000, 3000) for context in (0, 2000, 6000)]
    points = [(chunks, fit.predict_compute(terms, chunks), 0.0, False) for chunks in shapes]
    points += [(chunks, fit.predict_compute(terms, chunks) * 1.1, 1.0, False) for chunks in shapes[::2]]
    points += [(chunks, fit.predict_compute(terms, chunks) + 15.0, 1.0, True) for chunks in shapes[1::2]]
    base, slowdown, busy_idle_ms = fit.fit_with_contention(points, idle_ms=0.0)
    assert slowdown == pytest.approx(0.1, rel=0.02) and busy_idle_ms == pytest.approx(15.0, rel=0.02)
    assert fit.fit_with_contention(points[:-len(shapes[1::2])], idle_ms=0.0)[2] is None  # none started idle
    # The simulation: P's first step after idling, with D decoding a long answer meanwhile, takes the fit + 15 ms.
    model = replace(cost_model, busy_idle_step_ms=15.0, idle_step_ms=0.0)
    later = Workload("w", [Session("d", [TurnDemand(500, 400, 0)], 0.0), Session("p", [TurnDemand(3000, 2, 0)], 0.5)])
    ttft = {}
    for deployment in (Deployment(one_host=True), Deployment()):
        results = Simulation(later, LEGS["pd/P-cache-off"], deployment, model).run().results
        ttft[deployment.one_host] = next(r.ttft_ms for r in results if r.session == 1)
    assert ttft[True] - ttft[False] == pytest.approx(15.0, abs=0.5)


def test_a_colocated_prompt_step_counts_without_the_decodes_it_ran_beside():
    # a decodes from 100 to 1100 ms; b's prompt (200 new tokens on 800 of history) computes in one step at 510-560,
    # beside a's decode (batch 1, 2016 tokens of context): the simulation adds that decode's step to a colocated
    # worker's prompt steps itself, so b's sample is its step less one decode step by the colocated step fit.
    def row(conversation: str, start_ms: float, ttft_ms: float, latency_ms: float, tokens: int, computed: int,
            compute_ms: float) -> Row:
        return Row("colocated", conversation, 0, start_ms, ttft_ms, latency_ms, tokens, 32, 10.0, computed,
                   compute_ms, 0.0, 0.0, 0.0, 0, 0, 0)
    rows = {"colocated": [row("a", 0.0, 100.0, 1100.0, 2000, 2000, 95.0),
                          row("b", 500.0, 60.0, 200.0, 1000, 200, 50.0)]}
    step = (5.0, 0.0, 2.0)
    samples = sorted(ms for _, ms, _, _ in fit.compute_samples(rows, step)["colocated"])
    assert samples == pytest.approx([50.0 - (5.0 + 2.0 * 2.016), 95.0])
    assert sorted(ms for _, ms, _, _ in fit.compute_samples(rows)["colocated"]) == [50.0, 95.0]


def test_a_colocated_worker_has_its_own_decode_step_less_the_prompts_it_computed_meanwhile(cost_model):
    def row(conversation: str, start_ms: float, tokens: int, output: int, ttft_ms: float, step_ms: float,
            stalled_ms: float = 0.0) -> Row:
        latency = ttft_ms + (output - 1) * step_ms + stalled_ms
        return Row("colocated", conversation, 0, start_ms, ttft_ms, latency, tokens, output,
                   (latency - ttft_ms) / max(output - 1, 1) if output > 1 else None, tokens, ttft_ms - 10, 0.0, 0.0,
                   0.0, 0, 0, 0)

    def step(tokens: int, output: int) -> float:  # a colocated step: 5 ms + 2 ms per 1k tokens of context
        return 5.0 + 2.0 * (tokens + output / 2) / 1e3
    rows = [row(f"alone-{i}", i * 10_000.0, 1000 * (i + 1), 33, 110.0, step(1000 * (i + 1), 33)) for i in range(5)]
    # One decode stalled 200 ms while another request's prompt was computed: that is not its step time.
    rows.append(row("stalled", 60_000.0, 3000, 33, 110.0, step(3000, 33), stalled_ms=200.0))
    rows.append(row("prompt", 60_200.0, 2500, 1, 210.0, 0.0))  # its prompt computed for 200 ms
    assert fit.fit_colocated_step({"colocated": rows}) == pytest.approx((5.0, 0.0, 2.0), abs=1e-6)
    assert fit.fit_colocated_step({"colocated": rows[:3]}) is None  # too few to fit
    assert fit.fit_colocated_step({"pd/P-cache-on": rows}) is None  # D's steps are fitted apart
    fitted_ = replace(cost_model, colocated_step_fit=(5.0, 0.0, 2.0))
    assert fitted_.step_fit("colocated") == (5.0, 0.0, 2.0)
    assert fitted_.step_fit("decode") == fitted_.step_fit("prefill") == cost_model.decode_step_fit
    assert replace(cost_model, colocated_step_fit=None).step_fit("colocated") == cost_model.decode_step_fit


def test_the_share_of_an_answer_the_next_turn_reuses_is_fitted_to_where_reuse_ended():
    # Sixteen conversations of two turns whose first prompts fall at every offset within a 16-token block: the
    # second turn reused the first prompt and `share` of its 40-token answer, in the full blocks D retained. P read
    # all of that from D, or (`local`) had the first prompt's blocks in its own cache and read only the rest.
    def rows(share: float, local: bool = False, edited: str = "") -> list[Row]:
        made = []
        for i in range(16):
            first = 1000 + 37 * i
            # An edit that resends less than the history, or one within it (as the bench's edited-history scenario
            # revises the first user message and adds a new one), ends reuse at the edit.
            second = {"": first + 40 + 150, "shorter": first - 300, "within": first + 40 + 160}[edited]
            reused = min(first + int(share * 40), first + 39) // 16 * 16 if not edited else 512
            read = reused - (first // 16 * 16 if local else 0)
            for turn, tokens, computed, from_decode in ((0, first, first, 0), (1, second, second - reused, read)):
                made.append(Row("bidir/P-cache-off", f"c{i}", turn, 0.0, 50.0, 60.0, tokens, 40, None, computed,
                                40.0, 0.0, 1.0 if from_decode else 0.0, 0.0, from_decode * 100, 0, from_decode))
        return made
    for share in (0.0, 0.5, 1.0):
        assert fit.answer_reuse_share([rows(share)]) == share
        if share:  # (with none of the answer reusable, P had it all and read nothing)
            assert fit.answer_reuse_share([rows(share, local=True)]) == share  # where reuse ended, not the read
        for edited in ("shorter", "within"):  # an edited history's reuse ends at the edit: it says nothing of answers
            edits = [replace(r, leg="edits") for r in rows(0.0, edited=edited)]
            assert fit.answer_reuse_share([rows(share) + edits]) == share
    # A turn pairs only with the turn before it in its own run: split over two runs, no turn read after another.
    assert fit.answer_reuse_share([rows(0.0)[0::2], rows(0.0)[1::2]]) is None
    assert fit.answer_reuse_share([rows(1.0, edited="shorter")]) is None
    assert fit.answer_reuse_share([rows(1.0, edited="within")]) is None
    # An answer whose text came back as 12 of its 40 tokens, with a 5-token user message: the next prompt is shorter
    # than the previous prompt and answer as generated, yet extends the history as resent, and counts
    # (173 tokens fewer, all of them after where reuse ended: P computed that many fewer).
    short = [replace(r, answer_text_tokens=12) if r.turn == 0 else
             replace(r, input_tokens=r.input_tokens - 173, computed=r.computed - 173) for r in rows(0.0)]
    assert fit.answer_reuse_share([short]) == 0.0
    assert fit.answer_reuse_share([[replace(r, answer_text_tokens=None) for r in short]]) is None  # not counted


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_an_answer_resent_as_other_tokens_is_computed_again_on_p(cost_model, share, monkeypatch):
    # The second turn resends the first prompt and its 32-token answer: with none of the answer reusable, P reads
    # the first prompt's full blocks only and computes the answer again with the new tokens.
    workload = agent_sessions(1, 2, think_s=0.5)
    first, second = workload.sessions[0].turns
    sim = Simulation(workload, LEGS["bidir/P-cache-off"], Deployment(),
                     replace(cost_model, answer_reuse_share=share)).run()
    answer = first.output_tokens
    reused = sim.results[1].reused_tokens
    assert reused == (first.prompt_tokens + int(share * answer)) // 16 * 16
    assert trace.reusable(first, second, share) == first.prompt_tokens + int(share * answer)
    # P computed the rest: the answer again where none of it was reusable, with the new tokens.
    again = replace(cost_model, answer_reuse_share=share, step_scatter={})
    lone = Simulation(Workload("one", [Session("s", [first, second])], 1), LEGS["bidir/P-cache-off"],
                      Deployment(), again)
    computed, submit = [], StepLoop.submit_prefill
    monkeypatch.setattr(StepLoop, "submit_prefill", lambda loop, job: (computed.append(job.prefill_tokens),
                                                                        submit(loop, job))[1])
    lone.run()
    assert computed[1] == second.prompt_tokens - (first.prompt_tokens + int(share * answer)) // 16 * 16
    edited = replace(second, shared_tokens=100)  # an edited history shares what it says, whatever the answers did
    assert trace.reusable(first, edited, share) == 100


def test_a_zero_ttl_never_reuses_and_a_recompute_leg_retains_nothing(cost_model):
    workload = agent_sessions(6, 4)
    expired = simulate(workload, LEGS["bidir/P-cache-off"], Deployment(decoder_kv_blocks_ttl_s=0.0), cost_model)
    assert expired.reuse_share == 0.0
    assert simulate(workload, LEGS["pd/P-cache-off"], Deployment(), cost_model).peak_retained_mib == 0.0
    reused = simulate(workload, LEGS["bidir/P-cache-off"], Deployment(), cost_model)
    assert reused.reuse_share == 1.0 and reused.later_ttft_p50_ms < expired.later_ttft_p50_ms


def test_a_bigger_retention_budget_never_lowers_the_reuse_share(cost_model):
    workload = agent_sessions(12, 4, think_s=2.0)
    shares = [simulate(workload, LEGS["bidir/P-cache-off"], Deployment(retained_kv_budget_mb=budget), cost_model)
              for budget in (1, 8, 32, 64, None)]
    assert [s.reuse_share for s in shares] == sorted(s.reuse_share for s in shares)
    assert shares[0].reuse_share < shares[-1].reuse_share
    assert all(s.peak_retained_mib <= budget for s, budget in zip(shares, (1, 8, 32, 64)))


def test_a_lease_that_ends_before_the_next_turn_is_not_read(cost_model):
    workload = agent_sessions(4, 3, think_s=30.0)
    short = simulate(workload, LEGS["bidir/P-cache-off"], Deployment(decoder_kv_blocks_ttl_s=20.0), cost_model)
    long = simulate(workload, LEGS["bidir/P-cache-off"], Deployment(decoder_kv_blocks_ttl_s=60.0), cost_model)
    assert short.reuse_share == 0.0 and long.reuse_share == 1.0


def test_a_request_joining_running_decodes_takes_every_one_of_its_own_steps(cost_model):
    # D decodes one long answer in runs of many steps at once; a second request joins in the middle of such a run. Its
    # 20 steps start after the step in progress: none of the run's steps before it joined count as its own.
    sim = Simulation(Workload("none", [], None), LEGS["pd/P-cache-off"], Deployment(), cost_model)
    decode, finished = sim.decode[0], {}
    for name, steps, at_s in (("long", 400, 0.0), ("short", 20, 0.5)):
        job = Job(0, 2000, steps, on_finished=lambda job, now, name=name: finished.setdefault(name, now))
        sim.at(at_s, decode.submit_decode, job)
    sim.run()
    # the two contexts add up to 4000-4800 tokens meanwhile, the longest 2000-2400
    fewest_ms = decode._segment_ms(20, 2, 4000, 2000)
    most_ms = decode._segment_ms(1, 1, 2400, 2400) + decode._segment_ms(20, 2, 4800, 2400)  # with the step in progress
    assert fewest_ms / 1e3 <= finished["short"] - 0.5 <= most_ms / 1e3
    assert finished["long"] > finished["short"]


def test_a_padded_decode_step_costs_the_batch_times_its_longest_context_until_the_longest_finishes(cost_model):
    # A long history (8000 tokens, 50 steps) and a short one (1000, 200 steps) decode together: while both run,
    # every step attends to 2 x the longest; after the long one finishes, the short one's own context alone.
    padded = replace(cost_model, decode_step_fit=(1.0, 0.5, 2.0), decode_step_padded=True)
    sim = Simulation(Workload("none", [], None), LEGS["pd/P-cache-off"], Deployment(), padded)
    decode, finished = sim.decode[0], {}
    for name, prompt, steps in (("long", 8000, 50), ("short", 1000, 200)):
        job = Job(0, prompt, steps, on_finished=lambda job, now, name=name: finished.setdefault(name, now))
        sim.at(0.0, decode.submit_decode, job)
    sim.run()
    # The short one joins after the long one's first step, shares 49 steps with it, then takes 151 alone.
    steps_ms = padded.decode_steps_ms
    alone, together = steps_ms("decode", 1, 1, 8000, 8000), steps_ms("decode", 49, 2, 9001, 8001)
    assert finished["long"] == pytest.approx((alone + together) / 1e3)
    assert finished["short"] == pytest.approx((alone + together + steps_ms("decode", 151, 1, 1049, 1049)) / 1e3)
    assert together > replace(padded, decode_step_padded=False).decode_steps_ms("decode", 49, 2, 9001, 8001)
    # The most it reached: the last of the 49 steps together, two requests padded to the long one's 8049 tokens.
    assert sim.reached["decode_batch"] == 2 and sim.reached["decode_attended"] == 2 * (8001 + 48)


def test_the_simulation_is_deterministic_and_serves_every_turn(cost_model):
    workload = agent_sessions(40, 5, clients=None)
    deployment = Deployment(num_prefill=2, num_decode=3, one_host=True)
    first, second = (simulate(workload, LEGS["adaptive"], deployment, cost_model) for _ in range(2))
    assert first == second and first.turns == 200 and sum(first.paths.values()) == 200


def test_the_simulated_router_picks_workers_as_the_routers_own_least_loaded(cost_model, monkeypatch):
    picks = []

    def both(pool: RouterPool) -> int:
        index = least_loaded(pool)
        real = pool.pool.least_loaded()  # kvturn/router/workers.py, on the simulated clock
        picks.append((pool.workers[index].backlog_ms(pool.sim.now), pool.workers[index].in_flight,
                      real.backlog_ms(pool.sim.now), real.in_flight))
        return index

    least_loaded = RouterPool.least_loaded
    monkeypatch.setattr(RouterPool, "least_loaded", both)
    workload = agent_sessions(30, 4, think_s=0.2, clients=None)
    for leg in ("adaptive", "pd/P-cache-off"):
        simulate(workload, LEGS[leg], Deployment(num_prefill=3, num_decode=3, one_host=True), cost_model)
    assert len(picks) > 120 and any(p[0] > 0 for p in picks)  # some picks were among backlogged workers
    assert all(mine[:2] == pytest.approx(real) for mine, real in ((p[:2], p[2:]) for p in picks))


def test_plan_json_has_every_leg_under_the_bench_names(cost_model, tmp_path):
    workload = agent_sessions(6, 3)
    plan = planner.plan(workload, cost_model, Deployment(), list(LEGS), "pull", False, [60.0])
    json_path, html_path = report.write(plan, tmp_path)
    saved = json.loads(json_path.read_text())
    assert set(saved["legs"]) == set(LEGS)
    assert all(PLAN_FIELDS <= set(values) for values in saved["legs"].values())
    assert saved["verdict"]["text"].startswith("On this workload") and saved["left_out"]
    assert {p["ttl_s"] for p in saved["sweep"]["points"]} == {60.0, 480.0}
    assert "On this workload" in html_path.read_text()


def test_a_plan_names_the_shapes_its_steps_reach_beyond_the_calibration(cost_model):
    workload = agent_sessions(6, 3)  # four sessions at a time: decode batches of up to 4
    narrow = replace(cost_model, seen={"decode_batch": 2.0, "prompt_tokens": 1e6})
    plan = planner.plan(workload, narrow, Deployment(), ["pd/P-cache-on"], "pull", True, [], ())
    assert set(plan["beyond_calibration"]) == {"decode_batch"}
    assert 2.2 < plan["beyond_calibration"]["decode_batch"]["planned"] <= 4
    assert "extrapolated" in plan["verdict"]["text"] and "decode steps run up to" in plan["verdict"]["text"]
    for seen in ({"decode_batch": 64.0, "prompt_tokens": 1e6}, {}):  # within what it measured, or it did not say
        plan = planner.plan(workload, replace(cost_model, seen=seen), Deployment(), ["pd/P-cache-on"], "pull", True,
                            [], ())
        assert plan["beyond_calibration"] == {} and "extrapolated" not in plan["verdict"]["text"]


def test_reuse_pays_above_a_history_length_by_the_calibrated_costs(cost_model):
    threshold = planner.break_even_history(cost_model, 200, "pd/P-cache-off", "bidir/P-cache-off")
    assert threshold is not None and threshold % 16 == 0
    slow_reuse = replace(cost_model, other_ms={"pd/P-cache-off": 0.0, "bidir/P-cache-off": 1e9})
    assert planner.break_even_history(slow_reuse, 200, "pd/P-cache-off", "bidir/P-cache-off") is None


def test_the_router_traces_each_finished_turn_for_the_planner(tiny_model_dir, tmp_path):
    path = tmp_path / "trace.jsonl"
    with LocalStack(tiny_model_dir, kv_cache_mb=64, router_args=["--trace-out", str(path)],
                    log_dir=tmp_path / "logs") as stack:
        _, results = conversation(stack.url, 3, conversation_id="agent-007")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3
    assert {line["conversation_id"] for line in lines} == {lines[0]["conversation_id"]} != {"agent-007"}
    assert [line["prompt_tokens"] for line in lines] == [r["usage"]["prompt_tokens"] for r in results]
    assert all(line["output_tokens"] == 16 and line["timestamp"] <= line["finished"] for line in lines)
    workload = trace.load(path, lambda: "unused", 0, 1)
    assert [t.shared_tokens > 0 for t in workload.sessions[0].turns] == [False, True, True]


def test_the_plan_command_refuses_bad_files_with_a_usage_error(tmp_path):
    runner = CliRunner()
    bad_trace = write_lines(tmp_path / "bad.jsonl", ['{"timestamp": 1}'])
    not_json = tmp_path / "calibration.json"
    not_json.write_text("{oops")
    cases = [
        (["--workload", str(tmp_path / "missing.json"), "--calibration", str(FIXTURE)], "no such file"),
        (["--workload", str(bad_trace), "--calibration", str(FIXTURE)], "bad.jsonl:1"),
        (["--workload", str(bad_trace), "--calibration", str(not_json)], "cannot read a calibration"),
        (["--scenario", "sweep", "--calibration", str(FIXTURE), "--policy", "teleport"], "policy must be one of"),
        (["--calibration", str(FIXTURE)], "give --workload FILE or --scenario NAME"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["plan", *args])
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split())


def said(result) -> str:
    """A command's output as one line, without the box rich draws around an error."""
    return " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize("name, content, message", [
    ("nan.jsonl", '{"timestamp": NaN, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3}',
     "nan.jsonl:1: 'timestamp'"),
    ("huge.jsonl", '{"timestamp": 1e999, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3}',
     "huge.jsonl:1: 'timestamp'"),
    ("long.jsonl", '{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 1000000000000000, "output_tokens": 3}',
     "at most"),
    ("binary.jsonl", b"\xff\xfe\x00", "cannot read the trace"),
    ("strings.json", '[{"messages": ["hi"]}]', "each message must be"),
    ("empty.json", "[]", "the number of conversations must be"),
    ("no-user.json", '[{"messages": [{"role": "system", "content": "x"}]}]', "no conversation with a user turn"),
    ("prompt-input.json", '{"filetype": "generate_conversations", "prompt_input": 5}', "prompt_input and"),
    ("many.json", '{"filetype": "generate_conversations", "num_conversations": 1e9}', "num_conversations must be"),
    ("inf.json", '{"filetype": "kvturn_synthetic", "num_turns": Infinity}', "num_turns: expected a finite number"),
    ("sessions.json", '{"filetype": "kvturn_synthetic", "num_sessions": 1000000000}', "num_sessions must be"),
    ("turns.json", '{"filetype": "kvturn_synthetic", "num_turns": {"distribution": "lognormal", "mean": 30, '
                   '"sigma": 1}}', "num_turns: drew"),
])
def test_the_plan_command_refuses_a_hostile_workload_file_naming_it(tmp_path, monkeypatch, tiny_model_dir, name,
                                                                    content, message):
    monkeypatch.chdir(tmp_path)  # a short path, which the error's box does not break
    Path(name).write_bytes(content if isinstance(content, bytes) else content.encode())
    result = CliRunner().invoke(app, ["plan", "--workload", name, "--calibration", str(FIXTURE), "--model",
                                      str(tiny_model_dir), "--out", "out"])
    assert result.exit_code == 2, (result.output, result.exception)  # a usage error, not a traceback (1)
    assert name in said(result) and message in said(result), result.output


@pytest.mark.parametrize("args, message", [
    (["--sessions", "-1"], "--sessions, --turns and --max-prompt-tokens must be at least 1"),
    (["--turns", "0"], "must be at least 1"),
    (["--kv-cache-mb", "0"], "kv_cache_mb must be positive"),
    (["--retained-kv-budget-mb", "-5"], "retained_kv_budget_mb must be positive"),
    (["--decoder-kv-blocks-ttl-s", "nan"], "decoder_kv_blocks_ttl_s must be positive"),
    (["--decoder-kv-blocks-ttl-s", "3"], "kv_expiry_margin_s must be below decoder_kv_blocks_ttl_s"),
    (["--decoder-kv-blocks-ttl-s", "inf"], "must be finite and above the lease expiry margin"),
    (["--ttls", "nan,60"], "must be finite and above the lease expiry margin"),
    (["--ttls", "2,60"], "must be finite and above the lease expiry margin"),
    (["--calibration", "http://127.0.0.1:80x", "--calibration", "http://127.0.0.1:81x"], "cannot reach the worker"),
])
def test_the_plan_command_refuses_a_deployment_no_worker_would_run(tmp_path, args, message):
    calibrated = [] if "--calibration" in args else ["--calibration", str(FIXTURE)]
    result = CliRunner().invoke(app, ["plan", "--scenario", "sweep", *calibrated, *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in said(result), result.output


def test_a_workload_of_single_turns_plans_to_null_not_nan(cost_model, tmp_path):
    workload = Workload("single", [Session(f"s{i}", [TurnDemand(2000, 16, 0)]) for i in range(3)], 2)
    plan = planner.plan(workload, cost_model, Deployment(), ["pd/P-cache-off"], "pull", False, [60.0])
    assert plan["legs"]["pd/P-cache-off"]["later_ttft_p50_ms"] is None
    assert plan["legs"]["pd/P-cache-off"]["ttft_p50_ms"] > 0
    assert "no session has a second turn" in plan["verdict"]["text"] and "nan" not in plan["verdict"]["text"]
    json_path, _ = report.write(plan, tmp_path)
    json.loads(json_path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in plan.json"))


def test_the_scenario_is_planned_with_the_lease_its_bench_runs_and_the_router_forgets_before_d(cost_model, tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, ["plan", "--scenario", "resume-after-ttl", "--calibration", str(FIXTURE),
                                      "--legs", "bidir/P-cache-off", "--ttls", "60", "--budgets", "", "--out",
                                      str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    deployment = plan["deployment"]
    assert (deployment["decoder_kv_blocks_ttl_s"], deployment["kv_expiry_margin_s"]) == (4.0, 1.0)
    assert deployment["conversation_ttl_s"] == 4.0 * planner.ROUTER_TTL_SHARE
    # The 6 s between turns outlast the 4 s lease: no turn reuses, as the bench's scenario shows.
    assert plan["legs"]["bidir/P-cache-off"]["reuse_share"] == 0.0


def test_a_retention_budget_is_each_decode_workers_and_the_sweep_shares_one_workers_peak(cost_model):
    workload = agent_sessions(12, 4, think_s=2.0, clients=None)
    two = Deployment(num_decode=2, num_prefill=2)
    free = simulate(workload, LEGS["bidir/P-cache-off"], two, cost_model)
    assert free.peak_retained_mib / 2 <= free.peak_retained_mib_per_decode < free.peak_retained_mib
    budget = max(int(free.peak_retained_mib_per_decode * 0.75), 1)
    capped = simulate(workload, LEGS["bidir/P-cache-off"], replace(two, retained_kv_budget_mb=budget), cost_model)
    assert capped.peak_retained_mib_per_decode <= budget < capped.peak_retained_mib
    points = planner.sweep(workload, "bidir/P-cache-off", two, cost_model, [480.0], (0.5,), free)
    assert {p.budget_mib for p in points} == {None, int(free.peak_retained_mib_per_decode * 0.5)}


def test_a_lease_past_its_ttl_leaves_the_peak_whichever_worker_retains_next(cost_model):
    def session(name: str, prompt: int, start_s: float) -> Session:
        return Session(name, [TurnDemand(prompt, 16, 0)], start_s)
    deployment = Deployment(num_decode=2, num_prefill=2, decoder_kv_blocks_ttl_s=10.0)
    # a and b run at once, on a decode worker each; c comes when both leases ended, and retains on one of them
    late = Workload("late", [session("a", 200, 0.0), session("b", 200, 0.0), session("c", 3000, 30.0)])
    alone = Workload("alone", [session("c", 3000, 0.0)])
    leg = LEGS["bidir/P-cache-off"]
    assert simulate(late, leg, deployment, cost_model).peak_retained_mib == \
        simulate(alone, leg, deployment, cost_model).peak_retained_mib


def test_the_router_writes_no_trace_line_the_planner_would_refuse(tmp_path):
    from types import SimpleNamespace
    from kvturn.router.trace_out import TraceOut
    path = tmp_path / "trace.jsonl"
    out = TraceOut(str(path))
    turn = SimpleNamespace(key="public:abc", started=0.0)
    out.record(turn, {"completion_tokens": 4})  # a report without its prompt's counts
    out.record(turn, {"completion_tokens": 4, "prompt_tokens_computed": 30, "prompt_tokens_remote": 96})
    out.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["prompt_tokens"] == 126
    assert trace.load(path, lambda: "unused", 0, 1).sessions[0].turns[0].prompt_tokens == 126


@pytest.mark.parametrize("leg", ["compute-on-D", "bidir/P-cache-off"])
def test_the_simulated_router_learns_how_much_of_a_lease_the_next_prompt_shares(cost_model, leg):
    workload = agent_sessions(4, 4)  # answers of 32 tokens, 200 new ones a turn
    tails = {}
    for share in (0.05, 1.0):
        sim = Simulation(workload, LEGS[leg], Deployment(), replace(cost_model, answer_reuse_share=share,
                                                                    resent_answer_ratio=None)).run()
        assert len(sim.costs.unshared_tail_tokens.values) >= 4 * 3 - 1  # a later turn whose lease was held
        tails[share] = sim.costs.unshared_tail_tokens.value
    # D retains the answer's full blocks; a next prompt that shares 5% of the answer leaves most of them unread
    assert tails[1.0] < 16 <= tails[0.05]
