"""What chat and completions share: the served model, request → SamplingParams, n > 1, SSE.

``n > 1`` becomes n engine requests with seeds ``seed + i`` (as the offline API does), so each
choice is reproducible on its own. Non-streaming calls watch for the client going away and abort
their requests when it does; streaming responses abort theirs when the stream is closed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.sampling_params import SamplingParams
from kunlun_runtime.server.async_engine import AsyncEngine, EngineRequest, RequestStream
from kunlun_runtime.server.errors import APIError
from kunlun_runtime.server.protocol import SamplingFields


@dataclass(slots=True)
class ServedModel:
    """The engine being served, and what the routes need to know about it."""

    engine: AsyncEngine
    name: str
    max_model_len: int
    vocab_size: int
    root: str

    @classmethod
    def of(cls, async_engine: AsyncEngine) -> ServedModel:
        engine: LLMEngine = async_engine.engine
        return cls(
            engine=async_engine,
            name=engine.served_model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            root=str(engine.model_dir),
        )

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")


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
    """The engine's SamplingParams for ``body``; raises InvalidRequestError naming the field."""
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
        **{name: value for name, value in fields.items() if value is not None},
    )


def children(
    base_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, body: SamplingFields
) -> list[EngineRequest]:
    """n engine requests for one prompt, seeded ``seed + i``."""
    out = []
    for index in range(params.n):
        child = replace(params, n=1)
        if params.seed is not None:
            child.seed = params.seed + index
        out.append(EngineRequest(f"{base_id}-{index}", prompt, child, body.priority, body.cache_salt))
    return out


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
    except (InvalidRequestError, APIError) as error:
        yield sse({"error": {"message": str(error), "type": "BadRequestError", "param": None, "code": 400}})
    except Exception as error:  # e.g. EngineDeadError: the stream must still end cleanly
        yield sse(
            {"error": {"message": str(error), "type": "InternalServerError", "param": None, "code": 500}}
        )
    yield SSE_DONE


def token_text(served: ServedModel, token_id: int) -> str:
    return served.tokenizer.decode([token_id], skip_special_tokens=False)
