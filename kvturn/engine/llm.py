"""Offline, synchronous use of the engine: `LLM(model_dir).generate(prompts, params)`."""
import itertools
from pathlib import Path

from kvturn.config import EngineConfig
from kvturn.engine.llm_engine import LLMEngine, RequestOutput
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.model.loader import load_model
from kvturn.model.tokenizer import ChatTokenizer


class LLM:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.tokenizer = ChatTokenizer(model_dir)
        model = load_model(model_dir)
        eos = set(model.config.eos_token_ids) | {self.tokenizer.eos_token_id}
        self.engine = LLMEngine(model, config or EngineConfig(), self._collect, self.tokenizer.decode, eos)
        self._ids = itertools.count()
        self._outputs: dict[str, list[int]] = {}

    def _collect(self, out: RequestOutput) -> None:
        self._outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run all prompts together (continuous batching) and return each one's generated token ids."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        request_ids = []
        for prompt, p in zip(prompts, params):
            request_id = f"offline-{next(self._ids)}"
            request_ids.append(request_id)
            self.engine.add_request(Sequence(request_id, prompt, p))
        while self.engine.has_work():
            self.engine.step()
        return [self._outputs.pop(r, []) for r in request_ids]
