"""`kvturn plan`: reading workloads and traces, the one calibration (fitted to the workers' steps in service) and its
versioned file, the simulation's invariants, the memory answer per tier, plan.json, the router's --trace-out through
real processes, and the command's errors."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from chat import conversation
from typer.testing import CliRunner

from kvturn.bench.catalog import LEGS
from kvturn.cli import app
from kvturn.launch import LocalStack
from kvturn.plan import calibration, planner, report, trace
from kvturn.plan.predict import simulate
from kvturn.plan.retention import Leases, PrefixCache
from kvturn.plan.sim import Deployment, Simulation
from kvturn.plan.step_samples import Step, parse_step
from kvturn.plan.steps import Job
from kvturn.plan.trace import Session, TraceError, TurnDemand, Workload

FIXTURE = Path(__file__).parent / "fixtures" / "plan_bench_results.json"
PLAN_FIELDS = {"ttft_p50_ms", "ttft_p90_ms", "session_p50_s", "peak_pool_mib", "peak_host_mib", "reuse_share",
               "ttft_p50_ms_range", "retained_over_time"}
PROMPT_FIT = (12.0, 0.10, 0.09, 0.08)  # the fixture's steps cost exactly this (a, b, c, q) on P
DECODE_STEP = (1.0, 0.5, 3.5)  # ...and D's decode steps a + b batch + k batch x longest context / 1e3


@pytest.fixture(scope="module")
def cost_model():
    return calibration.load(FIXTURE)


def with_fields(model: calibration.Calibration, **fields) -> calibration.Calibration:
    return model.model_copy(update=fields)


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


def served_step(start_s: float, ms: float, prompts: list, decodes: int = 0, context: int = 0, longest: int = 0) -> dict:
    """One step as a worker's /kv/steps lists it."""
    return {"start_s": start_s, "ms": ms, "cpu_ms": ms, "prompts": prompts, "decodes": decodes,
            "decode_context": context, "decode_longest": longest}


def prompt_ms(n: int, context: int, terms=PROMPT_FIT) -> float:
    a, b, c, q = terms
    return a + b * n + c * n * context / 1e3 + q * n * n / 2e3


def worker_steps(prompt_scale: float, step: tuple[float, float, float], start_s: float, prompts: bool,
                 decodes_beside: bool, noise: float = 0.0) -> list:
    """A worker's /kv/steps of one leg, as the fixture's: prompt steps of known cost (every other one beside two
    decodes when `decodes_beside`), then decode-only steps of batches 1-4; each time off by up to `noise` of
    itself, one way or the other, the same draw every call."""
    a, b, k = step
    draw = np.random.default_rng(7)
    shapes = [(4000, 0), (900, 0), (2500, 0), (300, 4400), (120, 2000), (350, 7000), (60, 900), (200, 3000)]
    steps, now = [], start_s
    for i, (n, context) in enumerate(shapes if prompts else []):
        decodes, longest = (2, 3000) if decodes_beside and i % 2 else (0, 0)
        ms = (prompt_scale * prompt_ms(n, context) + b * decodes + k * decodes * longest / 1e3) * \
            (1 + noise * draw.uniform(-1, 1))
        steps.append(served_step(now, ms, [[n, context]], decodes, 2 * longest - 500 if decodes else 0, longest))
        now += ms / 1e3 + 0.5
    for i, batch in enumerate((1, 2, 3, 4) * 6):
        longest = 2500 + 700 * (i % 5)
        ms = (a + b * batch + k * batch * longest / 1e3) * (1 + noise * draw.uniform(-1, 1))
        steps.append(served_step(now, ms, [], batch, batch * longest - 100 * (batch - 1), longest))
        now += ms / 1e3 + 0.01
    return steps


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
    assert trace.reusable(turns[0], turns[1]) == 1000 and trace.reusable(None, turns[0]) == 0


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('["a list"]', "a valid dictionary"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 10}', "'output_tokens' Field required"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": true, "output_tokens": 3}', "'prompt_tokens'"),
    ('{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 0, "output_tokens": 3}', "greater than or equal to 1"),
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


JUNK_STEPS = ["junk", [1.0, 2.0], {"start_s": 1.0}, served_step(float("nan"), 5.0, [[10, 0]]),
              served_step(10**400, 5.0, [[10, 0]]), served_step(1.0, 5e-324, [], 1, 10, 10),
              served_step(1.0, 5.0, [[1, 10]]), served_step(1.0, 5.0, [[10, -1]]), served_step(1.0, 5.0, [[True, 0]]),
              served_step(1.0, 5.0, [], True, 10, 10), served_step(1.0, 5.0, [], 2, 0, 0),
              served_step(1.0, 5.0, [], 2, 100, 40), served_step(1.0, 5.0, [], 2, 100, 101),
              served_step(1.0, 5.0, [], 1, 2**30, 2**30), {**served_step(1.0, 5.0, [], 1, 10, 10), "cpu_ms": "fast"}]


def test_a_step_in_service_that_is_not_a_plausible_one_is_left_out():
    assert [parse_step(raw) for raw in JUNK_STEPS] == [None] * len(JUNK_STEPS)
    assert parse_step(served_step(1.0, 5.0, [[10, 0]], 2, 150, 100)) == Step(
        start_s=1.0, ms=5.0, cpu_ms=5.0, prompts=[[10, 0]], decodes=2, decode_context=150, decode_longest=100)


def said(result) -> str:
    """A command's output as one line, without the box rich draws around an error."""
    return " ".join(result.output.replace("│", " ").split())


def test_a_bench_run_with_junk_in_its_requests_fits_what_is_plausible(cost_model, tmp_path):
    results = json.loads(FIXTURE.read_text())
    junk = ["12", None, True, -5, float("nan"), 1e300, [1], {"ms": 1}]
    fields = ["ttft_ms", "prefill_compute_ms", "d_to_p_read_ms", "p_to_d_read_ms", "bytes_d_to_p",
              "prompt_tokens_from_decode", "latency_ms", "start_time_ms", "queue_ms"]
    for run in results["legs"].values():
        for index, request in enumerate(run["requests"]):
            if index % 5 == 0:  # one request in five has one field of junk
                request[fields[index % len(fields)]] = junk[index % len(junk)]
        run["requests"].append("not a request")
        run["worker_steps"].setdefault("decode", []).extend(JUNK_STEPS)
    (tmp_path / "junk.json").write_text(json.dumps(results))
    model = calibration.load(tmp_path / "junk.json")
    assert calibration.load(model.save(tmp_path / "saved.json")) == model
    assert model.kv_bytes_per_token == cost_model.kv_bytes_per_token
    for kind, terms in cost_model.compute_fits.items():
        assert model.compute_fits[kind] == pytest.approx(terms)
    for run in results["legs"].values():  # a byte a read: a fit no saved calibration may hold is refused by name
        for request in run["requests"]:
            if isinstance(request, dict) and request.get("bytes_d_to_p"):
                request["bytes_d_to_p"] = 1
    (tmp_path / "tiny.json").write_text(json.dumps(results))
    with pytest.raises(calibration.CalibrationError, match=r"tiny\.json: .*malformed calibration: .*kv_bytes_per_token"):
        calibration.load(tmp_path / "tiny.json")


def test_the_calibration_is_the_fit_of_the_workers_steps_in_service(cost_model, tmp_path):
    for n, context in ((4000, 0), (300, 4400), (60, 900)):
        for kind, scale in (("prefill", 1.0), ("decode", 0.8), ("colocated", 0.5)):
            assert cost_model.step_prefill_ms([(n, context)], kind) == pytest.approx(scale * prompt_ms(n, context),
                                                                                    rel=1e-3)
    assert cost_model.decode_step_fit == pytest.approx(DECODE_STEP, rel=1e-3)
    assert cost_model.step_fit("colocated") == pytest.approx(tuple(c / 2 for c in DECODE_STEP), rel=1e-3)
    assert cost_model.kv_bytes_per_token == 4096  # the tiny model: 4 layers x K,V x 2 heads x 64 x fp32
    assert set(cost_model.other_ms) == set(json.loads(FIXTURE.read_text())["legs"])
    assert len(cost_model.halves) == 2 and cost_model.halves[0].halves == []
    assert calibration.load(cost_model.save(tmp_path / "calibration.json")) == cost_model


def test_a_bench_run_that_kept_no_worker_steps_is_refused_saying_how_to_calibrate(tmp_path):
    results = json.loads(FIXTURE.read_text())
    del results["legs"]["pd/P-cache-on"]["worker_steps"]
    (tmp_path / "old.json").write_text(json.dumps(results))
    with pytest.raises(calibration.CalibrationError, match="old.json: leg pd/P-cache-on kept no worker steps"):
        calibration.load(tmp_path / "old.json")


@pytest.mark.parametrize("version", [None, 1, 3, "2"])
def test_a_saved_calibration_of_another_schema_version_asks_to_calibrate_again(cost_model, tmp_path, version):
    saved = json.loads(cost_model.save(tmp_path / "c.json").read_text())
    saved["schema_version"] = version
    if version is None:
        del saved["schema_version"]
    (tmp_path / "c.json").write_text(json.dumps(saved))
    with pytest.raises(calibration.CalibrationError, match=r"schema version .*calibrate again"):
        calibration.load(tmp_path / "c.json")


@pytest.mark.parametrize("field, value", [("decode_step_fit", [1.0, -0.5, 3.0]),
                                          ("compute_fits", {"gpu": [1, 2, 3, 4]}), ("kv_bytes_per_token", 0.5),
                                          ("read_ms_per_mib", {"d_to_p": "fast"}),
                                          ("step_scatter", {"prefill": [0.0]}), ("unknown", 1)])
def test_a_malformed_saved_calibration_is_refused_by_its_schema(cost_model, tmp_path, field, value):
    saved = json.loads(cost_model.save(tmp_path / "c.json").read_text())
    saved[field] = value
    (tmp_path / "c.json").write_text(json.dumps(saved))
    with pytest.raises(calibration.CalibrationError, match=f"c.json: malformed calibration.*{field}"):
        calibration.load(tmp_path / "c.json")


def test_several_bench_runs_pool_into_one_calibration_and_a_saved_one_is_not_pooled(cost_model, tmp_path):
    results = json.loads(FIXTURE.read_text())
    slower = json.loads(FIXTURE.read_text())
    for run in slower["legs"].values():
        for steps in run["worker_steps"].values():
            for step in steps:
                step["ms"] *= 2
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (results, slower)):
        path.write_text(json.dumps(data))
    pooled = calibration.load_many(paths)
    for n, context in ((4000, 0), (200, 3800)):
        one = cost_model.step_prefill_ms([(n, context)])
        assert one < pooled.step_prefill_ms([(n, context)]) < 2 * one
    assert pooled.samples["prefill"] == 2 * cost_model.samples["prefill"]
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
    with pytest.raises(calibration.CalibrationError, match="only kvturn bench results"):
        calibration.load_many([paths[0], cost_model.save(tmp_path / "saved.json")])
    (tmp_path / "empty.json").write_text(json.dumps({"legs": {}}))
    with pytest.raises(calibration.CalibrationError, match="run 2 of 2: not a kvturn bench results JSON"):
        calibration.load_many([paths[0], tmp_path / "empty.json"])


def noisy_run(noise: float) -> dict:
    results = json.loads(FIXTURE.read_text())
    for leg, run in results["legs"].items():
        if LEGS[leg].mode != "colocated":
            run["worker_steps"] = {"prefill": worker_steps(1.0, DECODE_STEP, 1000.0, True, False, noise)[:8],
                                   "decode": worker_steps(0.8, DECODE_STEP, 2000.0, leg == "compute-on-D", True,
                                                          noise)}
    return results


def test_the_plan_says_the_range_its_figures_move_in_over_the_calibrations_halves(tmp_path):
    exact = calibration.fitted([noisy_run(0.0)])
    noisy = calibration.fitted([noisy_run(0.3)])
    workload = agent_sessions(6, 3)
    legs = ["pd/P-cache-off", "bidir/P-cache-off"]
    sure = planner.plan(workload, exact, Deployment(), legs, "pull", False, [], (), 0.95)
    unsure = planner.plan(workload, noisy, Deployment(), legs, "pull", False, [], (), 0.95)
    def spread(plan: dict) -> float:
        low, high = plan["legs"]["pd/P-cache-off"]["ttft_p50_ms_range"]
        assert low <= plan["legs"]["pd/P-cache-off"]["ttft_p50_ms"] <= high
        return high - low
    # Steps that fit exactly move only with the requests' time outside compute; scattered ones, by far more.
    assert 0 < spread(sure) < spread(unsure) / 3
    value, low, high = unsure["verdict"]["speedup"]
    assert low <= value <= high and f"{value:.2f}x ({low:.2f}-{high:.2f}x" in unsure["verdict"]["text"]
    row = report.leg_rows(unsure)[0]
    assert "(" in row[1] and "-" in row[1]  # printed as value (low-high)


def prefill_with(cost_model, jobs: dict[str, tuple[int, int, float]], leg: str = "bidir/P-cache-off",
                 deployment: Deployment = Deployment()):
    """(the calibration with every step at its fit's time, the simulation, its P of `leg`, `jobs` made from (new
    tokens, context, ms of a peer's KV to read) by name, the time of each one's first token by name)."""
    model = cost_model.model_copy(update={"step_scatter": {}})
    sim = Simulation(Workload("none", [], None), LEGS[leg], deployment, model)
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
    assert first_token["first"] == pytest.approx(model.step_prefill_ms([(300, 0)]) / 1e3)
    together_ms = model.step_prefill_ms([(200, 2000), (100, 0)])
    expected_s = first_token["first"] + (40.0 + together_ms) / 1e3
    assert first_token["pulled"] == pytest.approx(expected_s) and first_token["plain"] == pytest.approx(expected_s)
    assert jobs["pulled"].compute_ms == pytest.approx(together_ms)  # the read is not compute
    assert not (prefill.waiting or prefill.prefilling or prefill.decoding)


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
    long_s = first_token["first"] + model.step_prefill_ms([(600, 0)]) / 1e3  # alone: it fills the pack, the others wait
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
    long_s = first_token_s = model.step_prefill_ms([(300, 0)]) / 1e3
    long_s += (40.0 + model.step_prefill_ms([(600, 0)])) / 1e3
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
    step1_s = model.step_prefill_ms([(300, 0)]) / 1e3
    # Step 2: y, then 12 tokens of x (the pack's room), and r1's read; r1 finds no room left.
    step2_s = step1_s + (40.0 + model.step_prefill_ms([(500, 0), (12, 0)])) / 1e3
    sim.at(step2_s - 0.001, prefill.submit_prefill, jobs["r2"])
    sim.run()
    assert first_token["y"] == pytest.approx(step2_s)
    # Step 3: the rest of x fills the pack; r1 waits, and r2 behind it is read all the same.
    step3_s = step2_s + (30.0 + model.step_prefill_ms([(988, 12)])) / 1e3
    assert first_token["x"] == pytest.approx(step3_s)
    step4_s = step3_s + model.step_prefill_ms([(200, 2000), (100, 1000)]) / 1e3
    assert first_token["r1"] == pytest.approx(step4_s) and first_token["r2"] == pytest.approx(step4_s)


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
    # the longest context is 2000-2400 tokens meanwhile
    fewest_ms = decode._segment_ms(20, 2, 2000)
    most_ms = decode._segment_ms(1, 1, 2400) + decode._segment_ms(20, 2, 2400)  # with the step in progress
    assert fewest_ms / 1e3 <= finished["short"] - 0.5 <= most_ms / 1e3
    assert finished["long"] > finished["short"]


def test_a_decode_step_costs_the_batch_times_its_longest_context_until_the_longest_finishes(cost_model):
    # A long history (8000 tokens, 50 steps) and a short one (1000, 200 steps) decode together: while both run,
    # every step attends to 2 x the longest; after the long one finishes, the short one's own context alone.
    model = with_fields(cost_model, decode_step_fit=(1.0, 0.5, 2.0))
    sim = Simulation(Workload("none", [], None), LEGS["pd/P-cache-off"], Deployment(), model)
    decode, finished = sim.decode[0], {}
    for name, prompt, steps in (("long", 8000, 50), ("short", 1000, 200)):
        job = Job(0, prompt, steps, on_finished=lambda job, now, name=name: finished.setdefault(name, now))
        sim.at(0.0, decode.submit_decode, job)
    sim.run()
    # The short one joins after the long one's first step, shares 49 steps with it, then takes 151 alone.
    steps_ms = model.decode_steps_ms
    alone, together = steps_ms("decode", 1, 1, 8000), steps_ms("decode", 49, 2, 8001)
    assert finished["long"] == pytest.approx((alone + together) / 1e3)
    assert finished["short"] == pytest.approx((alone + together + steps_ms("decode", 151, 1, 1049)) / 1e3)


def test_the_simulation_is_deterministic_and_serves_every_turn(cost_model):
    workload = agent_sessions(40, 5, clients=None)
    deployment = Deployment(num_prefill=2, num_decode=3, one_host=True)
    first, second = (simulate(workload, LEGS["adaptive"], deployment, cost_model) for _ in range(2))
    assert first == second and first.turns == 200 and sum(first.paths.values()) == 200


def test_a_small_workloads_figures_are_the_median_of_its_simulations_each_kept_as_a_replica(cost_model):
    # What one bench run's p50 would be with each draw of the steps' scatter: the spread a plan sets beside a
    # measured gain (benchmarks/grid_plan.py), the median its figure.
    predicted = simulate(agent_sessions(6, 3), LEGS["bidir/P-cache-off"], Deployment(), cost_model)
    for figure in ("ttft_p50_ms", "session_p50_s"):
        draws = predicted.replicas[figure]
        assert len(draws) > 1 and len(draws) % 2 == 1
        assert getattr(predicted, figure) == pytest.approx(float(np.median(draws)))
    assert len(set(predicted.replicas["session_p50_s"])) > 1  # the scatter moves a run's p50
    assert "replicas" in predicted.public()


def test_plan_json_has_every_leg_under_the_bench_names(cost_model, tmp_path):
    workload = agent_sessions(6, 3)
    plan = planner.plan(workload, cost_model, Deployment(), list(LEGS), "pull", False, [60.0], (0.5, 1.0), 0.95)
    saved = json.loads(report.write(plan, tmp_path).read_text())
    assert set(saved["legs"]) == set(LEGS)
    assert all(PLAN_FIELDS <= set(values) for values in saved["legs"].values())
    assert saved["verdict"]["text"].startswith("On this workload") and saved["left_out"]
    assert {p["ttl_s"] for p in saved["sweep"]["points"]} == {60.0, 480.0}
    assert "halves" not in saved["calibration"]


def test_a_plan_says_when_its_prompts_reach_beyond_the_calibrations_longest_step(cost_model):
    workload = agent_sessions(4, 3)  # prompts of 3000-3755 tokens
    assert cost_model.context_seen == 7350  # P's (350, 7000) chunk
    said = planner.plan(workload, cost_model, Deployment(), ["pd/P-cache-off"], "pull", False, [], (), 0.95)
    assert "extrapolate" not in said["verdict"]["text"]
    short = cost_model.model_copy(update={"context_seen": 1000, "halves": []})
    said = planner.plan(workload, short, Deployment(), ["pd/P-cache-off"], "pull", False, [], (), 0.95)
    assert "reach 3,755 tokens, beyond the 1,000" in said["verdict"]["text"]


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


@pytest.mark.parametrize("name, content, message", [
    ("nan.jsonl", '{"timestamp": NaN, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3}',
     "nan.jsonl:1: 'timestamp'"),
    ("huge.jsonl", '{"timestamp": 1e999, "conversation_id": "a", "prompt_tokens": 9, "output_tokens": 3}',
     "huge.jsonl:1: 'timestamp'"),
    ("long.jsonl", '{"timestamp": 1, "conversation_id": "a", "prompt_tokens": 1000000000000000, "output_tokens": 3}',
     "less than or equal to"),
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
])
def test_the_plan_command_refuses_a_deployment_no_worker_would_run(tmp_path, args, message):
    calibrated = [] if "--calibration" in args else ["--calibration", str(FIXTURE)]
    result = CliRunner().invoke(app, ["plan", "--scenario", "sweep", *calibrated, *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in said(result), result.output


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser recurses
TRACE_LINE = '{"timestamp": %s, "conversation_id": "%s", "prompt_tokens": %d, "output_tokens": %d}'


def plan_exit(workload: Path, calibration_file: Path, tmp_path: Path):
    return CliRunner().invoke(app, ["plan", "--workload", str(workload), "--calibration", str(calibration_file),
                                    "--legs", "pd/P-cache-on", "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("field, raw, message", [
    ("decode_step_fit", "[Infinity, 0.5, 3.5]", "decode_step_fit"),
    ("decode_step_fit", "[NaN, 0.5, 3.5]", "decode_step_fit"),
    ("kv_bytes_per_token", "1e999", "kv_bytes_per_token"),
    ("compute_fits", '{"prefill": [1e308, 0.1, 0.1, 0.1]}', "compute_fits.prefill"),
    ("other_ms", '{"pd/P-cache-on": 1e308}', "other_ms"),
    ("context_seen", "-5", "context_seen"),
    ("halves", None, "halves"),
    (None, DEEP, "nested deeper than 32 levels"),
])
def test_the_plan_command_refuses_a_hostile_calibration_in_one_line(cost_model, tmp_path, field, raw, message):
    """Not a traceback (exit code 1), nor a plan run on numbers that overflow: a usage error naming what is wrong."""
    saved = json.loads(cost_model.save(tmp_path / "c.json").read_text())
    if field == "halves":
        whole = {name: value for name, value in saved.items() if name != "kind"}
        raw = json.dumps([{**whole, "halves": [whole]}])
    if field is None:
        (tmp_path / "c.json").write_text(raw)
    else:
        saved[field] = "@@"
        (tmp_path / "c.json").write_text(json.dumps(saved).replace('"@@"', raw))
    trace_file = write_lines(tmp_path / "t.jsonl", [json.loads(TRACE_LINE % (1, "a", 100, 10))])
    result = plan_exit(trace_file, tmp_path / "c.json", tmp_path)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "c.json" in said(result) and message in said(result), result.output


@pytest.mark.parametrize("lines, message", [
    (["{\"timestamp\": %s}" % ("[" * 20_000 + "]" * 20_000)], "t.jsonl:1: nested deeper than 32 levels"),
    (["{\"timestamp\": %s}" % ("[" * 40 + "]" * 40)], "t.jsonl:1: nested deeper than 32 levels"),
    ([TRACE_LINE % (1, "a" * 70_000, 100, 10)], "t.jsonl:1: a line of 70"),
    ([TRACE_LINE % (i, "a", 2**24, 2**24) for i in range(4)], "over the 200000 kvturn plan takes"),
    ([TRACE_LINE % (i, f"c{i % 999}", 8 * 8192 + 1, 10) for i in range(25_000)], "over the 200000 kvturn plan"),
])
def test_the_plan_command_refuses_a_trace_too_deep_too_long_or_too_much_to_simulate(cost_model, tmp_path, lines,
                                                                                     message):
    """A trace whose simulation would run for minutes is refused before it starts, saying how much it asks."""
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    result = plan_exit(tmp_path / "t.jsonl", cost_model.save(tmp_path / "c.json"), tmp_path)
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in said(result), result.output


def test_a_workload_of_single_turns_plans_to_null_not_nan(cost_model, tmp_path):
    workload = Workload("single", [Session(f"s{i}", [TurnDemand(2000, 16, 0)]) for i in range(3)], 2)
    plan = planner.plan(workload, cost_model, Deployment(), ["pd/P-cache-off"], "pull", False, [60.0], (1.0,), 0.95)
    assert plan["legs"]["pd/P-cache-off"]["later_ttft_p50_ms"] is None
    assert plan["legs"]["pd/P-cache-off"]["ttft_p50_ms"] > 0
    assert "no session has a second turn" in plan["verdict"]["text"] and "nan" not in plan["verdict"]["text"]
    saved = report.write(plan, tmp_path).read_text()
    json.loads(saved, parse_constant=lambda name: pytest.fail(f"{name} in plan.json"))


def test_the_scenario_is_planned_with_the_lease_its_bench_runs_and_the_router_forgets_before_d(tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, ["plan", "--scenario", "resume-after-ttl", "--calibration", str(FIXTURE),
                                      "--legs", "bidir/P-cache-off", "--ttls", "60", "--host-budgets", "", "--out",
                                      str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    deployment = plan["deployment"]
    assert (deployment["decoder_kv_blocks_ttl_s"], deployment["kv_expiry_margin_s"]) == (4.0, 1.0)
    assert deployment["conversation_ttl_s"] == 4.0 * planner.ROUTER_TTL_SHARE
    # The 6 s between turns outlast the 4 s lease: no turn reuses, as the bench's scenario shows.
    assert plan["legs"]["bidir/P-cache-off"]["reuse_share"] == 0.0


def test_a_retention_budget_is_each_decode_workers(cost_model):
    workload = agent_sessions(12, 4, think_s=2.0, clients=None)
    two = Deployment(num_decode=2, num_prefill=2)
    free = simulate(workload, LEGS["bidir/P-cache-off"], two, cost_model)
    assert free.peak_retained_mib / 2 <= free.peak_retained_mib_per_decode < free.peak_retained_mib
    budget = max(int(free.peak_retained_mib_per_decode * 0.75), 1)
    capped = simulate(workload, LEGS["bidir/P-cache-off"], replace(two, retained_kv_budget_mb=budget), cost_model)
    assert capped.peak_retained_mib_per_decode <= budget < capped.peak_retained_mib


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


def test_leases_over_the_pool_budget_move_oldest_first_to_the_host_tier_and_drop_its_oldest_when_full():
    changes = []
    leases = Leases(budget_tokens=100, host_tokens=120, on_change=lambda tier, n: changes.append((tier, n)))
    for name in "abcd":
        leases.retain(name, 60, 0.0, 60.0)
    # a moves for b, b for c (the host tier holds both), c for d: a, the host tier's oldest, is dropped for it
    assert [leases.tier_of(c) for c in "abcd"] == [None, "host", "host", "pool"]
    assert leases.tokens == {"pool": 60, "host": 120}
    leases.retain("e", 200, 1.0, 60.0)  # larger than the whole host tier: moved nowhere, dropped
    assert leases.tier_of("e") is None and leases.tokens["pool"] <= 100
    without_host = Leases(100, 0, lambda tier, n: None)
    without_host.retain("a", 60, 0.0, 60.0)
    without_host.retain("b", 60, 0.0, 60.0)
    assert without_host.tier_of("a") is None and without_host.tier_of("b") == "pool"
    leases.expire(61.0)
    assert leases.tokens == {"pool": 0, "host": 0}


def test_the_plan_reports_retained_kv_per_tier_over_time_and_the_ttl_and_host_tier_that_keep_the_reuse(cost_model):
    workload = agent_sessions(12, 4, think_s=2.0, clients=None)  # all at once: a tight pool budget costs reuse
    leg = "bidir/P-cache-off"
    free = simulate(workload, LEGS[leg], Deployment(), cost_model)
    budget = max(int(free.peak_retained_mib_per_decode * 0.4), 1)
    tight = Deployment(retained_kv_budget_mb=budget)
    alone = simulate(workload, LEGS[leg], tight, cost_model)
    hosted = simulate(workload, LEGS[leg], replace(tight, retained_host_mb=int(free.peak_retained_mib) + 1),
                      cost_model)
    assert alone.peak_host_mib == 0 and alone.reuse_share < hosted.reuse_share == free.reuse_share
    assert hosted.peak_pool_mib <= budget and hosted.peak_host_mib > 0
    assert all(pool <= budget for _, pool, _ in hosted.retained_over_time)
    assert max(host for *_, host in hosted.retained_over_time) == pytest.approx(hosted.peak_host_mib)
    plan = planner.plan(workload, cost_model, tight, [leg], "pull", False, [60.0], (0.5, 1.0), 0.9)
    answer = plan["retention"]
    assert answer["reuse_share"] >= 0.9 * answer["best_reuse_share"] and answer["host_mib_per_decode"] > 0
    cheaper = [p for p in plan["sweep"]["points"] if p["reuse_share"] >= 0.9 * answer["best_reuse_share"]
               and p["peak_pool_mib"] + p["peak_host_mib"] < answer["peak_pool_mib"] + answer["peak_host_mib"]]
    assert not cheaper and f"host tier of {answer['host_mib_per_decode']} MiB" in plan["verdict"]["text"]
    result = CliRunner().invoke(app, ["plan", "--workload", "x.jsonl", "--calibration", str(FIXTURE),
                                      "--reuse-target", "1.5"])
    assert result.exit_code == 2 and "--reuse-target" in said(result)




@pytest.mark.parametrize("leg, layers, expected", [
    ("bidir/P-cache-off", 4, lambda read, compute: max(read, compute) + min(read, compute) / 4),
    ("bidir/P-cache-off", 0, lambda read, compute: read + compute),
    ("bidir/P-cache-off/whole-read", 4, lambda read, compute: read + compute)])
def test_a_read_layer_by_layer_costs_the_longer_of_read_and_compute_and_a_layers_share_of_the_other(
        cost_model, leg, layers, expected):
    # kvturn's P posts its read of D's history one layer at a time and computes layer l of the new tokens once
    # layer l has arrived; --no-kv-read-overlap (the whole-read leg) reads it all before the forward pass.
    model, sim, prefill, jobs, first_token = prefill_with(cost_model, {"pulled": (200, 2000, 80.0)}, leg,
                                                          Deployment(read_overlap_layers=layers))
    sim.at(0.0, prefill.submit_prefill, jobs["pulled"])
    sim.run()
    compute = model.step_prefill_ms([(200, 2000)])
    assert first_token["pulled"] * 1e3 == pytest.approx(expected(80.0, compute))


def test_ps_prefix_cache_evicts_into_its_host_tier_and_a_hit_there_moves_back_into_the_pool():
    cache = PrefixCache(1000, host_tokens=1500)
    cache.store("a", 600)
    cache.store("b", 600)  # over the pool: a, the least recent, goes to the host tier
    assert cache.tokens == {"b": 600} and cache.host.tokens == {"a": 600}
    assert cache.hit("a") == 600  # restored into the pool, b evicted to the host tier in its place
    assert cache.tokens == {"a": 600} and cache.host.tokens == {"b": 600}
    cache.store("b", 900)  # a newer prompt of b supersedes the one in the host tier
    assert cache.host.tokens == {"a": 600} and cache.tokens == {"b": 900}
    for name in "cde":
        cache.store(name, 700)
    assert cache.host.total <= 1500 and "a" not in cache.host.tokens  # the tier's own least recent went
    assert PrefixCache(1000).hit("a") == 0 and PrefixCache(1000).host is None


def test_a_prefill_host_tier_serves_later_turns_ps_pool_evicted_as_the_leg_asks(cost_model):
    # pd/P-cache-host gives P's prefix cache a host tier (--prefix-host-mb 64): with pools that hold one history,
    # later turns find theirs there instead of computing it again.
    workload = agent_sessions(4, 3, think_s=2.0)
    small = Deployment(prefill_kv_cache_mb=16)
    runs = {}
    for leg in ("pd/P-cache-on", "pd/P-cache-host"):
        sim = Simulation(workload, LEGS[leg], small, cost_model)
        sim.run()
        runs[leg] = sim
    cached = {leg: sum(r.cached_tokens for r in sim.results if r.number) for leg, sim in runs.items()}
    assert cached["pd/P-cache-on"] < cached["pd/P-cache-host"]
    assert runs["pd/P-cache-host"].prefill_cache[0].host.capacity_tokens == 64 * 2**20 // 4096
    assert runs["pd/P-cache-on"].prefill_cache[0].host is None
