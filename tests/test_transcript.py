"""The real-chat scenario's readable session, and the report of one conversation beside its TTFT per turn."""
import io

from rich.console import Console

from kvturn.bench import real_chat, transcript
from kvturn.bench.catalog import SCENARIOS, build_workload
from kvturn.bench.client import RequestRecord, RunResult


def test_real_chat_pastes_standard_library_source_and_asks_about_it():
    (conversation,) = build_workload("real-chat", None, 0, 8192, 4)
    assert len(conversation.turns) == len(real_chat.STEPS) and conversation.system == real_chat.SYSTEM
    first = conversation.turns[0].user
    assert "def dedent(text):" in first and real_chat.question_of(first) == "What does this function do?"
    scenario = SCENARIOS["real-chat"]
    assert scenario.show_conversation and not scenario.ignore_eos


def leg(ttfts: list[float], answers: list[str]) -> RunResult:
    messages = [{"role": "system", "content": "be brief"}]
    for n, answer in enumerate(answers):
        messages += [{"role": "user", "content": f"$ tool\n<pasted & {n}>\nquestion {n}?"},
                     {"role": "assistant", "content": answer}]
    requests = [RequestRecord("c", 0, n, 2 * n + 2, 0.0, False, ttft_ms=t, input_num_tokens=100 * (n + 1))
                for n, t in enumerate(ttfts)]
    return RunResult(requests=requests, transcript=messages)


def test_each_turn_shows_its_prompt_length_ttft_on_every_leg_and_the_speedup():
    results = {"off": leg([400.0, 900.0], ["a", "b"]), "on": leg([200.0, 300.0], ["a", "b"])}
    rows = transcript.turn_rows(results, "c")
    assert [(r["turn"], r["prompt_tokens"]["on"], r["ttft_ms"]["off"]) for r in rows] == [(1, 100, 400.0),
                                                                                       (2, 200, 900.0)]
    assert transcript.speedup(rows[1], ["off", "on"]) == 3.0
    out = io.StringIO()
    transcript.print_conversation(results, "c", Console(file=out, width=200))
    printed = out.getvalue()
    assert "3.00x" in printed and "question 1?" in printed and "A2 b" in printed and "yes, over the 2 turns" in printed
    page = transcript.html_section(results, "c")
    assert "&lt;pasted &amp; 0&gt;" in page and "<pasted" not in page


def test_answers_that_differ_between_legs_are_called_out():
    results = {"off": leg([400.0], ["a"]), "on": leg([200.0, 300.0], ["x", "b"])}
    assert transcript.same_answers(results) == "NO, over the 1 turns every leg answered"
