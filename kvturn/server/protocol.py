"""OpenAI-compatible request bodies and the error shape, as vLLM serves them."""
from typing import Any, Literal

from fastapi.responses import JSONResponse
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


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
             413: "BadRequestError", 503: "ServiceUnavailableError"}
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kinds.get(status, "InternalServerError"), "param": param, "code": status}})
