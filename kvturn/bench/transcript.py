"""One conversation shown to a person: its questions and the model's answers, and each turn's prompt length and
time to first token on every leg, side by side (for scenarios that ask for it, such as real-chat)."""
import html

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvturn.bench.client import RunResult
from kvturn.bench.real_chat import question_of


def turn_rows(results: dict[str, RunResult], conversation_id: str) -> list[dict]:
    """Per turn of the conversation: prompt tokens, TTFT and reuse outcome on each leg."""
    rows: dict[int, dict] = {}
    for leg, result in results.items():
        for r in result.requests:
            if r.conversation_id != conversation_id or r.error is not None:
                continue
            row = rows.setdefault(r.turn, {"turn": r.turn + 1, "prompt_tokens": {}, "ttft_ms": {}, "reuse": {}})
            row["prompt_tokens"][leg] = r.input_num_tokens
            row["ttft_ms"][leg] = r.ttft_ms
            row["reuse"][leg] = r.reuse
    return [rows[t] for t in sorted(rows)]


def exchanges(messages: list[dict]) -> list[tuple[str, str, int]]:
    """(question, answer, lines of pasted tool output) per turn of a transcript."""
    turns = []
    for i, message in enumerate(messages):
        if message["role"] == "user":
            answer = messages[i + 1]["content"] if i + 1 < len(messages) else ""
            turns.append((question_of(message["content"]), answer, message["content"].count("\n")))
    return turns


def same_answers(results: dict[str, RunResult]) -> str:
    """Whether every leg gave the same answers, over the turns that all of them answered."""
    answers = [[m["content"] for m in r.transcript if m["role"] == "assistant"] for r in results.values()]
    common = min(map(len, answers), default=0)
    same = all(a[:common] == answers[0][:common] for a in answers)
    return f"{'yes' if same else 'NO'}, over the {common} turns every leg answered"


def speedup(row: dict, legs: list[str]) -> float | None:
    first, last = row["ttft_ms"].get(legs[0]), row["ttft_ms"].get(legs[-1])
    return first / last if len(legs) > 1 and first and last else None


def print_conversation(results: dict[str, RunResult], conversation_id: str, console: Console) -> None:
    legs, rows = list(results), turn_rows(results, conversation_id)
    table = Table(title=f"one conversation, turn by turn ({conversation_id})")
    for col in ["turn", "prompt tokens", *(f"TTFT {leg}" for leg in legs), "speedup", "question"]:
        table.add_column(col, justify="left" if col == "question" else "right")
    questions = [q for q, _, _ in exchanges(next(iter(results.values())).transcript)]
    for row in rows:
        ratio = speedup(row, legs)
        question = questions[row["turn"] - 1] if row["turn"] <= len(questions) else ""
        table.add_row(str(row["turn"]), "/".join(sorted({str(n) for n in row["prompt_tokens"].values()})),
                      *(f"{row['ttft_ms'][leg]:.0f} ms" if leg in row["ttft_ms"] else "-" for leg in legs),
                      f"{ratio:.2f}x" if ratio else "-", question)
    console.print(table)
    console.print(f"[bold]the conversation[/bold] (answers as the last leg gave them; identical on every leg: "
                  f"{same_answers(results)})")
    for n, (question, answer, pasted) in enumerate(exchanges(results[legs[-1]].transcript), 1):
        console.print(Text.assemble((f"Q{n} ", "bold cyan"), (f"(after {pasted} pasted lines) ", "dim"), question))
        console.print(Text.assemble((f"A{n} ", "bold green"), answer))


def html_section(results: dict[str, RunResult], conversation_id: str) -> str:
    """The same as print_conversation, as a page section; each pasted tool output folds away."""
    legs, rows = list(results), turn_rows(results, conversation_id)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["turn", "prompt tokens", *(f"TTFT {leg} (ms)"
                                                                                       for leg in legs), "speedup"])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in [
        row["turn"], "/".join(sorted({str(n) for n in row["prompt_tokens"].values()})),
        *(f"{row['ttft_ms'][leg]:.0f}" if leg in row["ttft_ms"] else "-" for leg in legs),
        f"{speedup(row, legs):.2f}x" if speedup(row, legs) else "-"]) + "</tr>" for row in rows)
    messages = results[legs[-1]].transcript
    turns = []
    for message in messages:
        text = html.escape(message["content"])
        if message["role"] == "user":
            pasted, question = text.rsplit("\n", 1) if "\n" in text else ("", text)
            fold = f"<details><summary>pasted tool output</summary><pre>{pasted}</pre></details>" if pasted else ""
            turns.append(f"<p><b>user</b>: {fold}{question}</p>")
        else:
            turns.append(f"<p style='white-space:pre-wrap'><b>{html.escape(message['role'])}</b>: {text}</p>")
    return (f"<h2>One conversation, turn by turn ({html.escape(conversation_id)})</h2>"
            f"<table><tr>{head}</tr>{body}</table>"
            f"<h3>The conversation (answers identical on every leg: {same_answers(results)})</h3>"
            + "".join(turns))
