"""What chat and completions share: the served model, request → SamplingParams, n > 1, SSE.

``n > 1`` becomes n engine requests with seeds ``seed + i`` (as the offline API does), so each
choice is reproducible on its own. Non-streaming calls watch for the client going away and abort
their requests when it does; streaming responses abort theirs when the stream is closed.

Prompts are rendered (chat template) and tokenized here, never on the engine thread, and a long
one (``INLINE_TOKENIZE_MAX_CHARS`` on) on a small thread pool, not on the event loop: the engine
gets token ids, and a huge prompt delays neither /health nor other requests' steps. Their size is
checked first (``max_prompt_chars``) and their queue places are taken before the work
(``add_prepared``), so a full queue is answered at once and the work is bounded before it starts.
A structured-output constraint (JSON Schema, regex, grammar) is compiled in the same step, on the
same pool (``prepare_structured_outputs``): a slow compile stalls neither /health nor the engine
thread, whose own compile of the constraint is then a cache hit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.async_engine import AsyncEngine, EngineRequest, RequestStream
from kunlun_runtime.server.auth import scoped_cache_salt
from kunlun_runtime.server.errors import ERROR_TYPES, APIError
from kunlun_runtime.server.protocol import SamplingFields
from kunlun_runtime.server.structured_outputs import parse_structured_outputs
from kunlun_runtime.structured.params import StructuredOutputsParams

DEFAULT_MAX_PROMPT_CHARS = 1_000_000
NUM_TOKENIZER_THREADS = 2  # tokenization is CPU work: more threads would only take cores from steps
# Shorter prompts are tokenized inline: well under a millisecond, less than the hop to a thread.
INLINE_TOKENIZE_MAX_CHARS = 4096


@dataclass(slots=True)
class ServedModel:
    """The engine being served, and what the routes need to know about it."""

    engine: AsyncEngine
    name: str
    max_model_len: int
    vocab_size: int
    root: str
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # longer prompts are refused before any work
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor | None = None  # None: asyncio's default
    tool_call_parser: str | None = None  # --tool-call-parser: how tool calls are read from output
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is served
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage counts cached tokens

    @classmethod
    def of(
        cls, async_engine: AsyncEngine, *, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    ) -> ServedModel:
        engine: LLMEngine = async_engine.engine
        return cls(
            engine=async_engine,
            name=engine.served_model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            root=str(engine.model_dir),
            max_prompt_chars=max_prompt_chars,
            tokenizer_pool=concurrent.futures.ThreadPoolExecutor(
                NUM_TOKENIZER_THREADS, thread_name_prefix="tokenizer"
            ),
        )

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def check_prompt_chars(self, num_chars: int, field: str) -> None:
        """Raise InvalidRequestError naming ``field`` when a prompt has too many characters."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{field}: {num_chars} characters, more than this server accepts "
                f"({self.max_prompt_chars}, --max-prompt-chars)",
                field=field,
            )

    async def encode(self, text: str, *, field: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, computed on the tokenizer pool; its length is checked first."""
        self.check_prompt_chars(len(text), field)
        return await self._tokenize(
            len(text), lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def encode_chat(
        self, conversation: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]:
        """The token ids of the rendered chat template, computed on the tokenizer pool; the
        conversation's length is checked first. Raises InvalidRequestError naming ``messages``."""
        num_chars = sum(len(str(m.get("content") or "")) for m in conversation)
        self.check_prompt_chars(num_chars, "messages")

        def render_and_encode() -> list[int]:
            text = self.tokenizer.render_chat(conversation, add_generation_prompt, **kwargs)
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await self._tokenize(num_chars, render_and_encode)

    async def _tokenize(self, num_chars: int, work: Callable[[], list[int]]) -> list[int]:
        """``work()`` inline for a short prompt, else on the tokenizer pool."""
        if num_chars < INLINE_TOKENIZE_MAX_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, work)

    def close(self) -> None:
        if self.tokenizer_pool is not None:
            self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())


def sampling_params(
    body: SamplingFields,
    served: ServedModel,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for ``body``, its structured-output constraint included (not
    yet compiled: ``add_prepared`` does that); raises InvalidRequestError naming the field."""
    for token_id in body.stop_token_ids or []:
        if token_id >= served.vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids: {token_id} is not a token id (vocabulary size {served.vocab_size})",
                field="stop_token_ids",
            )
    # The sampling fields the request may leave unset (None: SamplingParams' default); their
    # types differ (top_k is an int), so they are passed on by name as keyword arguments.
    fields: dict[str, Any] = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    return SamplingParams(
        n=body.n,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=parse_structured_outputs(body),
        **{name: value for name, value in fields.items() if value is not None},
    )


def children(
    base_id: str,
    prompt: str | list[int] | dict[str, Any],
    params: SamplingParams,
    body: SamplingFields,
    tenant: str | None = None,
) -> list[EngineRequest]:
    """n engine requests for one prompt, seeded ``seed + i``, in ``tenant``'s cache namespace."""
    salt = scoped_cache_salt(tenant, body.cache_salt)
    out = []
    for index in range(params.n):
        child = replace(params, n=1)
        if params.seed is not None:
            child.seed = params.seed + index
        out.append(EngineRequest(f"{base_id}-{index}", prompt, child, body.priority, salt, tenant))
    return out


async def add_prepared(
    served: ServedModel,
    count: int,
    tenant: str | None,
    prepare: Callable[[], Awaitable[list[EngineRequest]]],
) -> RequestStream:
    """Take ``count`` queue places, then ``prepare`` the group (tokenize), compile its
    structured-output constraints and queue it, so a full queue is answered at once, before the
    prompt is tokenized, and the places are held in the order requests arrived. The places are
    given back when preparing fails (an invalid schema or regex: InvalidRequestError, 400)."""
    served.engine.reserve(count, tenant)
    try:
        requests = await prepare()
        await prepare_structured_outputs(served, requests)
    except BaseException:
        served.engine.release(count, tenant)
        raise
    return await served.engine.add(requests, reserved=True)


async def prepare_structured_outputs(served: ServedModel, requests: list[EngineRequest]) -> None:
    """Compile the constraint of every request of ``requests`` that has one, on the tokenizer
    pool: a schema can take long to compile, and neither the event loop (/health, other
    requests) nor the engine thread (every running request's next token) should wait for it.
    The engine caches compiled constraints, so its own compile in ``add_request`` is a hit.

    Called by ``add_prepared``; a route that queues requests another way calls it before.

    Raises:
        InvalidRequestError: a schema, regex or grammar the grammar engine refuses (400, the
            field is the constraint's ``source``).
    """
    constraints: dict[int, StructuredOutputsParams] = {}
    for request in requests:
        constraint = request.params.structured_outputs
        if constraint is not None:  # n > 1 children share one constraint object: compiled once
            constraints.setdefault(id(constraint), constraint)
    if not constraints:
        return
    compiler = served.engine.engine.structured
    loop = asyncio.get_running_loop()
    for constraint in constraints.values():
        await loop.run_in_executor(served.tokenizer_pool, compiler.compile, constraint)


async def _wait_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(stream: RequestStream, request: Request) -> dict[str, RequestOutput]:
    """The final output of every request of ``stream``; aborts them if the client goes away."""

    async def final_outputs() -> dict[str, RequestOutput]:
        return {output.request_id: output async for output in stream if output.finished}

    consume = asyncio.ensure_future(final_outputs())
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not consume.done():
            raise APIError(400, "client disconnected")
        return consume.result()
    finally:
        consume.cancel()
        watch.cancel()
        stream.close()


def sse(data: BaseModel | dict) -> str:
    payload = data.model_dump(exclude_none=False) if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events over an engine stream; the stream is closed (aborted) however it ends."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """After the headers are sent an error can only be an event: send it, then [DONE]."""
    try:
        async for event in events:
            yield event
    except InvalidRequestError as error:
        yield error_event(error.status_code, error.message, error.field)
    except APIError as error:  # e.g. 503: the server is draining and its timeout has passed
        yield error_event(error.status_code, error.message, error.param)
    except Exception as error:  # e.g. EngineDeadError: the stream must still end cleanly
        yield error_event(500, str(error))
    yield SSE_DONE


def error_event(status_code: int, message: str, param: str | None = None) -> str:
    """An SSE event with OpenAI's error body."""
    error_type = ERROR_TYPES.get(status_code, "Error")
    return sse({"error": {"message": message, "type": error_type, "param": param, "code": status_code}})


def token_text(served: ServedModel, token_id: int) -> str:
    return served.tokenizer.decode([token_id], skip_special_tokens=False)
