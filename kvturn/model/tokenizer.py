"""Tokenizer and chat template of a Hugging Face model directory."""
import json
import re
from collections import OrderedDict
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


SEGMENT_CACHE_MIN_CHARS = 256  # shorter segments encode faster than a cache pays for
SEGMENT_CACHE_MAX_CHARS = 32 * 2**20


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        self._template = ImmutableSandboxedEnvironment().from_string(template) if template else None
        self.eos_token_id = self.tokenizer.token_to_id(config.get("eos_token") or "<|endoftext|>")
        specials = sorted((t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._special_ids = {t: self.tokenizer.token_to_id(t) for t in specials}
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._segment_chars = 0
        # The longest text one token can stand for (its vocabulary entry's length, an upper bound): a text longer
        # than this many times a context cannot fit it, whatever it tokenizes to.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. The text between special tokens is encoded independently by the tokenizer
        itself, so each such segment is cached: an agent resends the same long history every turn."""
        if self._special_split is None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for piece in self._special_split.split(text):
            if piece in self._special_ids:
                ids.append(self._special_ids[piece])
            elif piece:
                ids.extend(self._encode_segment(piece))
        return ids

    def _encode_segment(self, segment: str) -> list[int]:
        cached = self._segments.get(segment)
        if cached is not None:
            self._segments.move_to_end(segment)
            return cached
        ids = self.tokenizer.encode(segment, add_special_tokens=False).ids
        if len(segment) >= SEGMENT_CACHE_MIN_CHARS:
            self._segments[segment] = ids
            self._segment_chars += len(segment)
            while self._segment_chars > SEGMENT_CACHE_MAX_CHARS:
                evicted, _ = self._segments.popitem(last=False)
                self._segment_chars -= len(evicted)
        return ids

    def count(self, text: str) -> int:
        """How many tokens `text` makes on its own, nothing cached: what a router needs to price a turn (a special
        token written in the text counts as the one token it is, as the worker's encode makes it)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(messages=messages, add_generation_prompt=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()
