"""Multi-turn conversations to replay: synthetic agent sessions, and vLLM's two input formats.

A conversation is a system prompt and a list of turns; each turn is the new user text
(a user message or a tool result), how many answer tokens to ask for, and the think/tool
time before it is sent. The model's real answers go into the history, as an agent's would.
"""
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvturn.bench.distributions import Distribution

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
    system, turns, new, answer, gap = (Distribution(getattr(spec, f), f) for f in
                                       ("system_tokens", "num_turns", "new_tokens", "answer_tokens", "gap_s"))
    conversations = []
    for i in range(spec.num_sessions):
        conv = Conversation(f"{id_prefix}-{seed}-{i}", source.text(rng, system.sample_int(rng, 1)))
        for _ in range(turns.sample_int(rng, 1)):
            conv.turns.append(Turn(source.text(rng, new.sample_int(rng, 1)), answer.sample_int(rng, 1),
                                   gap.sample(rng, 0.0)))
        conversations.append(conv)
    return conversations


def from_vllm_conversations(items: list, tokenizer) -> list[Conversation]:
    """vLLM's JSON list of {"id", "messages": [{"role", "content"}, ...]}; answer lengths come from the
    assistant messages, whose text is replaced by the model's real answers."""
    conversations = []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
            raise ValueError(f"conversation {n}: expected {{'id', 'messages': [...]}}")
        messages = item["messages"]
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
    files = [base_dir / f for f in config.get("text_files", [])]
    source = TextSource(tokenizer, [f for f in files if f.exists()] or None)
    prompt_in, prompt_out = config.get("prompt_input", {}), config.get("prompt_output", {})
    num_turns = Distribution(prompt_in.get("num_turns", 10), "prompt_input.num_turns")
    common = Distribution(prompt_in.get("common_prefix_num_tokens", 0), "prompt_input.common_prefix_num_tokens")
    prefix = Distribution(prompt_in.get("prefix_num_tokens", 0), "prompt_input.prefix_num_tokens")
    new = Distribution(prompt_in.get("num_tokens", 100), "prompt_input.num_tokens")
    answer = Distribution(prompt_out.get("num_tokens", 100), "prompt_output.num_tokens")
    common_text = source.text(rng, common.sample_int(rng))
    conversations = []
    for i in range(int(config.get("num_conversations", 1))):
        system = (common_text + " " + source.text(rng, prefix.sample_int(rng))).strip()
        conv = Conversation(f"CONV_ID_{i}", system)
        for _ in range((num_turns.sample_int(rng, 2) + 1) // 2):
            conv.turns.append(Turn(source.text(rng, new.sample_int(rng, 1)), answer.sample_int(rng, 1)))
        conversations.append(conv)
    return conversations


def load_file(path: Path, tokenizer, seed: int) -> list[Conversation]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return from_vllm_conversations(data, tokenizer)
    if isinstance(data, dict) and data.get("filetype") == "generate_conversations":
        return from_vllm_generate_config(data, tokenizer, seed, Path(path).parent)
    if isinstance(data, dict) and data.get("filetype") == "kvturn_synthetic":
        fields = {k: v for k, v in data.items() if k in SyntheticSpec.__slots__}
        return synthetic(SyntheticSpec(**fields), TextSource(tokenizer), seed)
    raise ValueError(f"{path}: expected a list of conversations, a generate_conversations config or a "
                     f"kvturn_synthetic config")


def sweep(source: TextSource, seed: int, system_tokens: list[int], turns: int, new_tokens: int,
          answer_tokens: int) -> list[Conversation]:
    """One session per first-turn length (the published vLLM run's shape: prefix swept, fixed turns)."""
    conversations = []
    for length in system_tokens:
        spec = SyntheticSpec(num_sessions=1, system_tokens=length, num_turns=turns, new_tokens=new_tokens,
                             answer_tokens=answer_tokens)
        conversations += synthetic(spec, source, seed + length, id_prefix=f"sweep{length}")
    return conversations
