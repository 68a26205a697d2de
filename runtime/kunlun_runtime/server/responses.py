"""Response bodies of the OpenAI-compatible API (pydantic), non-streaming and streaming chunks.

Field names and nesting are OpenAI's; ``usage`` counts are exact token counts (the prompt once,
completions summed over choices). Logprobs come in the two OpenAI dialects: the legacy
completions one (parallel lists) and the chat one (a list of per-token objects). Tool calls come
whole in a message (``message.tool_calls``) and in pieces in a stream (``delta.tool_calls``: the
first piece of a call has its ``id``, ``type`` and ``function.name``, later ones only more
``function.arguments``); a field that is absent from OpenAI's pieces is left out, not null.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


def now_seconds() -> int:
    """A response's ``created``: whole seconds since the epoch."""
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        """``cached_tokens``: None when the server does not report prompt token details."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None
            if cached_tokens is None
            else PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


def _absent_if_none(value: object) -> bool:
    return value is None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls only
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=_absent_if_none)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_absent_if_none)
    arguments: str | None = Field(default=None, exclude_if=_absent_if_none)


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = Field(default=None, exclude_if=_absent_if_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_absent_if_none)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_absent_if_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kunlun-inference"
    root: str | None = None
    parent: str | None = None  # an adapter's base model (vLLM's field); None for the base itself
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
