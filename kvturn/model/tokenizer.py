"""Tokenizer and chat template of a Hugging Face model directory."""
import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


SEGMENT_CACHE_MIN_CHARS = 256  # shorter segments encode faster than a cache pays for
SEGMENT_CACHE_MAX_CHARS = 32 * 2**20
COUNT_PIECE_CHARS = 64 * 2**10  # a text too long is found piece by piece, stopping at the piece that passes the limit
PIECE_EDGE_TOKENS = 8  # the most tokens a cut at whitespace can add to a count (pieces are tokenized apart)


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = read_chat_template(model_dir, config)
        self._template = template_environment().from_string(template) if template else None
        # What transformers hands every template: its special tokens by name
        self._special_names = {name: token_text(config.get(name))
                               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.eos_token_id = self.tokenizer.token_to_id(self._special_names["eos_token"] or "<|endoftext|>")
        specials = sorted((t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._special_ids = {t: self.tokenizer.token_to_id(t) for t in specials}
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._segment_chars = 0
        self._segments_lock = threading.Lock()  # workers tokenize on several threads at once
        # The longest text one token can stand for (its vocabulary entry's length, an upper bound): a text longer
        # than this many times a context cannot fit it, whatever it tokenizes to.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)

    def _ids(self, text: str) -> list[int]:
        """The tokenizer's own ids of `text`, tokenized without the GIL (`encode_batch` lets it go, `encode` holds
        it throughout: seconds for a few MB), so that a worker's other threads (its event loop) go on meanwhile."""
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. The text between special tokens is encoded independently by the tokenizer
        itself, so each such segment is cached: an agent resends the same long history every turn."""
        if self._special_split is None:
            return self._ids(text)
        ids: list[int] = []
        for piece in self._special_split.split(text):
            if piece in self._special_ids:
                ids.append(self._special_ids[piece])
            elif piece:
                ids.extend(self._encode_segment(piece))
        return ids

    def _encode_segment(self, segment: str) -> list[int]:
        with self._segments_lock:
            cached = self._segments.get(segment)
            if cached is not None:
                self._segments.move_to_end(segment)
                return cached
        ids = self._ids(segment)
        if len(segment) >= SEGMENT_CACHE_MIN_CHARS:
            with self._segments_lock:
                if segment not in self._segments:
                    self._segments[segment] = ids
                    self._segment_chars += len(segment)
                while self._segment_chars > SEGMENT_CACHE_MAX_CHARS:
                    evicted, _ = self._segments.popitem(last=False)
                    self._segment_chars -= len(evicted)
        return ids

    def exceeds(self, text: str, most_tokens: int) -> bool:
        """Whether `text` surely makes more than `most_tokens` tokens, found piece by piece (cut at whitespace) and
        stopping at the piece that passes the limit: a text far too long costs the tokenizer about as much as one
        that fits, not its whole length. Each cut may add a few tokens to the count, which the limit allows for."""
        counted, start, pieces = 0, 0, 0
        while start < len(text):
            end = min(start + COUNT_PIECE_CHARS, len(text))
            if end < len(text):
                space = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                end = space if space > start else end
            counted, pieces = counted + len(self._ids(text[start:end])), pieces + 1
            if counted > most_tokens + pieces * PIECE_EDGE_TOKENS:
                return True
            start = end
        return False

    def count(self, text: str) -> int:
        """How many tokens `text` makes on its own, nothing cached: what a router needs to price a turn (a special
        token written in the text counts as the one token it is, as the worker's encode makes it)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt as transformers' apply_chat_template renders it (add_generation_prompt=True)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                         **self._special_names)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused the messages (raise_exception)."""


def read_chat_template(model_dir: Path, config: dict) -> str | None:
    """`chat_template.jinja` (what transformers writes now), else tokenizer_config.json's `chat_template`: a string,
    or a list of named templates of which the one named "default" is used."""
    path = model_dir / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template else None


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def template_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox set up as transformers sets up its own (block trimming, loop controls and the helpers templates
    call), so a template renders the same text here and there."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
