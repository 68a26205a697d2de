"""``POST /v1/chat/completions``: the model's own chat template, n choices, SSE streaming.

The conversation is rendered with the model's jinja2 chat template and tokenized once, off the
event loop (``ServedModel.encode_chat``); the engine gets token ids. Streaming sends OpenAI's
chunks: the role first, then content deltas, then the finish reason, an optional usage chunk
(``stream_options.include_usage``) and ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.engine.request import TokenLogprob
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.async_engine import EngineRequest, RequestStream
from kunlun_runtime.server.door import tenant_of
from kunlun_runtime.server.protocol import ChatCompletionRequest
from kunlun_runtime.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from kunlun_runtime.server.serving import (
    EngineStreamingResponse,
    ServedModel,
    add_prepared,
    children,
    collect,
    guard_stream,
    new_id,
    now_seconds,
    sampling_params,
    sse,
    token_text,
)


def _top(served: ServedModel, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(served, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(served: ServedModel, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for item in logprobs:
        chosen = _top(served, item.token_id, item.logprob)
        content.append(
            ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[_top(served, t, lp) for t, lp in item.top])
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(
    body: ChatCompletionRequest, served: ServedModel, request: Request
) -> Response:
    served.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs: requires logprobs to be true", field="top_logprobs")
    params = sampling_params(
        body,
        served,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in reserved}
    request_id = new_id("chatcmpl")
    tenant = tenant_of(request)
    prompt_ids: list[int] = []

    async def prepare() -> list[EngineRequest]:
        prompt_ids.extend(await served.encode_chat(body.conversation(), body.add_generation_prompt, **kwargs))
        return children(request_id, {"prompt_token_ids": prompt_ids}, params, body, tenant)

    stream = await add_prepared(served, params.n, tenant, prepare)
    index_of = {f"{request_id}-{i}": i for i in range(params.n)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(
            stream, served, request_id, index_of, len(prompt_ids), body.logprobs, include_usage
        )
        return EngineStreamingResponse(guard_stream(events), stream)
    finals = await collect(stream, request)
    choices = []
    for engine_id, index in index_of.items():
        completion = finals[engine_id].outputs[0]
        choices.append(
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=completion.text),
                logprobs=chat_logprobs(served, completion.logprobs or []) if body.logprobs else None,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
        )
    num_generated = sum(len(finals[engine_id].outputs[0].token_ids) for engine_id in index_of)
    response = ChatCompletionResponse(
        id=request_id,
        created=now_seconds(),
        model=served.name,
        choices=choices,
        usage=UsageInfo.of(len(prompt_ids), num_generated),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _stream_events(
    stream: RequestStream,
    served: ServedModel,
    request_id: str,
    index_of: dict[str, int],
    num_prompt_tokens: int,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = now_seconds()

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=request_id, created=created, model=served.name, choices=choices, usage=usage
            )
        )

    for index in index_of.values():
        yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    sent_text = dict.fromkeys(index_of.values(), 0)
    sent_tokens = dict.fromkeys(index_of.values(), 0)
    num_generated = 0
    async for output in stream:
        yield_chunk = _delta(output, index_of, sent_text, sent_tokens, served, want_logprobs)
        if yield_chunk is not None:
            yield chunk([yield_chunk])
        if output.finished:
            num_generated += len(output.outputs[0].token_ids)
    if include_usage:
        yield chunk([], UsageInfo.of(num_prompt_tokens, num_generated))


def _delta(
    output: RequestOutput,
    index_of: dict[str, int],
    sent_text: dict[int, int],
    sent_tokens: dict[int, int],
    served: ServedModel,
    want_logprobs: bool,
) -> ChatChunkChoice | None:
    """The chunk for what ``output`` adds to its choice; None when it adds nothing visible."""
    index = index_of[output.request_id]
    completion = output.outputs[0]
    text = completion.text[sent_text[index] :]
    new_logprobs = (completion.logprobs or [])[sent_tokens[index] :] if want_logprobs else []
    if not text and not new_logprobs and not output.finished:
        return None
    sent_text[index] = len(completion.text)
    sent_tokens[index] = len(completion.logprobs or [])
    return ChatChunkChoice(
        index=index,
        delta=DeltaMessage(content=text),
        logprobs=chat_logprobs(served, new_logprobs) if want_logprobs else None,
        finish_reason=completion.finish_reason,
    )
