"""Loading and unloading LoRA adapters while serving: vLLM's two routes, and ``--lora-modules``.

``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` take vLLM's bodies and give
its answers (``Success: LoRA adapter 'NAME' added successfully.`` as text, or an error body). They
exist only with ``--allow-runtime-lora-updating`` (or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); else
they are 404s, as in vLLM. The door authenticates them like every ``/v1`` route.

A load never stalls the engine: the checkpoint is read and checked on a worker thread
(``AsyncEngine.read_lora``), and only the quick registration of what was read runs on the engine
thread, between two steps. Whatever is wrong with it (a missing or invalid checkpoint, a rank above
``--max-lora-rank``, shapes that are not the base model's, a name already served) is a 400 naming
the problem, raised before anything served changes. Adapters of ``--lora-modules`` take the same
path at start, in order, before the server is ready; a bad one fails the start, naming it.

No ``from __future__ import annotations``: FastAPI resolves the routes' signatures, whose
dependency alias is local to ``install_lora_routes``.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Protocol

from fastapi import Depends, FastAPI
from starlette.responses import PlainTextResponse

from kunlun_runtime.errors import ConfigError, InvalidRequestError
from kunlun_runtime.lora.checkpoint import LoRAAdapter
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.options.lora import LoRAModule
from kunlun_runtime.server.errors import APIError
from kunlun_runtime.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kunlun_runtime.server.served_model import ServedModel

logger = logging.getLogger(__name__)


class AdapterTable(Protocol):
    """What registering runs on the engine thread (``LLMEngine``'s adapter methods)."""

    def add_lora(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> None: ...

    def remove_lora(self, lora_name: str) -> bool: ...


async def load_adapter(
    served: ServedModel,
    name: str,
    path: str,
    *,
    base_model_name: str | None = None,
    replace: bool = False,
) -> LoRARequest:
    """Read adapter ``name`` from ``path`` off the engine thread, then register and serve it
    (``replace``: in place of a served adapter of that name). Returns its LoRARequest.

    Raises:
        InvalidRequestError: the name is taken or unusable, or the checkpoint is missing,
            invalid, of too high a rank or not for this base model (400; nothing served changed).
    """
    adapters = served.adapters
    async with adapters.lock:
        lora = adapters.new_request(name, path, base_model_name=base_model_name, replace=replace)
        adapter = await asyncio.to_thread(served.engine.read_lora, lora)
        replacing = adapters.get(name) is not None

        def register(engine: AdapterTable) -> None:  # on the engine thread, between two steps
            if replacing:
                engine.remove_lora(name)
            engine.add_lora(lora, adapter)

        await served.engine.run_on_engine_thread(register)
        adapters.add(lora)
    logger.info("loaded LoRA adapter %s (id %d) from %s", name, lora.lora_int_id, path)
    return lora


async def unload_adapter(served: ServedModel, name: str, lora_int_id: int | None = None) -> None:
    """Stop serving adapter ``name`` and unload it from the engine; requests already running on it
    finish. Raises APIError 404 when no adapter of that name is served, InvalidRequestError when
    ``lora_int_id`` is given and is not its id."""
    adapters = served.adapters
    async with adapters.lock:
        lora = adapters.get(name)
        if lora is None:  # vLLM's answer
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        if lora_int_id is not None and lora_int_id != lora.lora_int_id:
            raise InvalidRequestError(
                f"lora_int_id: adapter '{name}' has id {lora.lora_int_id}, not {lora_int_id}",
                field="lora_int_id",
            )
        await served.engine.run_on_engine_thread(lambda engine: engine.remove_lora(name))
        adapters.remove(name)
    logger.info("unloaded LoRA adapter %s (id %d)", name, lora.lora_int_id)


async def load_startup_adapters(served: ServedModel, modules: Sequence[LoRAModule]) -> None:
    """Serve the ``--lora-modules`` adapters, in order (ids 1, 2, ...). Raises ConfigError naming
    the first that cannot be served and why."""
    for module in modules:
        try:
            await load_adapter(served, module.name, module.path, base_model_name=module.base_model_name)
        except InvalidRequestError as error:
            raise ConfigError(
                f"--lora-modules {module.name}={module.path}: {error.message}", field="lora_modules"
            ) from error


def install_lora_routes(app: FastAPI, served: Callable[[], Awaitable[ServedModel]]) -> None:
    """Add the two routes to ``app``; ``served`` is the dependency that gives the served model
    (503 while loading or draining)."""
    Model = Annotated[ServedModel, Depends(served)]

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, model: Model) -> PlainTextResponse:
        for field in ("lora_name", "lora_path"):
            if not getattr(body, field):  # vLLM's message, naming the field that is missing
                raise InvalidRequestError(
                    f"{field}: Both 'lora_name' and 'lora_path' must be provided.", field=field
                )
        await load_adapter(model, body.lora_name, body.lora_path, replace=body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, model: Model) -> PlainTextResponse:
        if not body.lora_name:
            raise InvalidRequestError("lora_name: must be provided", field="lora_name")
        await unload_adapter(model, body.lora_name, body.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
