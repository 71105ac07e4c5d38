"""The three paths of a turn: the pure choice, the cost model's learning, and the compute-on-decode path
through real processes."""
import pytest

from chat import conversation
from kvturn.launch import LocalStack
from kvturn.router import paths
from kvturn.router.paths import ComputeFit, CostModel, TurnView, choose


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
    model.observe_prefill("prefill", report)
    assert model.read_ms_per_mib.value == pytest.approx(0.25)
    assert model.bytes_per_token.value == pytest.approx(4096)


@pytest.fixture(scope="module")
def on_decode_stack(tiny_model_dir, tmp_path_factory):
    stack = LocalStack(tiny_model_dir, kv_cache_mb=64, prefix_caching_on_prefill=False,
                       router_args=["--path-policy", "compute_on_decode"], log_dir=tmp_path_factory.mktemp("paths"))
    with stack:
        yield stack


def test_compute_on_decode_reads_nothing_and_answers_as_a_colocated_worker(on_decode_stack, tiny_model_dir, tmp_path):
    messages, results = conversation(on_decode_stack.url, 3, conversation_id="on-decode")
    later = results[1]["kvturn"]
    assert later["path"]["chosen"] == paths.COMPUTE_ON_DECODE
    assert later["bytes_d_to_p"] == 0 and later["bytes_p_to_d"] == 0 and later["prefill_worker"] == ""
    decode = later["decode"]
    assert decode["prompt_tokens_cached"] > 0 and decode["prompt_tokens_computed"] < decode["prompt_tokens_cached"]
    with LocalStack(tiny_model_dir, mode="colocated", kv_cache_mb=64, log_dir=tmp_path) as colocated:
        _, reference = conversation(colocated.url, 3, conversation_id="reference")
    assert [r["text"] for r in results] == [r["text"] for r in reference]
