"""From a request body to queued engine requests: SamplingParams, n children, queue places.

``sampling_params`` maps the body's sampling fields (and its structured-output constraint) to the
engine's ``SamplingParams``, refusing what cannot be served with the field named. ``n > 1``
becomes n engine requests with seeds ``seed + i`` (as the offline API does), so each choice is
reproducible on its own (``children``). The group's queue places are taken before its prompts are
tokenized (``add_prepared``), so a full queue is answered at once and the work is bounded before
it starts. A structured-output constraint (JSON Schema, regex, grammar) is compiled in the same
step, on the tokenizer pool (``prepare_structured_outputs``): a slow compile stalls neither /health
nor the engine thread, whose own compile of the constraint is then a cache hit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.server.auth import scoped_cache_salt
from kunlun_runtime.server.protocol import SamplingFields
from kunlun_runtime.server.request_stream import EngineRequest, RequestStream
from kunlun_runtime.server.served_model import ServedModel
from kunlun_runtime.server.structured_outputs import parse_structured_outputs
from kunlun_runtime.structured.params import StructuredOutputsParams


def new_id(prefix: str) -> str:
    """A new API request id: ``prefix``, then a random hex (``chatcmpl-…``, ``cmpl-…``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


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
    lora: LoRARequest | None = None,
) -> list[EngineRequest]:
    """n engine requests for one prompt, seeded ``seed + i``, in ``tenant``'s cache namespace, on
    adapter ``lora`` (None: the base model)."""
    salt = scoped_cache_salt(tenant, body.cache_salt)
    out = []
    for index in range(params.n):
        child = replace(params, n=1)
        if params.seed is not None:
            child.seed = params.seed + index
        out.append(EngineRequest(f"{base_id}-{index}", prompt, child, body.priority, salt, tenant, lora))
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
        requests = await read_adapter_weights(served, requests)
    except BaseException:
        served.engine.release(count, tenant)
        raise
    return await served.engine.add(requests, reserved=True)


async def read_adapter_weights(served: ServedModel, requests: list[EngineRequest]) -> list[EngineRequest]:
    """The group with its adapter's weights where the engine no longer holds them in memory
    (``--max-cpu-loras``): read on a worker thread, so the engine's step never waits for a read."""
    lora = requests[0].lora_request if requests else None  # a group shares its model
    if lora is None or served.engine.lora_is_loaded(lora):
        return requests
    adapter = await asyncio.to_thread(served.engine.read_lora, lora)
    return [replace(request, lora_adapter=adapter) for request in requests]


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
    loop = asyncio.get_running_loop()
    for constraint in constraints.values():
        await loop.run_in_executor(served.tokenizer_pool, served.engine.compile_structured, constraint)
