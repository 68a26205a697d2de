"""``POST /v1/completions``: string, strings, token ids or token-id lists; echo; legacy logprobs.

Each prompt becomes n engine requests; choice ``index`` is ``prompt_index * n + i``, as OpenAI and
vLLM number them. ``usage`` counts every prompt once and every generated token. Text prompts are
tokenized here, off the event loop (``ServedModel.encode``), so the engine gets token ids.
Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) constrain every
choice of every prompt; the constraint is compiled once, off the event loop, before the group is
queued (``add_prepared``). ``suffix`` is refused, as vLLM refuses it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from starlette.responses import Response

from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.door import tenant_of
from kunlun_runtime.server.protocol import CompletionRequest
from kunlun_runtime.server.request_building import add_prepared, children, new_id, sampling_params
from kunlun_runtime.server.request_stream import EngineRequest, RequestStream
from kunlun_runtime.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    now_seconds,
)
from kunlun_runtime.server.served_model import ServedModel, token_text
from kunlun_runtime.server.streaming import EngineStreamingResponse, collect, guard_stream, sse


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: must not be empty", field="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return list(prompt)


async def _engine_prompt(served: ServedModel, prompt: str | list[int]) -> dict[str, Any]:
    """What the engine gets: token ids (a text is tokenized here, off the event loop) and the text."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "prompt_token_ids": await served.encode(prompt, field="prompt")}
    return {"prompt_token_ids": prompt}


def completion_logprobs(
    served: ServedModel,
    token_ids: list[int],
    logprobs: Sequence[TokenLogprob | None],
    text_offset: int = 0,
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, item in zip(token_ids, logprobs, strict=False):
        text = token_text(served, token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        out.token_logprobs.append(item.logprob if item is not None else None)
        top: dict[str, float] | None = None
        if item is not None:
            top = {}
            for top_id, top_logprob in item.top:  # tokens that print alike keep the likeliest
                top.setdefault(token_text(served, top_id), top_logprob)
        out.top_logprobs.append(top)
    return out


async def create_completion(body: CompletionRequest, served: ServedModel, request: Request) -> Response:
    lora = served.check_model(body.model)
    model_name = served.name if lora is None else lora.lora_name  # what the answer says it ran
    if body.suffix is not None:  # vLLM's message, word for word
        raise InvalidRequestError("suffix is not currently supported", field="suffix")
    prompts = _prompts(body.prompt)
    echo_logprobs = body.logprobs if body.echo else None
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else echo_logprobs
    params = sampling_params(
        body, served, max_tokens=body.max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
    )
    request_id = new_id("cmpl")
    tenant = tenant_of(request)
    served.check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
    engine_requests: list[EngineRequest] = []

    async def prepare() -> list[EngineRequest]:
        for number, prompt in enumerate(prompts):
            engine_prompt = await _engine_prompt(served, prompt)
            engine_requests.extend(
                children(f"{request_id}-{number}", engine_prompt, params, body, tenant, lora)
            )
        return engine_requests

    stream = await add_prepared(served, len(prompts) * params.n, tenant, prepare)
    index_of = {r.request_id: i for i, r in enumerate(engine_requests)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(stream, served, body, request_id, index_of, include_usage, model_name)
        return EngineStreamingResponse(guard_stream(events), stream)
    finals = await collect(stream, request)
    choices = [_choice(finals[engine_id], index, served, body) for engine_id, index in index_of.items()]
    firsts = [finals[f"{request_id}-{p}-0"] for p in range(len(prompts))]  # one child per prompt
    num_prompt = sum(len(first.prompt_token_ids) for first in firsts)
    num_cached = sum(first.num_cached_tokens for first in firsts)
    num_generated = sum(len(out.outputs[0].token_ids) for out in finals.values())
    response = CompletionResponse(
        id=request_id,
        created=now_seconds(),
        model=model_name,
        choices=choices,
        usage=UsageInfo.of(
            num_prompt, num_generated, num_cached if served.enable_prompt_tokens_details else None
        ),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(
    output: RequestOutput, index: int, served: ServedModel, body: CompletionRequest
) -> CompletionChoice:
    completion = output.outputs[0]
    text, logprobs = completion.text, None
    prefix = ""
    if body.echo:
        prefix = (
            output.prompt if output.prompt is not None else served.tokenizer.decode(output.prompt_token_ids)
        )
        text = prefix + text
    if body.logprobs is not None:
        ids = list(completion.token_ids)
        items: list[TokenLogprob | None] = list(completion.logprobs or [])
        if body.echo:
            ids = output.prompt_token_ids + ids
            items = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + items
        logprobs = completion_logprobs(served, ids, items)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


async def _stream_events(
    stream: RequestStream,
    served: ServedModel,
    body: CompletionRequest,
    request_id: str,
    index_of: dict[str, int],
    include_usage: bool,
    model_name: str,
) -> AsyncIterator[str]:
    created = now_seconds()
    sent_text = dict.fromkeys(index_of.values(), 0)
    sent_tokens = dict.fromkeys(index_of.values(), 0)
    num_prompt = num_cached = num_generated = 0

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(
            CompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage)
        )

    async for output in stream:
        index = index_of[output.request_id]
        completion = output.outputs[0]
        prefix = ""
        if body.echo and sent_text[index] == 0 and sent_tokens[index] == 0:
            prefix = (
                output.prompt
                if output.prompt is not None
                else served.tokenizer.decode(output.prompt_token_ids)
            )
        text = completion.text[sent_text[index] :]
        new_ids = completion.token_ids[sent_tokens[index] :]
        if not (prefix or text or output.finished):
            continue
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(served, new_ids, (completion.logprobs or [])[sent_tokens[index] :])
        sent_text[index], sent_tokens[index] = len(completion.text), len(completion.token_ids)
        choice = CompletionChoice(
            index=index, text=prefix + text, logprobs=logprobs, finish_reason=completion.finish_reason
        )
        yield chunk([choice])
        if output.finished:
            num_generated += len(completion.token_ids)
            if output.request_id.rsplit("-", 1)[1] == "0":
                num_prompt += len(output.prompt_token_ids)
                num_cached += output.num_cached_tokens
    if include_usage:
        cached = num_cached if served.enable_prompt_tokens_details else None
        yield chunk([], UsageInfo.of(num_prompt, num_generated, cached))
