"""``POST /v1/chat/completions``: the model's own chat template, n choices, SSE streaming, tools.

The conversation is rendered with the model's jinja2 chat template and tokenized once, off the
event loop (``ServedModel.encode_chat``); the engine gets token ids. Streaming sends OpenAI's
chunks: the role first, then content deltas, then the finish reason, an optional usage chunk
(``stream_options.include_usage``) and ``data: [DONE]``.

With ``tools`` (``tool_calls.plan_tools``), a named function or ``tool_choice="required"`` is a
constraint the grammar engine enforces, and each choice's output is read by a tool-call reader
(``tool_parsers``) into content and ``tool_calls``; a stream sends the calls as
``delta.tool_calls`` pieces as they are read. Every call gets its id here (``call_<hex>``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.responses import Response

from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.models.tokenizer import RESERVED_TEMPLATE_VARIABLES
from kunlun_runtime.server.door import tenant_of
from kunlun_runtime.server.protocol import ChatCompletionRequest, ChatMessage
from kunlun_runtime.server.request_building import add_prepared, children, new_id, sampling_params
from kunlun_runtime.server.request_stream import EngineRequest, RequestStream
from kunlun_runtime.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    now_seconds,
)
from kunlun_runtime.server.served_model import ServedModel, token_text
from kunlun_runtime.server.streaming import EngineStreamingResponse, collect, guard_stream, sse
from kunlun_runtime.server.tool_calls import ToolPlan, build_prompt, constrain, plan_tools
from kunlun_runtime.server.tool_parsers import CallDelta, ReadsToolCalls

# Template variables the request may not set through chat_template_kwargs: the server sets them.
RESERVED_TEMPLATE_KWARGS = RESERVED_TEMPLATE_VARIABLES


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


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


def chat_prompt(
    served: ServedModel,
    messages: Sequence[ChatMessage],
    plan: ToolPlan,
    chat_template_kwargs: dict[str, Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation and template variables a chat request renders (``/tokenize`` renders the
    same, so that its count is the prompt's). The request's own template variables cannot replace
    the ones the server sets (``RESERVED_TEMPLATE_KWARGS``)."""
    conversation, tool_kwargs = build_prompt(messages, plan, renders_tools=served.tokenizer.renders_tools)
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
    kwargs.update(tool_kwargs)
    return conversation, kwargs


async def create_chat_completion(
    body: ChatCompletionRequest, served: ServedModel, request: Request
) -> Response:
    lora = served.check_model(body.model)
    model_name = served.name if lora is None else lora.lora_name  # what the answer says it ran
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs: requires logprobs to be true", field="top_logprobs")
    params = sampling_params(
        body,
        served,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    plan = plan_tools(
        body,
        tool_call_parser=served.tool_call_parser,
        enable_auto_tool_choice=served.enable_auto_tool_choice,
    )
    params = constrain(params, plan)  # add_prepared compiles it, off the event loop
    conversation, kwargs = chat_prompt(served, body.messages, plan, body.chat_template_kwargs)
    request_id = new_id("chatcmpl")
    tenant = tenant_of(request)
    prompt_ids: list[int] = []

    async def prepare() -> list[EngineRequest]:
        prompt_ids.extend(await served.encode_chat(conversation, body.add_generation_prompt, **kwargs))
        return children(request_id, {"prompt_token_ids": prompt_ids}, params, body, tenant, lora)

    stream = await add_prepared(served, params.n, tenant, prepare)
    index_of = {f"{request_id}-{i}": i for i in range(params.n)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(
            stream,
            served,
            request_id,
            index_of,
            len(prompt_ids),
            body.logprobs,
            include_usage,
            plan,
            model_name,
        )
        return EngineStreamingResponse(guard_stream(events), stream)
    finals = await collect(stream, request)
    choices = []
    for engine_id, index in index_of.items():
        completion = finals[engine_id].outputs[0]
        message, finish_reason = _message(plan, completion.text, completion.finish_reason)
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=chat_logprobs(served, completion.logprobs or []) if body.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=completion.stop_reason,
            )
        )
    num_generated = sum(len(finals[engine_id].outputs[0].token_ids) for engine_id in index_of)
    first = finals[f"{request_id}-0"]
    cached = first.num_cached_tokens if served.enable_prompt_tokens_details else None
    response = ChatCompletionResponse(
        id=request_id,
        created=now_seconds(),
        model=model_name,
        choices=choices,
        usage=UsageInfo.of(len(prompt_ids), num_generated, cached),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _message(plan: ToolPlan, text: str, engine_reason: str | None) -> tuple[ChatMessageOut, str | None]:
    """One choice's whole message and finish reason: its text read for tool calls, if any."""
    reader = plan.new_reader()
    if reader is None:
        return ChatMessageOut(content=text), engine_reason
    read, end = reader.feed(text), reader.finish()
    pieces = [piece for piece in (*read.calls, *end.calls) if plan.keeps(piece)]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for piece in pieces:  # a named call comes in pieces; the others whole
        if piece.name is not None:
            names[piece.index] = piece.name
        arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    tool_calls = [
        ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=names[i], arguments=arguments[i]))
        for i in sorted(names)
    ]
    content = read.content + end.content
    message = ChatMessageOut(
        content=content if content.strip() or not tool_calls else None, tool_calls=tool_calls or None
    )
    return message, plan.finish_reason(engine_reason, len(tool_calls))


@dataclass(slots=True)
class _ChoiceStream:
    """What one choice of a stream has sent so far."""

    reader: ReadsToolCalls | None  # None: the text is plain content
    num_chars: int = 0
    num_logprobs: int = 0
    call_ids: dict[int, str] = field(default_factory=dict)  # a call's index → its id


async def _stream_events(
    stream: RequestStream,
    served: ServedModel,
    request_id: str,
    index_of: dict[str, int],
    num_prompt_tokens: int,
    want_logprobs: bool,
    include_usage: bool,
    plan: ToolPlan,
    model_name: str,
) -> AsyncIterator[str]:
    created = now_seconds()

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            )
        )

    for index in index_of.values():
        yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    sent = {index: _ChoiceStream(plan.new_reader()) for index in index_of.values()}
    num_generated = 0
    num_cached: int | None = None
    async for output in stream:
        index = index_of[output.request_id]
        yield_chunk = _delta(output, index, sent[index], served, want_logprobs, plan)
        if yield_chunk is not None:
            yield chunk([yield_chunk])
        if output.finished:
            num_generated += len(output.outputs[0].token_ids)
            if index == 0 and served.enable_prompt_tokens_details:
                num_cached = output.num_cached_tokens
    if include_usage:
        yield chunk([], UsageInfo.of(num_prompt_tokens, num_generated, num_cached))


def _delta(
    output: RequestOutput,
    index: int,
    sent: _ChoiceStream,
    served: ServedModel,
    want_logprobs: bool,
    plan: ToolPlan,
) -> ChatChunkChoice | None:
    """The chunk for what ``output`` adds to its choice; None when it adds nothing visible."""
    completion = output.outputs[0]
    text = completion.text[sent.num_chars :]
    new_logprobs = (completion.logprobs or [])[sent.num_logprobs :] if want_logprobs else []
    sent.num_chars = len(completion.text)
    sent.num_logprobs = len(completion.logprobs or [])
    if sent.reader is None:
        delta = DeltaMessage(content=text)
        visible = bool(text)
        finish_reason = completion.finish_reason
    else:
        steps = [sent.reader.feed(text)]
        if output.finished:
            steps.append(sent.reader.finish())
        pieces = [_piece(p, sent) for step in steps for p in step.calls if plan.keeps(p)]
        content = "".join(step.content for step in steps)
        delta = DeltaMessage(content=content or None, tool_calls=pieces or None)
        visible = bool(content or pieces)
        finish_reason = plan.finish_reason(completion.finish_reason, len(sent.call_ids))
    if not visible and not new_logprobs and not output.finished:
        return None
    return ChatChunkChoice(
        index=index,
        delta=delta,
        logprobs=chat_logprobs(served, new_logprobs) if want_logprobs else None,
        finish_reason=finish_reason,
    )


def _piece(piece: CallDelta, sent: _ChoiceStream) -> DeltaToolCall:
    """A call piece as OpenAI streams it: id, type and name on the first piece of a call only."""
    if piece.name is None:
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
    sent.call_ids[piece.index] = call_id = new_call_id()
    return DeltaToolCall(
        index=piece.index,
        id=call_id,
        type="function",
        function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
    )
