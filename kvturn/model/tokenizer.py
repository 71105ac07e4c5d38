"""Tokenizer and chat template of a Hugging Face model directory."""
import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        self._template = ImmutableSandboxedEnvironment().from_string(template) if template else None
        self.eos_token_id = self.tokenizer.token_to_id(config.get("eos_token") or "<|endoftext|>")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(messages=messages, add_generation_prompt=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()
