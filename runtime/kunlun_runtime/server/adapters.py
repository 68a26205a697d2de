"""``ServedAdapters``: the LoRA adapters the server serves, by the name a request's ``model`` gives.

The server's list, not the engine's: the engine keeps at most ``--max-cpu-loras`` adapters loaded
and reads an evicted one again from its path when a request names it, so a served adapter stays
servable whether or not its weights are in memory now. Ids are handed out here, 1, 2, ... in the
order adapters are added (``--lora-modules`` first, then run-time loads), never reused: an adapter
loaded again under the same name gets a new id, which the default prefix-cache hash includes.

Nothing here touches the engine (``lora_routes`` does, through ``AsyncEngine``); changes are made
on the event loop only, under ``lock`` while a load or unload is under way.
"""

from __future__ import annotations

import asyncio

from kunlun_runtime.errors import ConfigError, InvalidRequestError
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.options.lora import validate_adapter_name
from kunlun_runtime.server.errors import APIError
from kunlun_runtime.server.responses import ModelCard


def unknown_model(model: str) -> APIError:
    """The 404 of a ``model`` that is neither the base nor a served adapter (vLLM's message)."""
    return APIError(404, f"The model `{model}` does not exist.", param="model")


class ServedAdapters:
    """Served name → ``LoRARequest`` for one base model named ``base_name``."""

    def __init__(self, base_name: str, *, enabled: bool = False) -> None:
        self.base_name = base_name
        self.enabled = enabled  # --enable-lora: without it no adapter can be added
        self._by_name: dict[str, LoRARequest] = {}
        self._last_id = 0
        self.lock = asyncio.Lock()  # one load or unload at a time (its read may take seconds)

    def __len__(self) -> int:
        return len(self._by_name)

    def loras(self) -> list[LoRARequest]:
        """The served adapters, in the order they were added."""
        return list(self._by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names: None for the base model (or no name), the
        adapter for an adapter's name. Raises APIError 404 for any other name."""
        if model is None or model == self.base_name:
            return None
        lora = self._by_name.get(model)
        if lora is None:
            raise unknown_model(model)
        return lora

    def new_request(
        self, name: str, path: str, *, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        """A LoRARequest for a new adapter ``name`` at ``path`` with the next id; not yet added.

        Raises:
            InvalidRequestError: LoRA is not enabled, the name is empty, holds a comma, is the base
                model's, or is already served (unless ``replace``), or ``base_model_name`` is not
                the served base model (400, field ``lora_name`` or ``base_model_name``).
        """
        if not self.enabled:
            raise InvalidRequestError("LoRA adapters are not enabled (--enable-lora)", field="lora_name")
        try:
            validate_adapter_name(name, "lora_name")
        except ConfigError as error:
            raise InvalidRequestError(str(error), field="lora_name") from None
        if name == self.base_name:
            raise InvalidRequestError(
                f"lora_name: '{name}' is the base model's name; an adapter needs its own", field="lora_name"
            )
        if name in self._by_name and not replace:  # vLLM's message, and the way out it offers
            raise InvalidRequestError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.",
                field="lora_name",
            )
        if base_model_name is not None and base_model_name != self.base_name:
            raise InvalidRequestError(
                f"base_model_name: adapter '{name}' is for '{base_model_name}', but this server "
                f"serves '{self.base_name}'",
                field="base_model_name",
            )
        self._last_id += 1
        return LoRARequest(name, self._last_id, path, base_model_name)

    def add(self, lora: LoRARequest) -> None:
        """Serve ``lora`` (replacing a served adapter of its name); requests may name it now."""
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving ``name``; returns what it was, None when it was not served."""
        return self._by_name.pop(name, None)

    def cards(self, created: int) -> list[ModelCard]:
        """``/v1/models`` entries of the adapters, as vLLM lists them: ``parent`` the base model,
        ``root`` the adapter's path."""
        return [
            ModelCard(id=lora.lora_name, created=created, root=lora.lora_path, parent=self.base_name)
            for lora in self._by_name.values()
        ]
