"""The FastAPI application: routes only; the work happens in ``chat``, ``completions``, ``lifecycle``.

``create_app(engine_factory, ...)`` returns an app whose lifespan loads the model in the
background; tests serve it with uvicorn in-process, ``kunlun-runtime serve`` from the CLI. Every
request passes ``door.Door`` first: API keys (one per tenant) guard the ``/v1`` routes and
tokenization, an optional token guards ``/metrics``, and body sizes are limited, all before a body
is read. ``/health`` and ``/version`` stay open for probes.

No ``from __future__ import annotations`` here: FastAPI resolves the route signatures, and the
``Annotated`` dependency alias they use is local to ``create_app``.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.platforms.cpu_features import cpu_capabilities
from kunlun_runtime.server.auth import DEFAULT_TENANT, Tenants
from kunlun_runtime.server.chat import chat_prompt, create_chat_completion
from kunlun_runtime.server.completions import create_completion
from kunlun_runtime.server.door import DEFAULT_MAX_REQUEST_BODY_BYTES, Door
from kunlun_runtime.server.errors import install_error_handlers, unavailable
from kunlun_runtime.server.fair_share import DEFAULT_MAX_WAITING_SHARE
from kunlun_runtime.server.lifecycle import Lifecycle, ServerState
from kunlun_runtime.server.lora_routes import install_lora_routes
from kunlun_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kunlun_runtime.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    now_seconds,
)
from kunlun_runtime.server.served_model import ServedModel
from kunlun_runtime.server.tool_calls import DEFAULT_PROMPT_FORMAT, ToolPlan
from kunlun_runtime.version import __version__

# FastAPI's type for ``responses=`` (the keys may also be "4XX" or "default").
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


def create_app(
    engine_factory: Callable[[], LLMEngine],
    *,
    max_queue_len: int | None = None,
    api_key: str | None = None,
    tenants: Tenants | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_waiting_share: float = DEFAULT_MAX_WAITING_SHARE,
    metrics_token: str | None = None,
    lifecycle: Lifecycle | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    enable_prompt_tokens_details: bool = False,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The application. ``tenants`` (else the one ``api_key``, else an open server) says who may
    call; ``max_waiting_share`` bounds each tenant's part of the waiting queue when there are
    several; ``tool_call_parser`` and ``enable_auto_tool_choice`` are vLLM's tool-calling flags,
    ``enable_prompt_tokens_details`` its flag for counting cached prompt tokens in ``usage``;
    ``allow_runtime_lora_updating`` adds vLLM's routes that load and unload LoRA adapters;
    ``lifecycle`` (built from the other arguments when omitted) owns the engine."""
    tenants = tenants or Tenants({DEFAULT_TENANT: api_key} if api_key else None)
    life = lifecycle or Lifecycle(
        engine_factory,
        max_queue_len=max_queue_len,
        max_waiting_share=tenants.queue_share(max_waiting_share),
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await life.start()
        yield
        await life.stop()

    app = FastAPI(title="kunlun-inference", version=__version__, lifespan=lifespan)
    app.state.lifecycle = life
    install_error_handlers(app)
    app.add_middleware(
        Door,
        tenants=tenants,
        max_request_body_bytes=max_request_body_bytes,
        metrics_token=metrics_token,
    )

    # The dependency is async: FastAPI runs a plain `def` dependency in its thread pool, a hop
    # per request for checks that never block.
    async def served() -> ServedModel:
        if life.state is not ServerState.READY or life.served is None:
            raise unavailable(life.not_ready_message())
        return life.served

    Model = Annotated[ServedModel, Depends(served)]

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if life.state is ServerState.READY:
            return Response(status_code=200)
        raise unavailable(f"not ready ({life.state.value}): {life.not_ready_message()}")

    @app.get("/version")
    async def version() -> dict[str, object]:
        # What the engine runs with (backend, kernel tier, dtypes, KV capacity): null until loaded.
        runtime = None if life.runtime_info is None else life.runtime_info.describe()
        return {"version": __version__, "cpu": cpu_capabilities().describe(), "runtime": runtime}

    @app.get("/metrics", responses={401: {"model": ErrorResponse}})
    async def metrics() -> Response:
        life.update_telemetry()
        return Response(generate_latest(life.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(model: Model) -> ModelList:
        # The base's `root` is its served name, never the weights' path on the server's disk; an
        # adapter's is its path, as vLLM lists it (the path the operator or the loader gave).
        created = now_seconds()
        card = ModelCard(id=model.name, created=created, root=model.name, max_model_len=model.max_model_len)
        return ModelList(data=[card, *model.adapters.cards(created)])

    if allow_runtime_lora_updating:  # else the routes do not exist (404), as in vLLM
        install_lora_routes(app, served)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request, model: Model) -> Response:
        return await create_completion(body, model, request)

    @app.post(
        "/v1/chat/completions",
        responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
    )
    async def chat(body: ChatCompletionRequest, request: Request, model: Model) -> Response:
        return await create_chat_completion(body, model, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, model: Model) -> TokenizeResponse:
        model.check_model(body.model)
        # The same path as generation: the character cap first, long texts off the event loop.
        if body.tools is not None and not body.tools:  # as chat answers it
            raise InvalidRequestError(
                "tools: must not be an empty array; give at least one tool or omit the field", field="tools"
            )
        if body.messages is not None:
            # The prompt a chat request with these messages and tools renders; which tool_choice
            # does not change the prompt, only how the output is constrained and read.
            plan = ToolPlan(
                "none",
                tools=tuple(tool.model_dump(exclude_none=True) for tool in body.tools or ()),
                prompt_format=model.tool_call_parser or DEFAULT_PROMPT_FORMAT,
            )
            conversation, kwargs = chat_prompt(model, body.messages, plan, body.chat_template_kwargs)
            tokens = await model.encode_chat(conversation, body.add_generation_prompt, **kwargs)
        elif body.prompt is not None:
            tokens = await model.encode(
                body.prompt, field="prompt", add_special_tokens=body.add_special_tokens
            )
        else:
            raise InvalidRequestError("prompt: give a prompt or messages", field="prompt")
        return TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, model: Model) -> DetokenizeResponse:
        model.check_model(body.model)
        bad = [t for t in body.tokens if t >= model.vocab_size]
        if bad:
            raise InvalidRequestError(f"tokens: not token ids: {bad[:5]}", field="tokens")
        return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens))

    return app
