"""Sampling parameters and the per-row sampler (greedy, temperature, top-k, top-p, seeded)."""
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def must_sample_here(self) -> bool:
        """A token another worker sampled will not do: a seeded generator advances per worker, and logprobs
        come only from the logits computed here."""
        return self.logprobs is not None or (self.seed is not None and not self.greedy)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's log-probability under the model's raw distribution (before temperature, as vLLM
    reports it), and the `k` most likely tokens with theirs."""
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(float(logprobs[token_id]), top)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
