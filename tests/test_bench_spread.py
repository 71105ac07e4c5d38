"""Numbers with their spread: `kvturn bench --repeats N` interleaves the legs, reports each figure's median and
range, and names a winner only when the legs' ranges are apart."""
import math

import pytest

from kvturn.bench import spread
from kvturn.bench.client import RequestRecord, RunResult, SessionRecord
from kvturn.bench.compare import interleaved
from kvturn.bench.report import summarize

PD, BIDIR = "pd/P-cache-on", "bidir/P-cache-on"


def span(low: float, high: float) -> dict:
    return {"median": (low + high) / 2, "min": low, "max": high}


@pytest.mark.parametrize("baseline, candidate, word", [
    (span(100, 200), span(150, 300), "within noise"),
    (span(100, 200), span(50, 120), "within noise"),
    (span(100, 200), span(120, 180), "within noise"),  # one inside the other
    (span(100, 200), span(200, 260), "within noise"),  # touching ends name no winner
    (span(100, 200), span(20, 99), "lower"),
    (span(100, 200), span(201, 400), "higher"),
    (span(100, 100), span(90, 90), "lower"),  # one repeat each: points apart
])
def test_compare_names_a_winner_only_when_the_ranges_are_apart(baseline, candidate, word):
    assert spread.compare(baseline, candidate) == word


def leg_run(ttft_ms: list[float], session_s: float = 1.0, retained: float = 0.0) -> RunResult:
    """A leg's result of one repeat: one session whose turns took these TTFTs."""
    result = RunResult(runtime_s=1.0, retained_kv=[(0.0, 0.0), (0.5, retained)])
    for turn, ttft in enumerate(ttft_ms):
        result.requests.append(RequestRecord("c", 0, turn, 2 * turn + 1, 0.0, warmup=False, ttft_ms=ttft,
                                             tpot_ms=5.0, latency_ms=ttft + 50))
    result.sessions.append(SessionRecord("c", 0, 0.0, duration_s=session_s, turns_completed=len(ttft_ms)))
    return result


def repeats_of(pd_ttft: list[float], bidir_ttft: list[float]) -> list[list[dict]]:
    """Each repeat's summaries of the two legs, every turn of a leg at the same TTFT."""
    return [[summarize(PD, leg_run([pd] * 3)), summarize(BIDIR, leg_run([bidir] * 3, retained=4 * 2**20))]
            for pd, bidir in zip(pd_ttft, bidir_ttft)]


def test_each_figure_is_the_median_and_range_of_the_repeats():
    legs = spread.leg_spreads(repeats_of([400, 380, 500], [100, 300, 90]))
    assert legs[PD]["ttft_p50_ms"] == {"median": 400, "min": 380, "max": 500, "values": [400, 380, 500]}
    assert legs[BIDIR]["ttft_p50_ms"]["median"] == 100 and legs[BIDIR]["later_ttft_p50_ms"]["max"] == 300
    assert legs[BIDIR]["peak_retained_mib"]["median"] == 4.0 and legs[BIDIR]["mean_retained_mib"]["median"] == 2.0
    assert legs[PD]["repeats"] == 3 and legs[PD]["failed"] == 0


def test_ratios_are_taken_within_each_repeat():
    """The median of the per-repeat ratios (0.25, 0.5, 1.0) is not the ratio of the medians (150 / 400)."""
    ratios = spread.ratio_spreads(repeats_of([400, 400, 400], [100, 200, 400]))
    ttft = ratios[f"{BIDIR} / {PD}"]["ttft_p50_ms"]
    assert ttft["values"] == [0.25, 0.5, 1.0] and ttft["median"] == 0.5


def test_a_verdict_on_overlapping_ranges_says_within_noise_and_names_no_winner():
    """The three runs that started this: bidir/pd TTFT p50 of 0.74x, 0.60x and 2.20x."""
    runs = repeats_of([1000, 1000, 1000], [740, 600, 2200])
    words = spread.verdict(spread.leg_spreads(runs), spread.ratio_spreads(runs), 3)
    assert f"{BIDIR} against {PD} over 3 repeats" in words
    assert "TTFT p50 740 (600-2200) against 1000 ms: within noise (0.74x (0.60x-2.20x))" in words
    assert "lower" not in words and "higher" not in words


def test_a_verdict_on_ranges_apart_names_the_lower_leg():
    runs = repeats_of([1000, 900, 1100], [300, 250, 320])
    words = spread.verdict(spread.leg_spreads(runs), spread.ratio_spreads(runs), 3)
    assert "TTFT p50 300 (250-320) against 1000 (900-1100) ms: lower" in words
    assert "holding up to 4.0 MiB of retained KV" in words


def test_a_leg_without_a_baseline_is_reported_alone():
    runs = [[summarize("colocated", leg_run([30, 40, 50]))], [summarize("colocated", leg_run([60, 60, 60]))]]
    words = spread.verdict(spread.leg_spreads(runs), spread.ratio_spreads(runs), 2)
    assert words == "colocated: TTFT p50 50.0 (40.0-60.0) ms over 2 repeats."


def test_figures_missing_from_a_repeat_are_left_out_of_its_spread():
    assert spread.spread([3.0, None, math.nan, 1.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0]}
    assert spread.spread([None, math.nan]) is None


def test_the_legs_run_interleaved_once_per_repeat():
    assert interleaved(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert interleaved(["A", "B"], 1) == [(0, "A"), (0, "B")]


def test_the_markdown_summary_is_stamped_with_machine_date_commit_and_command():
    runs = repeats_of([1000, 900, 1100], [300, 250, 320])
    legs, ratios = spread.leg_spreads(runs), spread.ratio_spreads(runs)
    info = {"cpu": "Some CPU", "cores": 2, "memory_gib": 23.5, "torch": "2.13.0", "date": "2030-01-02",
            "commit": "abc123def456"}
    text = spread.markdown("kvturn bench: sweep", info, "kvturn bench --repeats 3", 3, legs, ratios, "the verdict")
    assert "Some CPU, 2 cores" in text and "2030-01-02" in text and "commit abc123def456" in text
    assert "`kvturn bench --repeats 3`" in text and "over 3 repeats" in text and text.rstrip().endswith("the verdict")
    assert f"| {BIDIR} | 300 (250-320) |" in text
    assert f"| {BIDIR} / {PD} | 0.29x (0.28x-0.30x) |" in text


def test_repeats_need_compare(tiny_model_dir):
    from typer.testing import CliRunner

    from kvturn.cli import app
    result = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--repeats", "2"])
    assert result.exit_code == 2 and "--repeats needs --compare" in " ".join(result.output.replace("│", " ").split())


def test_overlapping_ranges_whose_every_repeat_agrees_say_so_and_still_name_no_winner():
    """The machine's pace moved between repeats (pd 1.4 s to 4.3 s) more than the legs differed within one."""
    runs = repeats_of([1400, 3000, 4300], [560, 1200, 1700])
    words = spread.verdict(spread.leg_spreads(runs), spread.ratio_spreads(runs), 3)
    assert "TTFT p50 1200 (560-1700) against 3000 (1400-4300) ms: within noise, though lower within each repeat" in words
    assert ": lower" not in words


def test_the_longest_prompts_speedup_against_its_ideal_is_given_with_its_spread():
    ideals = [{"prompt_tokens": 8891, "measured_speedup": m, "ideal_speedup": 15.0, "fraction_of_ideal": m / 15.0,
               "other_ms": o} for m, o in ((14.8, 27.0), (10.0, 40.0), (12.0, 30.0))]
    ideal = spread.ideal_spread(ideals + [None, {"note": "the ON leg did not reuse KV at the longest prompt"}])
    assert ideal["repeats"] == 3 and ideal["measured_speedup"]["median"] == 12.0
    assert spread.ideal_text(ideal) == (
        "At the longest prompt (8891 tokens), over 3 repeats: TTFT OFF/ON 12.00x (10.00x-14.80x) against an ideal of "
        "15.00x, measured/ideal 80% (67%-99%); time outside compute and transfer in the ON turn 30.0 (27.0-40.0) ms.")
    assert spread.ideal_spread([None]) is None


def test_a_verdict_leads_with_sessions_and_calls_a_leg_slower_whose_sessions_got_slower_though_ttft_fell():
    runs = [[summarize(PD, leg_run([8000] * 3, session_s=pd_s)), summarize(BIDIR, leg_run([2400] * 3, session_s=s))]
            for pd_s, s in ((65.0, 110.0), (70.0, 114.0), (60.0, 120.0))]
    words = spread.verdict(spread.leg_spreads(runs), spread.ratio_spreads(runs), 3)
    assert words.startswith(f"{BIDIR} against {PD} over 3 repeats: sessions slower; session p50 114.0 (110.0-120.0) "
                            "against 65.0 (60.0-70.0) s: higher")
    assert "TPOT p50 5.0 against 5.0 ms: within noise" in words and "TTFT p50 2400 against 8000 ms: lower" in words
