"""What one API request hands the engine and gets back: ``EngineRequest`` and ``RequestStream``.

A route turns its prompt into one ``EngineRequest`` per choice (``request_building.children``),
queues them together with ``AsyncEngine.add`` and reads their outputs from the ``RequestStream``
that returns, in the order the engine produced them. The stream is the caller's side only: it
never touches the engine; closing it hands the unfinished request ids to ``on_close`` (the
AsyncEngine aborts them), once, however the reader stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.lora.checkpoint import LoRAAdapter
from kunlun_runtime.lora.request import LoRARequest


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One engine request: n > 1 is served as n of these sharing a prompt."""

    request_id: str
    prompt: str | list[int] | dict
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None  # who asked (the API key's tenant): queue shares are per tenant
    lora_request: LoRARequest | None = None  # the adapter the request's model names; None: the base
    lora_adapter: LoRAAdapter | None = None  # its weights, read off the engine thread where not loaded


class RequestStream:
    """The outputs of one group of engine requests, in the order the engine produced them."""

    def __init__(
        self,
        queue: asyncio.Queue,
        request_ids: set[str],
        on_close: Callable[[RequestStream], None],
    ) -> None:
        self._queue = queue
        self.remaining = set(request_ids)  # not finished yet: closing the stream aborts them
        self._on_close = on_close
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.remaining:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.remaining.discard(item.request_id)
            yield item

    def put_error(self, error: BaseException) -> None:
        """End the stream: its reader raises ``error`` next (event loop only)."""
        self._queue.put_nowait(error)

    def close(self) -> None:
        """Idempotent: abort whatever is unfinished and stop counting this stream as in flight."""
        if not self._closed:
            self._closed = True
            self._on_close(self)


def put_all(deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """Hand each output (or error) to its stream's queue (event loop only: one call per step)."""
    for queue, item in deliveries:
        queue.put_nowait(item)
