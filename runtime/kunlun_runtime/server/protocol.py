"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields.

Shapes follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``; the extra body fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``priority``, ...) are those vLLM accepts, so clients written for vLLM work unchanged. Unknown
fields are ignored, as OpenAI and vLLM do. Bounds that keep the sampler's arithmetic finite live
here (they appear in the OpenAPI document); everything else is checked once, by
``SamplingParams``. Every text must be valid Unicode: JSON may carry a lone surrogate
(``"\\ud800"``) that no tokenizer or response encoder accepts, so it is refused here, naming the
field. Response bodies are in ``responses``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 128
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1

TokenIds = list[Annotated[int, Field(ge=0)]]


def validate_text(value: Any) -> Any:
    """``value`` unchanged; raises ValueError when a string in it is not valid Unicode (a lone
    surrogate), which pydantic reports as a 400 naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"must be valid Unicode text (lone surrogate at {error.start})") from None
    elif isinstance(value, list | tuple):
        for item in value:
            validate_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            validate_text(key)
            validate_text(item)
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        return validate_text(value)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field("response", max_length=64)
    description: str | None = None
    # ``schema`` is reserved by pydantic's BaseModel: the field is read under its wire name.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's ``structured_outputs`` extra body field (exactly one constraint)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class SamplingFields(_Body):
    """Fields common to completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = Field(None, description="served model name; omitted = the served model")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=1e4)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* extras
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        ..., description="a string, a list of strings, token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextContentPart(_Body):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; omitted = no arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Body):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a ``tool`` turn: the call this message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def conversation(self) -> list[dict[str, Any]]:
        out = []
        for message in self.messages:
            item: dict[str, Any] = {"role": message.role, "content": message.text()}
            if message.name is not None:
                item["name"] = message.name
            out.append(item)
        return out


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With messages: rendered as a chat request with these would be, so the count is its prompt's.
    tools: list[Tool] | None = Field(None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter``, vLLM's body; ``load_inplace`` replaces a served adapter of
    that name (requests already running on the old one finish on it)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter``, vLLM's body; ``lora_int_id``, where given, must be the
    adapter's id."""

    lora_name: str
    lora_int_id: int | None = None
