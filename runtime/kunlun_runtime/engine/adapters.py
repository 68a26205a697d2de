"""The engine's LoRA adapters: register and forget them, and before each step put the adapters its
requests run on into the model's slots (every rank's, through the group).

Reading a checkpoint (``read``) touches no engine state, so a server can do it off the engine
thread and hand the adapter to ``add``; everything else runs on the engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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
    def __init__(self, config: EngineConfig, base: ModelConfig, served_name: str, install: Install) -> None:
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self._base = base
        self._served_name = served_name
        self._install = install
        self.registry = LoRARegistry(config.max_loras, config.lora_cache_size, self.read)

    def read(self, lora: LoRARequest) -> LoRAAdapter:
        """Read and check ``lora``'s checkpoint for the served model (thread-safe)."""
        if lora.base_model_name is not None and lora.base_model_name != self._served_name:
            raise InvalidRequestError(
                f"base_model_name: adapter {lora.lora_name!r} is for {lora.base_model_name!r}, "
                f"but this server serves {self._served_name!r}",
                field="base_model_name",
            )
        return read_adapter(lora, self._base, self.max_lora_rank)

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

    def resolve(self, lora: LoRARequest) -> LoRARequest:
        """The registered adapter a request runs on; one not yet known is registered (read from
        its path) as vLLM does."""
        known = self.registry.get(lora.lora_name)
        if known is not None and known == lora:
            return known
        self.add(lora)
        return lora

    def assign_slots(self, sched: SchedulerOutput, running: list[Request]) -> dict[str, int]:
        """The slot of each scheduled request on an adapter, installing what is not in one yet."""
        busy = {r.lora for r in running if r.lora is not None}
        slots: dict[str, int] = {}
        for item in sched.scheduled:
            lora = item.request.lora
            if lora is None:
                continue
            slot, adapter = self.registry.assign_slot(lora, busy)
            if adapter is not None:
                self._install(slot, adapter)
            slots[item.request.request_id] = slot
        return slots

    def activity(self, running: list[Request], waiting: list[Request]) -> tuple[int, list[str], list[str]]:
        """(max_loras, adapters of running requests, adapters of waiting ones), names sorted."""

        def names(requests: list[Request]) -> list[str]:
            return sorted({r.lora.lora_name for r in requests if r.lora is not None})

        return self.max_loras, names(running), names(waiting)
