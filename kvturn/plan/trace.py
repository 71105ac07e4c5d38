"""What `kvturn plan` simulates: sessions of turns, each reduced to the token counts and think time that decide its
cost, read from anything `kvturn bench` replays or from a JSONL trace of real traffic as `kvturn router --trace-out`
writes it (the format: docs/planner.md)."""
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvturn.bench import catalog
from kvturn.bench import workload as bench_workload
from kvturn.config import EngineConfig, default_of
from kvturn.model.tokenizer import ChatTokenizer
from kvturn.plan import json_files

MAX_TIMESTAMP_S = 1e11  # a finite time in seconds, epoch or relative (year 5138)
MAX_TOKENS = 2**24  # of a prompt or an answer
STEP_TOKENS = default_of(EngineConfig, "max_num_batched_tokens")  # a simulated prefill step's most


@dataclass(frozen=True, slots=True)
class TurnDemand:
    prompt_tokens: int
    output_tokens: int
    shared_tokens: int  # leading tokens of this prompt equal to the previous turn's prompt + answer
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

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def simulated_steps(self) -> int:
        """The steps a simulation of it takes at least: one a turn, and one per STEP_TOKENS of a prompt."""
        return sum(max(1, -(-t.prompt_tokens // STEP_TOKENS)) for s in self.sessions for t in s.turns)


class TraceError(ValueError):
    """A workload or trace file that cannot be read, with the file (and line) at fault."""


def continues(turns: list[TurnDemand], prompt_tokens: int, said: int | None = None) -> int:
    """Tokens a prompt shares with the prompt and answer of the last of `turns` (none without one): what a trace line
    `said`, within that history; else from lengths alone: all of them when it extends them; the previous prompt
    when the answer came back shorter (thinking dropped from the history); nothing when it is shorter than the
    previous prompt (edited or truncated)."""
    if not turns:
        return 0
    previous = turns[-1]
    history = previous.prompt_tokens + previous.output_tokens
    if said is not None:
        return min(said, history)
    if prompt_tokens >= history:
        return history
    return previous.prompt_tokens if prompt_tokens >= previous.prompt_tokens else 0


def reusable(previous: TurnDemand | None, turn: TurnDemand) -> int:
    """The leading tokens of `turn`'s prompt whose KV the previous turn can leave: its shared tokens, never its
    last token (computed for its logits)."""
    return min(turn.shared_tokens, turn.prompt_tokens - 1) if previous is not None else 0


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
            shared = min(system_tokens, prompt) if turn.edit_history else continues(turns, prompt)
            turns.append(TurnDemand(prompt, turn.answer_tokens, shared, turn.gap_s if turns else 0.0))
            messages.append({"role": "assistant", "content": ""})
            answered += turn.answer_tokens
        sessions.append(Session(conv.conversation_id, turns))
    return Workload(name, sessions, clients)


class TraceRecord(BaseModel):
    """One line of a trace, as `kvturn router --trace-out` writes it."""
    model_config = ConfigDict(strict=True, frozen=True)
    timestamp: float = Field(allow_inf_nan=False, ge=-MAX_TIMESTAMP_S, le=MAX_TIMESTAMP_S)
    conversation_id: str
    prompt_tokens: int = Field(ge=1, le=MAX_TOKENS)
    output_tokens: int = Field(ge=1, le=MAX_TOKENS)
    finished: float | None = Field(None, allow_inf_nan=False, ge=-MAX_TIMESTAMP_S, le=MAX_TIMESTAMP_S)
    shared_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _in_order(self) -> "TraceRecord":
        if self.finished is not None and self.finished < self.timestamp:
            raise ValueError("'finished' must not be before 'timestamp'")
        if self.shared_tokens is not None and self.shared_tokens > self.prompt_tokens:
            raise ValueError("'shared_tokens' must be a whole number from 0 to 'prompt_tokens'")
        return self


def from_trace(path: Path) -> Workload:
    """A JSONL trace: requests grouped by conversation in time order; each conversation starts at its first
    request's time, relative to the trace's first request."""
    try:
        text = json_files.read_text(path)
    except json_files.Unreadable as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc})") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    by_conversation: dict[str, list[TraceRecord]] = {}
    for number, line in lines:  # a line that is wrong is named, with the field at fault
        if len(line) > json_files.MAX_LINE_BYTES:
            raise TraceError(f"{path}:{number}: a line of {len(line)} characters, over the "
                             f"{json_files.MAX_LINE_BYTES} a trace line may have")
        try:
            record = TraceRecord.model_validate(json_files.loads(line))
        except json_files.Unreadable as exc:
            raise TraceError(f"{path}:{number}: {exc}") from None
        except ValidationError as exc:
            wrong = "; ".join(f"'{'.'.join(map(str, e['loc']))}' {e['msg']}" if e["loc"] else e["msg"]
                              for e in exc.errors())
            raise TraceError(f"{path}:{number}: {wrong}") from None
        by_conversation.setdefault(record.conversation_id, []).append(record)
    if not by_conversation:
        raise TraceError(f"{path}: no requests in the trace")
    origin = min(record.timestamp for turns_of in by_conversation.values() for record in turns_of)
    sessions = []
    for conversation_id, turns_of in by_conversation.items():
        turns_of.sort(key=lambda r: r.timestamp)
        turns: list[TurnDemand] = []
        ends = [r.timestamp if r.finished is None else r.finished for r in turns_of]  # of its answer, or its arrival
        for index, record in enumerate(turns_of):
            think = max(record.timestamp - ends[index - 1], 0.0) if index else 0.0
            shared = continues(turns, record.prompt_tokens, record.shared_tokens)
            turns.append(TurnDemand(record.prompt_tokens, record.output_tokens, shared, think))
        sessions.append(Session(conversation_id, turns, turns_of[0].timestamp - origin))
    return Workload(Path(path).stem, sorted(sessions, key=lambda s: s.start_s))


def from_scenario(scenario: str, model_dir: str, seed: int, max_prompt_tokens: int, turns: int,
                  clients: int, sessions: int | None = None, gap_scale: float = 1.0) -> Workload:
    """A built-in `kvturn bench` scenario, built as the bench builds it from the same seed (`sessions` of them,
    default the scenario's; think times times `gap_scale`, as the bench's --gap-scale)."""
    tokenizer = ChatTokenizer(model_dir)
    conversations = catalog.build_workload(scenario, bench_workload.TextSource(tokenizer), seed, max_prompt_tokens,
                                           turns, sessions)
    bench_workload.scale_gaps(conversations, gap_scale)
    return from_conversations(scenario, conversations, tokenizer, clients)


def load(path: Path, model_dir: Callable[[], str], seed: int, clients: int) -> Workload:
    """Any input `kvturn bench --workload` takes (its text counted by the model's tokenizer), or a JSONL trace
    (.jsonl). `model_dir()` is called only for text to tokenize: a trace needs no model."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        return from_trace(path)
    try:
        json_files.read_json(path)
    except json_files.Unreadable as exc:
        raise TraceError(f"{path}: not a JSON workload ({exc}); a trace needs the .jsonl suffix") from None
    tokenizer = ChatTokenizer(model_dir())
    try:
        conversations = bench_workload.load_file(path, tokenizer, seed)
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceError(str(exc)) from None
    if not conversations:
        raise TraceError(f"{path}: no conversation with a user turn to plan")
    return from_conversations(path.stem, conversations, tokenizer, clients)
