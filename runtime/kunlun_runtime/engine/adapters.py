"""The engine's LoRA adapters: register and forget them, and before each step put the adapters its
requests run on into the model's slots (every rank's, through the group).

Reading a checkpoint (``read``) touches no engine state, so a server can do it off the engine
thread and hand the adapter to ``add`` or ``add_request``; everything else runs on the engine
thread. Each request holds its adapter's weights from admission to its end (``pin``), so a step
never reads a checkpoint: an adapter unloaded, or dropped from host memory, while requests on it
wait is still there for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.scheduler_output import SchedulerOutput
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.checkpoint import LoRAAdapter, read_adapter
from kunlun_runtime.lora.registry import LoRARegistry
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

Install = Callable[[int, LoRAAdapter | None], None]  # slot, adapter: on every rank


class EngineAdapters:
    def __init__(
        self,
        config: EngineConfig,
        base: ModelConfig,
        served_name: str,
        install: Install,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``dtype``: the model's activations, which the slots hold (adapters are kept in it:
        half the host memory, and half the bytes sent to other ranks, under BF16)."""
        self._dtype = dtype
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self._base = base
        self._served_name = served_name
        self._install = install
        self.registry = LoRARegistry(config.max_loras, config.lora_cache_size, self.read)
        self._pinned: dict[str, LoRAAdapter] = {}  # request id → its adapter's weights

    def read(self, lora: LoRARequest) -> LoRAAdapter:
        """Read and check ``lora``'s checkpoint for the served model (thread-safe)."""
        if lora.base_model_name is not None and lora.base_model_name != self._served_name:
            raise InvalidRequestError(
                f"base_model_name: adapter {lora.lora_name!r} is for {lora.base_model_name!r}, "
                f"but this server serves {self._served_name!r}",
                field="base_model_name",
            )
        return read_adapter(lora, self._base, self.max_lora_rank).to(self._dtype)

    def add(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        if lora.lora_name == self._served_name:
            raise InvalidRequestError(
                f"lora_name: {lora.lora_name!r} is the base model's name", field="lora_name"
            )
        added = self.registry.add(lora, adapter)
        logger.info(
            "LoRA adapter %s (id %d, rank %d, %.1f MiB) loaded from %s",
            lora.lora_name,
            lora.lora_int_id,
            added.rank,
            added.nbytes / 2**20,
            lora.lora_path,
        )
        return added

    def is_loaded(self, lora: LoRARequest) -> bool:
        """Whether ``lora`` is registered and in host memory (a request on it reads nothing)."""
        return self.registry.get(lora.lora_name) == lora and self.registry.loaded(lora) is not None

    def pin(
        self, request_id: str, lora: LoRARequest, adapter: LoRAAdapter | None = None, *, register: bool = True
    ) -> LoRARequest:
        """The adapter a request runs on, its weights held for the request. ``adapter``: read
        already (off the engine thread). An adapter not registered is registered (read from its
        path) as vLLM's offline API does, or with ``register=False`` (the server, whose names may
        have been unloaded since the request was checked) refused as an unknown model (404)."""
        known = self.registry.get(lora.lora_name)
        if known != lora:
            if not register:
                raise InvalidRequestError(
                    f"The model `{lora.lora_name}` does not exist.", field="model", status_code=404
                )
            adapter = self.add(lora, adapter)
        weights = adapter or self.registry.loaded(lora) or self.registry.add(lora)
        self._pinned[request_id] = weights
        return lora

    def release(self, request_id: str) -> None:
        self._pinned.pop(request_id, None)

    def assign_slots(self, sched: SchedulerOutput, running: list[Request]) -> dict[str, int]:
        """The slot of each scheduled request on an adapter, installing what is not in one yet."""
        busy = {r.lora for r in running if r.lora is not None}
        slots: dict[str, int] = {}
        for item in sched.scheduled:
            lora = item.request.lora
            if lora is None:
                continue
            slot, fresh = self.registry.assign_slot(lora, busy, self._pinned[item.request.request_id])
            if fresh:
                self._install(slot, self._pinned[item.request.request_id])
            slots[item.request.request_id] = slot
        return slots

    def activity(self, running: list[Request], waiting: list[Request]) -> tuple[int, list[str], list[str]]:
        """(max_loras, adapters of running requests, adapters of waiting ones), names sorted."""

        def names(requests: list[Request]) -> list[str]:
            return sorted({r.lora.lora_name for r in requests if r.lora is not None})

        return self.max_loras, names(running), names(waiting)
