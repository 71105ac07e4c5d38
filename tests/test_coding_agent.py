"""The coding-agent scenario's workload: the shape of public coding-agent traces scaled to a context cap."""
import numpy as np
import pytest

from kvturn.bench import workload
from kvturn.bench.catalog import LEGS, SCENARIOS, build_workload
from kvturn.bench.coding_agent import (MESSAGE_OVERHEAD_TOKENS, CodingAgentShape, plan_session, prompt_tokens,
                                       think_time_sigma)
from kvturn.model.tokenizer import ChatTokenizer

SHAPE = CodingAgentShape()


def sessions(cap: int, count: int = 300, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [plan_session(SHAPE, rng, cap) for _ in range(count)]


def test_a_session_has_about_twenty_turns_and_grows_from_4k_to_near_32k():
    planned = sessions(32768)
    prompts = [prompt_tokens(turns) for turns in planned]
    assert 17 <= np.median([len(turns) for turns in planned]) <= 20
    assert all(p[0] == 4096 for p in prompts)
    assert 22_000 <= np.median([p[-1] for p in prompts]) <= 32768
    assert all(np.all(np.diff(p) > 0) for p in prompts)  # the context only grows


def test_no_turn_outgrows_the_cap_counting_its_answer_and_template():
    for cap in (32768, 4096, 1024):
        for turns in sessions(cap, 100):
            for index, (prompt, turn) in enumerate(zip(prompt_tokens(turns), turns)):
                assert (prompt + turn.answer_tokens) * 1.1 + MESSAGE_OVERHEAD_TOKENS * 2 * (index + 1) <= cap


def test_most_tool_results_are_small_and_some_are_a_whole_file():
    results = [turn.user_tokens for turns in sessions(32768) for turn in turns[1:]]
    small = [n for n in results if 100 <= n <= 2000]
    large = [n for n in results if 4000 <= n <= 8000]
    assert len(small) + len(large) == len(results)
    assert 0.05 <= len(large) / len(results) <= 0.15
    answers = [turn.answer_tokens for turns in sessions(32768) for turn in turns]
    assert min(answers) >= 50 and max(answers) <= 400


def test_think_times_have_the_traces_median_and_heavy_tail():
    gaps = [turn.gap_s for turns in sessions(32768, 1000) for turn in turns[1:]]
    assert all(turn.gap_s == 0.0 for turns in sessions(32768, 20) for turn in turns[:1])
    assert 4.6 <= np.median(gaps) <= 5.8
    assert 60 <= np.percentile(gaps, 99) <= 110
    assert max(gaps) <= SHAPE.think_max_s
    assert think_time_sigma(5.2, 81.0) == pytest.approx(1.18, abs=0.01)


def test_a_small_cap_keeps_the_shape_at_smaller_sizes():
    planned = sessions(4096)
    prompts = [prompt_tokens(turns) for turns in planned]
    assert 15 <= np.median([len(turns) for turns in planned]) <= 20
    assert all(p[0] == 512 for p in prompts)
    assert np.median([p[-1] / p[0] for p in prompts]) >= 5  # still grows several times over
    assert all(8 <= turn.answer_tokens <= 50 for turns in planned for turn in turns)


def test_the_gap_scale_multiplies_every_think_time():
    conversations = [workload.Conversation("a", "", [workload.Turn("x", 4, 0.0), workload.Turn("y", 4, 80.0)])]
    workload.scale_gaps(conversations, 0.05)
    assert [t.gap_s for t in conversations[0].turns] == [0.0, 4.0]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gap scale"):
            workload.scale_gaps(conversations, bad)


def test_the_scenario_builds_sessions_whose_text_fits_the_cap(tiny_model_dir):
    tokenizer = ChatTokenizer(tiny_model_dir)
    conversations = build_workload("coding-agent", workload.TextSource(tokenizer), 3, 2048, turns=4)
    assert len(conversations) == SCENARIOS["coding-agent"].sessions
    for conv in conversations:
        texts = [conv.system] + [turn.user for turn in conv.turns]
        total = sum(len(tokenizer.encode(t)) for t in texts) + sum(turn.answer_tokens for turn in conv.turns)
        assert total <= 2048 and len(conv.turns) >= 10
        assert conv.turns[0].gap_s == 0.0 and any(turn.gap_s > 0 for turn in conv.turns)
    assert build_workload("coding-agent", workload.TextSource(tokenizer), 3, 2048, turns=4)[0].system == \
        conversations[0].system  # seeded


def test_the_scenario_compares_pd_bidir_and_adaptive_with_ps_cache_off():
    legs = SCENARIOS["coding-agent"].legs
    assert set(legs) == {"pd/P-cache-off", "bidir/P-cache-off", "adaptive"}
    assert not any(LEGS[leg].prefix_caching_on_prefill for leg in legs)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sessions_sets_how_many_conversations_every_scenario_builds(tiny_model_dir, scenario):
    source = workload.TextSource(ChatTokenizer(tiny_model_dir))
    conversations = build_workload(scenario, source, 1, 2048, turns=2, sessions=5)
    assert len(conversations) == 5
    assert len({conv.conversation_id for conv in conversations}) == 5
    with pytest.raises(ValueError, match="sessions"):
        build_workload(scenario, source, 1, 2048, turns=2, sessions=0)
