"""The three paths of a turn: the pure choice, the cost model's learning, and the compute-on-decode path
through real processes."""
import pytest

from chat import SYSTEM, conversation, send
from kvturn.launch import LocalStack
from kvturn import costmodel as paths
from kvturn.costmodel import fits, reports, tokens
from kvturn.costmodel import CostModel, TurnView, choose
from kvturn.costmodel.fits import ComputeFit
from kvturn.costmodel.paths import EXPLORE_EVERY
from kvturn.router import keys


SYSTEM_MSG = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "Tool result: ok. Next step?"}
ANSWER = {"role": "assistant", "content": "Run the tests."}


def view(prompt=6000, retained=5800, running=0, available=True, prefill_in_flight=0):
    return TurnView(prompt, retained, running, available, prefill_in_flight)


def test_without_a_live_lease_only_recompute_is_possible():
    choice = choose(CostModel(), view(retained=0), "adaptive", 0.5)
    assert choice.path == paths.RECOMPUTE and set(choice.predicted_ms) == {paths.RECOMPUTE}


def test_an_idle_decode_worker_computes_a_short_new_turn_itself():
    choice = choose(CostModel(), view(), "adaptive", 0.5)
    assert choice.path == paths.COMPUTE_ON_DECODE
    assert choice.predicted_ms[paths.COMPUTE_ON_DECODE] < choice.predicted_ms[paths.PULL] < \
        choice.predicted_ms[paths.RECOMPUTE]


def test_a_busy_decode_worker_makes_the_turn_pull_instead():
    choice = choose(CostModel(), view(prompt=6400, running=24), "adaptive", 0.5)
    assert choice.path == paths.PULL and choice.stall_ms == 0.0


def test_a_decode_worker_without_room_is_never_asked_to_compute():
    assert paths.COMPUTE_ON_DECODE not in choose(CostModel(), view(available=False), "adaptive", 0.5).predicted_ms


def test_fixed_policies_take_their_path_whenever_it_exists():
    assert choose(CostModel(), view(), "pull", 0.5).path == paths.PULL
    assert choose(CostModel(), view(), "recompute", 0.5).path == paths.RECOMPUTE
    assert choose(CostModel(), view(running=50), "compute_on_decode", 0.5).path == paths.COMPUTE_ON_DECODE
    assert choose(CostModel(), view(retained=0), "compute_on_decode", 0.5).path == paths.RECOMPUTE


def test_the_compute_fit_learns_the_measured_costs():
    fit = ComputeFit((5.0, 0.25, 0.02))
    truth = lambda n, c: 3.0 + 0.1 * n + 0.05 * n * (c + n / 2) / 1e3  # noqa: E731
    for n, c in [(2000, 0), (4000, 0), (100, 3000), (300, 6000), (50, 2000), (8000, 0), (200, 7000)] * 4:
        fit.add(n, c, truth(n, c))
    for n, c in [(6000, 0), (150, 8000)]:
        assert fit.predict(n, c) == pytest.approx(truth(n, c), rel=0.15)


def test_the_cost_model_learns_from_worker_reports():
    model = CostModel()
    report = {"prompt_tokens_computed": 100, "prompt_tokens_cached": 0, "prompt_tokens_remote": 4096,
              "kv_read_bytes": 16 * 2**20, "timing": {"prefill_compute_ms": 20.0, "kv_read_ms": 4.0}}
    for _ in range(fits.MIN_SAMPLES):
        model.observe_prefill("prefill", report)
    assert model.read_ms_per_mib.value == pytest.approx(0.25)
    assert model.bytes_per_token.value == pytest.approx(4096)


def test_the_decode_workers_slow_reads_of_new_blocks_do_not_price_the_history_pull():
    model = CostModel()
    pulled = {"prompt_tokens_computed": 100, "prompt_tokens_remote": 4096, "kv_read_bytes": 16 * 2**20,
              "timing": {"prefill_compute_ms": 20.0, "kv_read_ms": 8.0}}
    handed = {"prompt_tokens_computed": 0, "prompt_tokens_cached": 4096, "prompt_tokens_remote": 128,
              "kv_read_bytes": 2**19, "timing": {"kv_read_ms": 60.0}}  # waited for D's step under way
    for _ in range(fits.MIN_SAMPLES):
        model.observe_prefill("prefill", pulled)
        model.observe_prefill("decode", handed)
    assert model.read_ms(4096) == pytest.approx(8.0)
    assert model.read_ms(128, "p_to_d") == pytest.approx(60.0)


def test_a_read_that_the_prefill_workers_steps_overlapped_teaches_no_read_speed():
    # Eight pulls came while P computed first turns: each read was seen done only after a 480 ms step of theirs.
    model = CostModel()
    waited = {"prompt_tokens_computed": 300, "prompt_tokens_remote": 4096, "kv_read_bytes": 16 * 2**20,
              "timing": {"prefill_compute_ms": 100.0, "kv_read_ms": 488.0, "kv_read_step_ms": 480.0}}
    for _ in range(8):
        model.observe_prefill("prefill", waited)
    assert not model.read_ms_per_mib.values
    clean = {**waited, "timing": {"prefill_compute_ms": 100.0, "kv_read_ms": 3.2, "kv_read_step_ms": 0.0}}
    for _ in range(fits.MIN_SAMPLES):
        model.observe_prefill("prefill", clean)
    assert model.read_ms(4096) == pytest.approx(3.2)


def test_of_a_prefill_workers_read_only_its_own_part_counts_in_the_turn_and_a_decode_workers_keeps_its_wait():
    timing = {"kv_read_ms": 488.0, "kv_read_step_ms": 480.0}
    assert reports.own_read_ms("prefill", timing) == pytest.approx(8.0)
    assert reports.own_read_ms("decode", timing) == pytest.approx(488.0)
    assert reports.own_read_ms("prefill", {"kv_read_ms": 5.0, "kv_read_step_ms": 9.0}) == 0.0


def test_one_compute_fit_covers_a_prompt_from_scratch_and_new_tokens_on_a_long_history():
    fit = ComputeFit(fits.PRIOR)
    # Reading the cached context costs more per pair of tokens than the new tokens' attention among themselves.
    truth = lambda n, c: 4.0 + 0.1 * n + 0.09 * n * c / 1e3 + 0.015 * n * n / 2e3  # noqa: E731
    for n, c in [(4000, 0), (300, 4000), (150, 5000), (400, 3000), (250, 6000), (3000, 0), (350, 4500)] * 3:
        fit.add(n, c, truth(n, c))
    for n, c in [(5000, 0), (200, 7000), (120, 3000)]:
        assert fit.predict(n, c) == pytest.approx(truth(n, c), rel=0.15)


@pytest.fixture(scope="module")
def stacks(tiny_model_dir, tmp_path_factory):
    """P/D with turns computed on D, and a colocated worker for reference answers, started together."""
    logs = tmp_path_factory.mktemp("paths")
    built = (LocalStack(tiny_model_dir, kv_cache_mb=64, prefix_caching_on_prefill=False,
                        router_args=["--path-policy", "compute_on_decode"], log_dir=logs / "on-decode"),
             LocalStack(tiny_model_dir, mode="colocated", kv_cache_mb=64, worker_args=["--no-calibrate"],
                        log_dir=logs / "colocated"))
    try:
        for stack in built:
            stack.start_worker_processes()
        for stack in built:
            stack.wait_and_start_router()
        yield built
    finally:
        for stack in built:
            stack.stop()


@pytest.fixture(scope="module")
def on_decode_stack(stacks):
    return stacks[0]


@pytest.mark.integration
def test_compute_on_decode_reads_nothing_and_answers_as_a_colocated_worker(stacks):
    on_decode_stack, colocated = stacks
    messages, results = conversation(on_decode_stack.url, 3, conversation_id="on-decode")
    later = results[1]["kvturn"]
    assert later["path"]["chosen"] == paths.COMPUTE_ON_DECODE
    assert later["bytes_d_to_p"] == 0 and later["bytes_p_to_d"] == 0 and later["prefill_worker"] == ""
    decode = later["decode"]
    assert decode["prompt_tokens_cached"] > 0 and decode["prompt_tokens_computed"] < decode["prompt_tokens_cached"]
    for result in results[1:]:  # one whole answer, one streamed: what D did not compute is its own cache's
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == result["kvturn"]["decode"][
            "prompt_tokens_cached"] > 0
    assert results[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P computed it all, D read it
    _, reference = conversation(colocated.url, 3, conversation_id="reference")
    assert [r["text"] for r in results] == [r["text"] for r in reference]


@pytest.mark.integration
def test_a_layered_reads_hidden_part_is_not_the_turns_but_still_its_speed():
    # 40 ms of read, 30 of them under the compute of its own step: the turn waited 10 ms for it; the link took 40.
    timing = {"prefill_compute_ms": 50.0, "kv_read_ms": 40.0, "kv_read_step_ms": 0.0, "kv_read_hidden_ms": 30.0}
    assert reports.own_read_ms("prefill", timing) == pytest.approx(10.0)
    model = CostModel()
    report = {"prompt_tokens_computed": 300, "prompt_tokens_remote": 4096, "kv_read_bytes": 16 * 2**20,
              "timing": timing}
    for _ in range(fits.MIN_SAMPLES):
        model.observe_prefill("prefill", report)
    assert model.read_ms_per_mib.value == pytest.approx(40.0 / 16)


def test_a_pull_read_beside_its_compute_costs_the_longer_plus_a_layers_share_of_the_shorter():
    model = CostModel()
    assert model.pull_ms(300.0, 100.0) == 400.0
    model.observe_read_overlap(10)
    assert model.pull_ms(300.0, 100.0) == pytest.approx(310.0)
    assert model.pull_ms(100.0, 300.0) == pytest.approx(310.0)
    for hostile in (-1, "30", 1.5, None, 10**9):
        model.observe_read_overlap(hostile)
    assert model.read_overlap_layers == 10


def test_workers_time_prefill_steps_at_start_up_and_the_router_learns_them(on_decode_stack):
    import httpx
    for name in ("prefill", "decode0"):
        steps = httpx.get(f"{on_decode_stack.urls[name]}/kv/calibration").json()["prefill_steps"]
        shapes = [(s["new_tokens"], s["context_tokens"]) for s in steps]
        assert (512, 0) in shapes and any(context > 0 for _, context in shapes)
        assert all(s["ms"] > 0 for s in steps)
    overlap = httpx.get(f"{on_decode_stack.urls['prefill']}/kv/calibration").json()["kv_read_overlap_layers"]
    assert overlap >= 1  # the default: P reads a history layer by layer beside its compute
    metrics = httpx.get(f"{on_decode_stack.url}/metrics").text
    for role in ("prefill", "decode"):
        learned = [line for line in metrics.splitlines()
                   if line.startswith(f'kvturn_router_calibration_steps_total{{role="{role}"}}')]
        assert learned and float(learned[0].split()[-1]) >= 2


def test_a_workers_calibration_is_checked_before_it_is_learned():
    model = CostModel()
    good = {"new_tokens": 2048, "context_tokens": 0, "ms": 300.0}
    steps = [good, {"new_tokens": -5, "context_tokens": 0, "ms": 1}, {"new_tokens": 256, "context_tokens": 2048,
             "ms": float("nan")}, {"new_tokens": "x"}, None, 7, {"new_tokens": 512, "context_tokens": 0, "ms": 1e12},
             {"new_tokens": True, "context_tokens": False, "ms": True}, {"new_tokens": "512", "context_tokens": 0,
             "ms": 50}, {"new_tokens": 512, "context_tokens": 0, "ms": 1e-300}, {"new_tokens": 512,
             "context_tokens": 0, "ms": float("inf")}, {"new_tokens": 2**40, "context_tokens": 0, "ms": 5.0}]
    assert model.observe_calibration("prefill", {"new_tokens": 1}) == 0
    assert model.observe_calibration("prefill", steps) == 1
    assert model.observe_calibration("nonsense", [good]) == 0
    assert model.observe_calibration("decode", [good] * 100) == fits.MAX_CALIBRATION_STEPS
    # Only the first workers of a role teach it: a fleet of idle workers must not outweigh measured requests.
    assert model.observe_calibration("prefill", [good]) == 1
    assert model.observe_calibration("prefill", [good]) == 0
    # A machine three times faster than the prior: its five timed shapes become the fit's prior, and the shapes
    # between them are predicted from this machine's speed.
    truth = lambda n, c: (0.5 + 0.03 * n + 0.02 * n * c / 1e3 + 0.01 * n * n / 2e3)  # noqa: E731
    fast = CostModel()
    fast.observe_calibration("prefill", [{"new_tokens": n, "context_tokens": c, "ms": truth(n, c)}
                                         for n, c in [(512, 0), (2048, 0), (4096, 0), (256, 2048), (256, 4096)]])
    for n, c in [(3000, 0), (300, 5000), (60, 3000)]:
        assert fast.compute_ms("prefill", n, c) == pytest.approx(truth(n, c), rel=0.02)
        assert fast.compute_ms("decode", n, c) == pytest.approx(truth(n, c), rel=0.02)  # D's stands in until measured
        assert CostModel().compute_ms("prefill", n, c) > 2 * truth(n, c)


def test_a_worker_slower_than_predicted_still_owes_all_the_work_it_has_not_begun():
    from kvturn.router.workers import WorkerPool
    worker = WorkerPool(["http://p"], "prefill").workers[0]
    first, _ = WorkerPool.claim(worker, 300.0), WorkerPool.claim(worker, 200.0)
    came = min(t for _, t in worker.pending.values())
    assert worker.backlog_ms(came + 1.0) == 0.0  # a second on: by the prediction, both are done
    first.work_done()  # but the first took that second: the other has not begun
    assert worker.backlog_ms(worker.last_done) == pytest.approx(200.0)


def test_work_queued_on_the_prefill_worker_makes_the_turn_compute_on_decode():
    idle = choose(CostModel(), TurnView(6400, 6000, 4, True, 0, 0.0), "adaptive", 0.5)
    queued = choose(CostModel(), TurnView(6400, 6000, 4, True, 3, 2000.0), "adaptive", 0.5)
    assert queued.predicted_ms[paths.PULL] == pytest.approx(idle.predicted_ms[paths.PULL] + 2000.0)
    assert queued.path == paths.COMPUTE_ON_DECODE


def test_a_first_token_sent_ahead_leaves_the_decode_workers_read_out_of_the_prediction():
    model = CostModel()
    behind = choose(model, TurnView(6400, 6000, 0, True, 0, 0.0, 0.0, False), "pull", 0.5)
    ahead = choose(model, TurnView(6400, 6000, 0, True, 0, 0.0, 0.0, True), "pull", 0.5)
    assert ahead.predicted_ms[paths.PULL] == pytest.approx(behind.predicted_ms[paths.PULL] - model.read_ms(400))


def test_adaptive_retakes_a_path_it_has_not_measured_lately_when_it_is_not_far_off():
    model = CostModel()
    turn = TurnView(6400, 6000, 0, True, 0, 0.0)
    taken = []
    for _ in range(3 * EXPLORE_EVERY):
        choice = choose(model, turn, "adaptive", 0.5)
        model.chosen(choice.path)
        taken.append(choice.path)
    assert taken.count(paths.COMPUTE_ON_DECODE) > taken.count(paths.PULL) >= 2  # pull, every 17th turn
    for _ in range(fits.MIN_SAMPLES):
        model.correction[paths.PULL].add(10.0)  # pull measured ten times slower: no longer worth a look
    for _ in range(2 * EXPLORE_EVERY):
        model.chosen(choose(model, turn, "adaptive", 0.5).path)
        assert model.turns_since_chosen[paths.COMPUTE_ON_DECODE] == 0


def test_a_workers_backlog_is_the_predicted_work_it_holds_less_what_it_did_since():
    from kvturn.router.workers import WorkerPool
    pool = WorkerPool(["http://p"], "prefill")
    worker = pool.workers[0]
    first, second = pool.claim(worker, 300.0), pool.claim(worker, 200.0)
    came = min(t for _, t in worker.pending.values())
    assert worker.backlog_ms(came + 0.1) == pytest.approx(400.0, abs=1.0)
    first.work_done()  # its prompt is done; it still holds the worker (decoding)
    assert worker.in_flight == 2 and worker.backlog_ms(worker.last_done + 0.05) == pytest.approx(150.0, abs=1.0)
    second.release()
    first.release()
    assert worker.in_flight == 0 and worker.backlog_ms() == 0.0


def test_a_request_that_fails_leaves_the_queue_without_making_it_look_fresh():
    """A refusal or error ends its claim; unlike work done, it must not restart the clock of the work still
    running, or a stream of bad requests would keep the worker looking busy."""
    from kvturn.router.workers import WorkerPool
    pool = WorkerPool(["http://p"], "prefill")
    worker = pool.workers[0]
    long = pool.claim(worker, 500.0)
    came = worker.pending[id(long)][1]
    refused = pool.claim(worker, 300.0)
    refused.release()  # answered 400 at once
    assert worker.last_done == 0.0 and worker.backlog_ms(came + 0.4) == pytest.approx(100.0, abs=1.0)
    long.release()


def test_a_reused_id_on_another_history_does_not_teach_the_token_rate():
    model = CostModel()
    model.tokens.observe_prompt(21_000, 6_300, known_bytes=20_000, known_tokens=6_000)
    before = model.tokens.prompt_tokens(31_000, known_bytes=30_000, known_tokens=6_000)
    model.tokens.observe_prompt(20_001, 8_000, known_bytes=20_000, known_tokens=6_000)  # 2,000 tokens for 1 byte added
    model.tokens.observe_prompt(40_000, 20, known_bytes=20_000, known_tokens=6_000)  # fewer tokens than the lease held
    assert model.tokens.prompt_tokens(31_000, known_bytes=30_000, known_tokens=6_000) == before


def test_one_stalled_sample_moves_the_compute_fit_only_so_far():
    fit = ComputeFit(fits.PRIOR)
    for _ in range(8):
        fit.add(500, 4000, 50.0)
    expected = fit.predict(500, 4000)
    fit.add(500, 4000, 5000.0)  # the process was stopped for 5 s
    assert fit.predict(500, 4000) < expected * 1.5


def test_the_new_tokens_of_a_turn_are_estimated_from_the_bytes_added_since_its_lease():
    model = CostModel()
    for _ in range(8):  # turns of an average text: 0.3 tokens a byte, in the whole prompt and in what a turn adds
        model.tokens.observe_prompt(21_000, 6_300, known_bytes=20_000, known_tokens=6_000)
    # A conversation whose text makes 0.2 tokens a byte: its 30,000-byte history holds 6,000 tokens; 1,000 bytes added.
    whole = model.tokens.prompt_tokens(31_000)
    anchored = model.tokens.prompt_tokens(31_000, known_bytes=30_000, known_tokens=6_000)
    assert anchored == 6_300
    assert whole - 6_000 > 10 * (anchored - 6_000)  # from the whole prompt, the 300 new tokens would seem 3,300
    assert model.tokens.prompt_tokens(29_000, known_bytes=30_000, known_tokens=6_000) == whole - 600  # history edited


def test_before_any_turn_on_a_lease_is_measured_the_added_bytes_make_tokens_at_the_first_prompts_rate():
    model = CostModel()
    model.tokens.observe_prompt(20_000, 4_400)  # a first turn: 0.22 tokens a byte
    assert model.tokens.prompt_tokens(21_000, known_bytes=20_000, known_tokens=4_400) == 4_620


def test_a_prefill_batched_with_other_prompts_teaches_the_model_nothing():
    model = CostModel()
    alone = {"prompt_tokens_computed": 300, "prompt_tokens_cached": 4000,
             "timing": {"prefill_compute_ms": 120.0, "prefill_shared_tokens": 7}}  # another prompt's last few tokens in its steps
    batched = {"prompt_tokens_computed": 300, "prompt_tokens_cached": 4000,
               "timing": {"prefill_compute_ms": 900.0, "prefill_shared_tokens": 4000}}  # a first turn beside it
    assert not reports.shared_steps(alone) and reports.shared_steps(batched)
    model.observe_prefill("decode", batched)
    assert model.prefill["decode"].samples == 0
    choice = choose(model, view(), "adaptive", 0.5)
    model.observe_turn(choice, actual_ms=10 * choice.predicted_ms[choice.path], explained_ms=900.0, shared=True)
    assert model.correction[choice.path].value == 1.0
    model.observe_prefill("decode", alone)
    assert model.prefill["decode"].samples == 1


@pytest.mark.parametrize("reply", [b'{"prefill_steps": [{"new_tokens": 512, "context_tokens": 0, "ms": 1e-300}]}',
                                   b'{"prefill_steps": "many"}', b'[1, 2]', b'not json', b'{"prefill_steps": [['
                                   b'true]]}'])
def test_a_workers_hostile_calibration_reply_neither_stops_the_router_nor_teaches_it(reply):
    """A real router starting in front of a worker that answers /kv/calibration with junk: it starts, learns
    nothing, and predicts from its prior."""
    import asyncio

    from aiohttp import web

    from kvturn.config import RouterConfig
    from kvturn.router.app import Router

    async def scenario():
        async def health(_):
            return web.json_response({"status": "ok", "backend": "kvturn"})

        async def calibration(_):
            return web.Response(body=reply, content_type="application/json")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/kv/calibration", calibration)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        router = Router(RouterConfig(prefill_urls=[url], decode_urls=[url]))
        try:
            await router.start()
            return router.costs, router.prefill.workers[0].calibration_asked
        finally:
            await router.stop()
            await runner.cleanup()

    costs, asked = asyncio.run(scenario())
    assert asked and costs.calibrations == {"prefill": 0, "decode": 0}
    assert costs.compute_ms("prefill", 3000, 0) == CostModel().compute_ms("prefill", 3000, 0)


@pytest.mark.integration
def test_with_the_models_tokenizer_the_router_counts_a_prompts_tokens(on_decode_stack):
    # Digits make about twice the tokens a byte that words do: estimated from bytes at the rate of words, a turn
    # of digits would seem to hold half the tokens it does. The first turn's whole prompt is counted, and later
    # the messages a turn adds to the history the lease holds.
    words = "the agent read the file and found nothing unusual in its contents " * 6
    digits = " ".join(str(i % 10) for i in range(600))
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for turn, text in enumerate((digits, words, words, digits)):
        messages.append({"role": "user", "content": f"Tool result {turn}: {text}"})
        results.append(send(on_decode_stack.url, messages, "counted", stream=False))
        messages.append({"role": "assistant", "content": results[-1]["text"]})
    first, last = results[0]["kvturn"], results[-1]["kvturn"]
    assert first["path"]["chosen"] == paths.RECOMPUTE and last["path"]["chosen"] == paths.COMPUTE_ON_DECODE
    for kvturn, computed in ((first, first["prompt_tokens_computed_prefill"]),
                             (last, last["decode"]["prompt_tokens_computed"])):
        assert computed > 500 and abs(kvturn["path"]["predicted_tokens_computed"] - computed) <= 0.1 * computed


@pytest.mark.parametrize("messages, order, added", [
    ([SYSTEM_MSG, USER, ANSWER, USER], 2, [USER]),  # the answer where the lease's turn left it, one message after
    ([SYSTEM_MSG, USER, ANSWER, USER, ANSWER, USER], 2, [USER, ANSWER, USER]),  # turns the router did not see
    ([SYSTEM_MSG, USER, ANSWER], 2, None),  # nothing added
    ([SYSTEM_MSG, USER, USER, USER], 2, None),  # the history was edited: no answer where it was
    ([SYSTEM_MSG, USER, "not a message", USER], 2, None),
    ([SYSTEM_MSG, USER, ANSWER, USER], 0, None),  # a completion's turn: no messages to extend
    ("not a list", 2, None),
])
def test_the_messages_a_turn_added_are_those_after_the_answer_of_the_turn_the_lease_holds(messages, order, added):
    assert keys.added_since(messages, order) == added


@pytest.mark.parametrize("messages, size, texts", [
    ([SYSTEM_MSG, USER], 100, ["You are an agent.", "Tool result: ok. Next step?"]),
    ([USER] * keys.MAX_COUNTED_MESSAGES, 100, [USER["content"]] * keys.MAX_COUNTED_MESSAGES),
    ([USER] * (keys.MAX_COUNTED_MESSAGES + 1), 100, None),  # a million tiny messages must not hold the event loop
    ([USER], keys.MAX_COUNTED_BYTES + 1, None),  # nor a long text
    ([USER, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], 100, None),  # parts: not plain text
    ([USER, {"role": "tool", "content": None}], 100, None),
    ([USER, "not a message"], 100, None),
    (None, 0, None),
])
def test_the_router_counts_only_plain_text_of_a_bounded_size(messages, size, texts):
    assert keys.countable_texts(messages, size) == texts


def test_the_router_counts_a_text_it_has_seen_from_memory_and_keeps_a_bounded_number(tiny_model_dir):
    from kvturn.model.tokenizer import ChatTokenizer
    tokenizer, calls = ChatTokenizer(tiny_model_dir), []

    class Counting:  # the model's tokenizer, its calls recorded
        def count(self, text: str) -> int:
            calls.append(text)
            return tokenizer.count(text)
    counts = keys.TextTokens(Counting(), most=2)
    history = ["You are an agent. " * 40, "Tool result: ok. Next step?", "Fertig: naïve café ✓"]
    assert [counts.count(text, "key-a:c1") for text in history] == [tokenizer.count(text) for text in history]
    assert counts.count(history[2], "key-a:c1") == tokenizer.count(history[2]) and len(calls) == 3  # the last two
    counts.count(history[0], "key-a:c1")  # the least recently used went: counted again, and the second text goes
    assert len(calls) == 4 and len(counts.counts) == 2
    counts.count(history[1], "key-a:c1")
    assert len(calls) == 5
    # Kept per conversation: another's count of the same text (another tenant's, say) is its own, and a turn of no
    # conversation is counted afresh every time.
    counts.count(history[1], "key-b:c1")
    counts.count(history[1], None)
    counts.count(history[1], None)
    assert len(calls) == 8 and len(counts.counts) == 2


def test_the_tokens_a_turn_adds_beyond_its_counted_text_are_learned_per_turn():
    model = CostModel()
    assert model.tokens.added_tokens(300) == 300 + tokens.ADDED_OVERHEAD_PRIOR
    for added in (312, 311, 313, 312, 900, 312):  # one turn whose history was not what the lease held
        model.tokens.observe_added(added, 300)
    assert model.tokens.added_tokens(100) == 112
    model.tokens.observe_added(300 + tokens.ADDED_OVERHEAD_BOUND + 1, 300)  # out of bounds: not learned
    assert model.tokens.added_tokens(100) == 112


def test_a_whole_prompts_template_tokens_are_learned_per_message():
    model = CostModel()
    assert model.tokens.templated_tokens(4000, 2) == 4000 + 2 * tokens.TEMPLATE_TOKENS_PRIOR
    for _ in range(fits.MIN_SAMPLES):
        model.tokens.observe_template(4014, 4000, 2)
    model.tokens.observe_template(9000, 4000, 2)  # not a template: another prompt than the one counted
    assert model.tokens.templated_tokens(3000, 4) == 3028
