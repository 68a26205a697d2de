"""Which adapters the engine knows, which it holds in host memory, and which sit in the model's slots.

- Known: every adapter registered (``--lora-modules``, the load API, or a request naming a new
  one), by name, with its id and path. Names and ids are unique: the same name with another id or
  path, or the same id with another name, is refused naming ``lora_name``.
- Loaded (host memory): at most ``cache_size`` (``--max-cpu-loras``) read adapters, least recently
  used dropped beyond it; a known adapter that was dropped is read again from its path when a
  request needs it.
- Slots (the model): ``max_loras`` (``--max-loras``) adapters a step can use. An adapter keeps its
  slot while requests on it run; a newcomer takes a free slot or the least recently used one that
  no running request needs. The scheduler admits a request on a new adapter only while the running
  requests use fewer than ``max_loras`` adapters, so a slot is always there for it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.checkpoint import LoRAAdapter
from kunlun_runtime.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, max_loras: int, cache_size: int, read: Callable[[LoRARequest], LoRAAdapter]) -> None:
        """``read``: reads and checks an adapter's checkpoint for the served model."""
        self.max_loras = max_loras
        self.cache_size = cache_size
        self._read = read
        self._known: dict[str, LoRARequest] = {}
        # Keyed by the whole request: an adapter unloaded and loaded again from elsewhere under the
        # same name is another adapter (running requests on the old one keep theirs).
        self._loaded: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: list[LoRARequest | None] = [None] * max_loras
        self._slot_use: list[int] = [0] * max_loras  # when each slot was last given out
        self._clock = 0

    def check(self, lora: LoRARequest) -> None:
        """Refuse a name or id clash with a known adapter (InvalidRequestError naming lora_name)."""
        if not lora.lora_name:
            raise InvalidRequestError("lora_name: must not be empty", field="lora_name")
        if (
            isinstance(lora.lora_int_id, bool)
            or not isinstance(lora.lora_int_id, int)
            or lora.lora_int_id < 1
        ):
            raise InvalidRequestError(
                f"lora_int_id: must be a positive integer, got {lora.lora_int_id!r}", field="lora_int_id"
            )
        known = self._known.get(lora.lora_name)
        if known is not None and (known.lora_int_id, known.lora_path) != (lora.lora_int_id, lora.lora_path):
            raise InvalidRequestError(
                f"lora_name: an adapter named {lora.lora_name!r} is already loaded from {known.lora_path} "
                f"(id {known.lora_int_id}); unload it first",
                field="lora_name",
            )
        clash = next((k for k in self._known.values() if k.lora_int_id == lora.lora_int_id), None)
        if clash is not None and clash.lora_name != lora.lora_name:
            raise InvalidRequestError(
                f"lora_name: id {lora.lora_int_id} is already adapter {clash.lora_name!r}", field="lora_name"
            )

    def add(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Register ``lora`` (read it unless ``adapter`` is given or it is in host memory); returns
        the adapter. Nothing changes when it is refused."""
        self.check(lora)
        if adapter is None:
            adapter = self._loaded.get(lora)
        if adapter is None:
            adapter = self._read(lora)
            if lora.lora_name in self._known:
                logger.info("LoRA adapter %s read again from %s", lora.lora_name, lora.lora_path)
        self._known[lora.lora_name] = lora
        self._keep(lora, adapter)
        return adapter

    def remove(self, lora_name: str) -> bool:
        """Forget an adapter (False: unknown). Requests already running on it keep its slot until
        they finish; a request naming it afterwards registers it again."""
        lora = self._known.pop(lora_name, None)
        if lora is None:
            return False
        self._loaded.pop(lora, None)
        return True

    def known(self) -> list[LoRARequest]:
        return list(self._known.values())

    def get(self, lora_name: str) -> LoRARequest | None:
        return self._known.get(lora_name)

    def loaded(self, lora: LoRARequest) -> LoRAAdapter | None:
        """``lora``'s weights where they are in host memory (marked most recently used)."""
        adapter = self._loaded.get(lora)
        if adapter is not None:
            self._loaded.move_to_end(lora)
        return adapter

    def slot_of(self, lora: LoRARequest) -> int | None:
        return self._slots.index(lora) if lora in self._slots else None

    def assign_slot(
        self, lora: LoRARequest, running: Collection[LoRARequest], adapter: LoRAAdapter
    ) -> tuple[int, bool]:
        """The slot ``lora`` runs in this step, and whether ``adapter`` (its weights, which the
        request holds) must be installed there. ``running``: adapters of the running requests,
        whose slots stay."""
        self._clock += 1
        slot = self.slot_of(lora)
        if slot is not None:
            self._slot_use[slot] = self._clock
            return slot, False
        free = [i for i, held in enumerate(self._slots) if held is None or held not in running]
        if not free:  # the scheduler's max_loras admission rule makes this unreachable
            raise RuntimeError(f"no LoRA slot free for {lora.lora_name!r}: all hold running adapters")
        slot = min(free, key=lambda i: (self._slots[i] is not None, self._slot_use[i]))
        self._slots[slot] = lora
        self._slot_use[slot] = self._clock
        return slot, True

    def _keep(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        self._loaded[lora] = adapter
        self._loaded.move_to_end(lora)
        while len(self._loaded) > self.cache_size:
            dropped, _ = self._loaded.popitem(last=False)
            logger.info(
                "LoRA adapter %s unloaded from host memory (--max-cpu-loras %d)",
                dropped.lora_name,
                self.cache_size,
            )
