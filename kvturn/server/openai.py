"""The OpenAI API as vLLM serves it: request bodies in, response bodies and stream chunks out."""
from typing import Any, Literal

import json
import math

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    conversation_id: str | None = Field(default=None, max_length=256)
    # vLLM's: prompts under different salts share no prefix-cache block (the router sets one per tenant)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    echo: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None and (len(value) > 16 or any(not s for s in value)):
            raise ValueError("stop takes at most 16 non-empty strings")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # as vLLM does: JSON has no -inf


def completion_logprobs(entries: list, text_offset_start: int) -> dict:
    """/v1/completions shape from (token, logprob, [(alternative, logprob)...]) entries: parallel lists, the
    alternatives as {token: logprob}."""
    offsets, at = [], text_offset_start
    for token, _, _ in entries:
        offsets.append(at)
        at += len(token)
    return {"tokens": [token for token, _, _ in entries],
            "token_logprobs": [_finite(logprob) for _, logprob, _ in entries],
            "top_logprobs": [{alt: _finite(value) for alt, value in top} for _, _, top in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list) -> dict:
    """/v1/chat/completions shape: one entry per token with its top alternatives."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}
    return {"content": [entry(token, logprob) | {"top_logprobs": [entry(alt, value) for alt, value in top]}
                        for token, logprob, top in entries]}


def choice(chat: bool, text: str, finish_reason: str | None, delta: bool, logprobs: dict | None = None) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if delta:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
