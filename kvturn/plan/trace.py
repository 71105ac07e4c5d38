"""What `kvturn plan` simulates: sessions of turns, each turn reduced to the token counts and the think time that
decide its cost. Read from anything `kvturn bench` replays (vLLM's multi-turn JSON or generator config, a
kvturn_synthetic config, a built-in scenario) or from a JSONL trace of real traffic, one request a line, as
`kvturn router --trace-out FILE` writes it:

    {"timestamp": 1764547200.12, "conversation_id": "c1", "prompt_tokens": 5120, "output_tokens": 48,
     "finished": 1764547201.9}

`timestamp` is when the request arrived (seconds); `finished` (optional) when its answer ended, so that the think
time before the next turn is known exactly; without it the think time is the gap between arrivals.
"""
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvturn.bench import compare, workload as bench_workload
from kvturn.model.tokenizer import ChatTokenizer

TRACE_FIELDS = {"timestamp": (int, float), "conversation_id": str, "prompt_tokens": int, "output_tokens": int}


@dataclass(frozen=True, slots=True)
class TurnDemand:
    prompt_tokens: int
    output_tokens: int
    # leading tokens of this prompt equal to the previous turn's prompt + answer; with answers resent shorter than
    # generated (resend_answers), the previous prompt + answer as generated, which this prompt continues
    shared_tokens: int
    think_s: float = 0.0  # from the end of the previous turn to the start of this one


@dataclass(slots=True)
class Session:
    conversation_id: str
    turns: list[TurnDemand] = field(default_factory=list)
    start_s: float | None = None  # when its first turn arrives; None: as soon as a client is free


@dataclass(slots=True)
class Workload:
    name: str
    sessions: list[Session]
    clients: int | None = None  # sessions replayed at once, each after the last (None: by the sessions' start_s)
    # Every prompt counts the answers before it at the tokens they were generated as (conversations, whose answers
    # are not known yet), not at what their text came to when resent (a trace counts what was sent)
    answers_as_generated: bool = False

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


class TraceError(ValueError):
    """A workload or trace file that cannot be read, with the file (and line) at fault."""


def continues(previous: TurnDemand, prompt_tokens: int) -> int:
    """Tokens a prompt shares with the previous turn's prompt and answer, when it extends them (an agent's next
    turn); a prompt shorter than that was edited or truncated, and nothing of it is assumed reusable."""
    history = previous.prompt_tokens + previous.output_tokens
    return history if prompt_tokens >= history else 0


def shares_history(previous: TurnDemand | None, turn: TurnDemand) -> bool:
    """Whether `turn` shares all of the previous turn's prompt and answer (as `continues` found it extend them)."""
    return previous is not None and turn.shared_tokens == previous.prompt_tokens + previous.output_tokens


def reusable(previous: TurnDemand | None, turn: TurnDemand, answer_share: float) -> int:
    """The leading tokens of `turn`'s prompt whose KV the previous turn can leave: its shared tokens, less the part
    of the previous answer that comes back as other tokens than those generated (all but `answer_share` of it;
    Calibration.answer_share), and never its last token. A prompt that does not continue the previous prompt and
    answer keeps its own."""
    shareable = turn.shared_tokens
    if shares_history(previous, turn):
        shareable = previous.prompt_tokens + int(answer_share * previous.output_tokens)
    return min(shareable, turn.prompt_tokens - 1)


def resend_answers(workload: Workload, ratio: float | None) -> Workload:
    """`workload` with each answer resent at `ratio` of the tokens generated (Calibration.resent_answer_ratio): a
    model's answer is sent back as text, which its tokenizer need not make into as many tokens again (the embedded
    random-weight model's come to about two thirds). Every later prompt of the session is shorter by what the
    answers before it lost; a turn that continued the previous prompt and answer still does, at the previous
    answer's generated length (the KV its decode worker holds), which may now reach past its own prompt. A
    trace, or no ratio measured, is kept as it is."""
    if ratio is None or not workload.answers_as_generated:
        return workload
    sessions = []
    for session in workload.sessions:
        turns: list[TurnDemand] = []
        answered = 0  # tokens generated before the turn; they come back as round(ratio x answered), not each alone
        for before, turn in zip([None, *session.turns], session.turns):
            prompt = max(turn.prompt_tokens - (answered - round(ratio * answered)), 1)
            shared = turns[-1].prompt_tokens + before.output_tokens if shares_history(before, turn) else \
                min(turn.shared_tokens, prompt)
            turns.append(replace(turn, prompt_tokens=prompt, shared_tokens=shared))
            answered += turn.output_tokens
        sessions.append(replace(session, turns=turns))
    return replace(workload, sessions=sessions, answers_as_generated=False)


def from_conversations(name: str, conversations: list, tokenizer, clients: int) -> Workload:
    """Token counts of conversations as the bench replays them: the chat template around the system prompt, the
    user turns so far and the answers (each as long as the tokens asked for, as with ignore_eos)."""
    sessions = []
    for conv in conversations:
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        system_tokens = len(tokenizer.encode(tokenizer.apply_chat_template(messages))) if messages else 0
        answered, turns = 0, []
        for turn in conv.turns:
            messages.append({"role": "user", "content": turn.user})
            prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages))) + answered
            shared = min(system_tokens, prompt) if turn.edit_history else (
                continues(turns[-1], prompt) if turns else 0)
            turns.append(TurnDemand(prompt, turn.answer_tokens, shared, turn.gap_s if turns else 0.0))
            messages.append({"role": "assistant", "content": ""})
            answered += turn.answer_tokens
        sessions.append(Session(conv.conversation_id, turns))
    return Workload(name, sessions, clients, answers_as_generated=True)


def _trace_record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected an object with {', '.join(TRACE_FIELDS)}")
    for name, kind in TRACE_FIELDS.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TraceError(f"{where}: {name!r} missing or not {getattr(kind, '__name__', 'a number')}")
    if record["prompt_tokens"] < 1 or record["output_tokens"] < 1:
        raise TraceError(f"{where}: prompt_tokens and output_tokens must be at least 1")
    finished = record.get("finished")
    if finished is not None and (not isinstance(finished, (int, float)) or finished < record["timestamp"]):
        raise TraceError(f"{where}: 'finished' must be a number not before 'timestamp'")
    return record


def from_trace(path: Path) -> Workload:
    """A JSONL trace: requests grouped by conversation in time order; each conversation starts at its first
    request's time, relative to the trace's first request."""
    by_conversation: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                record = _trace_record(line, f"{path}:{number}")
                by_conversation.setdefault(record["conversation_id"], []).append(record)
    if not by_conversation:
        raise TraceError(f"{path}: no requests in the trace")
    origin = min(r["timestamp"] for records in by_conversation.values() for r in records)
    sessions = []
    for conversation_id, records in by_conversation.items():
        records.sort(key=lambda r: r["timestamp"])
        turns: list[TurnDemand] = []
        for previous, record in zip([None, *records], records):
            think = 0.0
            if previous is not None:
                think = max(record["timestamp"] - previous.get("finished", previous["timestamp"]), 0.0)
            shared = continues(turns[-1], record["prompt_tokens"]) if turns else 0
            turns.append(TurnDemand(record["prompt_tokens"], record["output_tokens"], shared, think))
        sessions.append(Session(conversation_id, turns, records[0]["timestamp"] - origin))
    return Workload(Path(path).stem, sorted(sessions, key=lambda s: s.start_s))


def from_scenario(scenario: str, model_dir: str, seed: int, max_prompt_tokens: int, turns: int,
                  clients: int) -> Workload:
    """A built-in `kvturn bench` scenario, built as the bench builds it from the same seed."""
    tokenizer = ChatTokenizer(model_dir)
    conversations = compare.build_workload(scenario, bench_workload.TextSource(tokenizer), seed, max_prompt_tokens,
                                           turns)
    return from_conversations(scenario, conversations, tokenizer, clients)


def load(path: Path, model_dir: Callable[[], str], seed: int, clients: int) -> Workload:
    """Any input `kvturn bench --workload` takes (its text counted in tokens by the model's tokenizer), or a JSONL
    trace (by its .jsonl suffix, or JSON that is one trace record). `model_dir()` is called only for text to
    tokenize: a trace counts tokens already, and needs no model (nor torch, which finding one imports)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        return from_trace(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a JSON workload ({exc}); a trace needs the .jsonl suffix") from None
    if isinstance(data, dict) and "timestamp" in data:
        return from_trace(path)
    tokenizer = ChatTokenizer(model_dir())
    try:
        conversations = bench_workload.load_file(path, tokenizer, seed)
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceError(str(exc)) from None
    return from_conversations(path.stem, conversations, tokenizer, clients)
