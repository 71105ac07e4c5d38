"""Multi-turn conversations to replay: synthetic agent sessions, and vLLM's two input formats.

A conversation is a system prompt and a list of turns; each turn is the new user text
(a user message or a tool result), how many answer tokens to ask for, and the think/tool
time before it is sent. The model's real answers go into the history, as an agent's would.
"""
import json
import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvturn.bench.distributions import Distribution

# Bounds of a workload file, so that a wrong number is refused rather than replayed for days or out of memory
MAX_SESSIONS = 100_000
MAX_TURNS = 10_000  # of one session
MAX_TEXT_TOKENS = 1 << 20  # of one system prompt, user turn or answer
MAX_GAP_S = 7 * 86_400
CORPUS_MODULES = ["argparse", "typing", "inspect", "dataclasses", "subprocess", "threading", "pathlib", "textwrap"]


@dataclass(slots=True)
class Turn:
    user: str
    answer_tokens: int
    gap_s: float = 0.0
    edit_history: bool = False  # rewrite an earlier message before sending (scenario edited-history)


@dataclass(slots=True)
class Conversation:
    conversation_id: str
    system: str
    turns: list[Turn] = field(default_factory=list)


class TextSource:
    """Text of about N tokens, cut from a corpus at seeded offsets."""

    def __init__(self, tokenizer, files: list[Path] | None = None):
        self.tokenizer = tokenizer
        if files:
            text = "\n".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
        else:
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            text = "\n".join((stdlib / f"{m}.py").read_text(encoding="utf-8") for m in CORPUS_MODULES)
        self.ids = tokenizer.encode(text)
        if len(self.ids) < 1000:
            raise ValueError("the text corpus is too small (need at least 1000 tokens)")

    def text(self, rng: np.random.Generator, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        pieces, remaining = [], num_tokens
        while remaining > 0:
            take = min(remaining, len(self.ids) - 1)
            start = int(rng.integers(0, len(self.ids) - take))
            pieces.append(self.tokenizer.decode(self.ids[start:start + take]))
            remaining -= take
        return " ".join(pieces)


@dataclass(slots=True)
class SyntheticSpec:
    """An agent session shape; each field is a distribution (see distributions.py)."""
    num_sessions: int = 8
    system_tokens: object = 1000
    num_turns: object = 5
    new_tokens: object = 150
    answer_tokens: object = 32
    gap_s: object = 0.0


def synthetic(spec: SyntheticSpec, source: TextSource, seed: int, id_prefix: str = "session") -> list[Conversation]:
    rng = np.random.default_rng(seed)
    system, turns, new, answer, gap = (Distribution(getattr(spec, f), f, most) for f, most in
                                       (("system_tokens", MAX_TEXT_TOKENS), ("num_turns", MAX_TURNS),
                                        ("new_tokens", MAX_TEXT_TOKENS), ("answer_tokens", MAX_TEXT_TOKENS),
                                        ("gap_s", MAX_GAP_S)))
    _check_count(spec.num_sessions, "num_sessions", MAX_SESSIONS)
    conversations = []
    for i in range(spec.num_sessions):
        conv = Conversation(f"{id_prefix}-{seed}-{i}", source.text(rng, system.sample_int(rng, 1)))
        for _ in range(turns.sample_int(rng, 1)):
            conv.turns.append(Turn(source.text(rng, new.sample_int(rng, 1)), answer.sample_int(rng, 1),
                                   gap.sample(rng, 0.0)))
        conversations.append(conv)
    return conversations


def _check_count(value, name: str, most: int) -> None:
    if type(value) is not int or not 1 <= value <= most:
        raise ValueError(f"{name} must be a whole number from 1 to {most}, got {value!r:.40}")


def from_vllm_conversations(items: list, tokenizer) -> list[Conversation]:
    """vLLM's JSON list of {"id", "messages": [{"role", "content"}, ...]}; answer lengths come from the
    assistant messages, whose text is replaced by the model's real answers."""
    _check_count(len(items), "the number of conversations", MAX_SESSIONS)
    conversations = []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
            raise ValueError(f"conversation {n}: expected {{'id', 'messages': [...]}}")
        messages = item["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages):
            raise ValueError(f"conversation {n}: each message must be {{'role', 'content': text}}")
        system = ""
        if messages and messages[0].get("role") == "system":
            system, messages = messages[0].get("content", ""), messages[1:]
        conv = Conversation(str(item.get("id", n)), system)
        for i, message in enumerate(messages):
            if message.get("role") != "user":
                continue
            reply = messages[i + 1] if i + 1 < len(messages) and messages[i + 1].get("role") == "assistant" else None
            answer_tokens = len(tokenizer.encode(reply.get("content", ""))) if reply else 64
            conv.turns.append(Turn(str(message.get("content", "")), max(answer_tokens, 1)))
        if conv.turns:
            conversations.append(conv)
    return conversations


def from_vllm_generate_config(config: dict, tokenizer, seed: int, base_dir: Path) -> list[Conversation]:
    """vLLM's {"filetype": "generate_conversations", ...} config. Its num_turns counts messages (user +
    assistant), as in vLLM, so N turns make ceil(N / 2) user turns."""
    rng = np.random.default_rng(seed)
    prompt_in, prompt_out = config.get("prompt_input", {}), config.get("prompt_output", {})
    text_files = config.get("text_files", [])
    if not isinstance(prompt_in, dict) or not isinstance(prompt_out, dict):
        raise ValueError("prompt_input and prompt_output must be objects")
    if not isinstance(text_files, list) or not all(isinstance(f, str) for f in text_files):
        raise ValueError("text_files must be a list of file names")
    num_conversations = config.get("num_conversations", 1)
    _check_count(num_conversations, "num_conversations", MAX_SESSIONS)
    num_turns = Distribution(prompt_in.get("num_turns", 10), "prompt_input.num_turns", 2 * MAX_TURNS)
    common = Distribution(prompt_in.get("common_prefix_num_tokens", 0), "prompt_input.common_prefix_num_tokens",
                          MAX_TEXT_TOKENS)
    prefix = Distribution(prompt_in.get("prefix_num_tokens", 0), "prompt_input.prefix_num_tokens", MAX_TEXT_TOKENS)
    new = Distribution(prompt_in.get("num_tokens", 100), "prompt_input.num_tokens", MAX_TEXT_TOKENS)
    answer = Distribution(prompt_out.get("num_tokens", 100), "prompt_output.num_tokens", MAX_TEXT_TOKENS)
    files = [base_dir / f for f in text_files]
    source = TextSource(tokenizer, [f for f in files if f.is_file()] or None)
    common_text = source.text(rng, common.sample_int(rng))
    conversations = []
    for i in range(num_conversations):
        system = (common_text + " " + source.text(rng, prefix.sample_int(rng))).strip()
        conv = Conversation(f"CONV_ID_{i}", system)
        for _ in range((num_turns.sample_int(rng, 2) + 1) // 2):
            conv.turns.append(Turn(source.text(rng, new.sample_int(rng, 1)), answer.sample_int(rng, 1)))
        conversations.append(conv)
    return conversations


def load_file(path: Path, tokenizer, seed: int) -> list[Conversation]:
    """A workload file's conversations; ValueError, naming the file, for one that cannot be read or replayed."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a JSON workload ({exc})") from None
    try:
        if isinstance(data, list):
            return from_vllm_conversations(data, tokenizer)
        if isinstance(data, dict) and data.get("filetype") == "generate_conversations":
            return from_vllm_generate_config(data, tokenizer, seed, Path(path).parent)
        if isinstance(data, dict) and data.get("filetype") == "kvturn_synthetic":
            fields = {k: v for k, v in data.items() if k in SyntheticSpec.__slots__}
            return synthetic(SyntheticSpec(**fields), TextSource(tokenizer), seed)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    raise ValueError(f"{path}: expected a list of conversations, a generate_conversations config or a "
                     f"kvturn_synthetic config")


def sweep(source: TextSource, seed: int, system_tokens: list[int], turns: int, new_tokens: int,
          answer_tokens: int, id_suffix: str = "") -> list[Conversation]:
    """One session per first-turn length (the published vLLM run's shape: prefix swept, fixed turns)."""
    conversations = []
    for length in system_tokens:
        spec = SyntheticSpec(num_sessions=1, system_tokens=length, num_turns=turns, new_tokens=new_tokens,
                             answer_tokens=answer_tokens)
        conversations += synthetic(spec, source, seed + length, id_prefix=f"sweep{length}{id_suffix}")
    return conversations


def scale_gaps(conversations: list[Conversation], factor: float) -> None:
    """Multiply every think time by `factor` (0 sends each turn as soon as the last answer is in)."""
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"the gap scale must be a finite number >= 0, got {factor!r}")
    for conv in conversations:
        for turn in conv.turns:
            turn.gap_s *= factor
