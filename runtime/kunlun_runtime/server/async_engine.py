"""``AsyncEngine``: the single-threaded ``LLMEngine`` driven from its own thread, for asyncio callers.

The engine thread owns the engine: only it calls ``add_request``/``step``/``abort_request``. The
event loop hands it commands through a locked inbox and receives outputs through per-request
asyncio queues (filled with ``call_soon_threadsafe``, one call per step), so a step never blocks
the event loop and the loop never touches engine state. A caller that stops listening (client
disconnect, cancellation) aborts its requests, which returns their KV blocks.

Backpressure: at most ``max_queue_len`` requests may wait (in the scheduler or in the inbox); more
raises ``QueueFullError`` at once instead of growing an unbounded queue. If a step raises, the
engine is dead: every open stream gets ``EngineDeadError`` and so does every later call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.errors import EngineDeadError, KunlunRuntimeError
from kunlun_runtime.sampling_params import SamplingParams
from kunlun_runtime.server.errors import QueueFullError
from kunlun_runtime.server.stats import StatsRecorder

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One engine request: n > 1 is served as n of these sharing a prompt."""

    request_id: str
    prompt: str | list[int] | dict
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    queue: asyncio.Queue
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        stats: StatsRecorder | None = None,
        max_queue_len: int | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self._stats = stats
        self._cond = threading.Condition()
        self._inbox: list[_Add | list[str]] = []  # guarded by _cond
        self._num_pending = 0  # requests in the inbox, guarded by _cond
        self._num_waiting = 0  # scheduler's waiting requests after the last step, guarded by _cond
        self._queues: dict[str, asyncio.Queue] = {}  # engine thread only
        self._stop = False
        self._dead: BaseException | None = None
        self._on_dead = on_dead  # called on the event loop once the engine has failed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_active = 0  # open RequestStreams (event loop only)
        self._idle: asyncio.Event | None = None

    # -- lifecycle (event loop) --------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    async def wait_idle(self) -> None:
        """Return once no RequestStream is open (used to drain on shutdown)."""
        assert self._idle is not None, "start() first"
        await self._idle.wait()

    # -- requests (event loop) ---------------------------------------------------------------------
    async def add(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue ``requests`` (one HTTP request's children) and return the stream of their outputs.

        Raises InvalidRequestError for a request the engine refuses (nothing of the group stays
        queued), QueueFullError when too many requests wait, EngineDeadError when the engine has
        failed. The caller must ``close()`` the stream; closing early aborts what is unfinished.
        """
        self._admit(len(requests))
        add = _Add(requests, asyncio.Queue())
        stream = RequestStream(self, add.queue, {r.request_id for r in requests})
        self._submit(add)
        try:
            await asyncio.wrap_future(add.done)
        except KunlunRuntimeError:  # refused: the engine thread has already undone the group
            stream.remaining.clear()
            stream.close()
            raise
        except BaseException:
            stream.close()
            raise
        return stream

    def _opened(self) -> None:
        assert self._idle is not None, "start() first"  # streams come from add(), after start()
        self.num_active += 1
        self._idle.clear()

    def _closed(self, unfinished: set[str]) -> None:
        if unfinished:
            self._submit(sorted(unfinished))
        self.num_active -= 1
        if self.num_active == 0:
            assert self._idle is not None, "start() first"  # a stream was opened, after start()
            self._idle.set()

    def _admit(self, count: int) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead}")
        with self._cond:
            queued = self._num_waiting + self._num_pending
            if self.max_queue_len is not None and queued + count > self.max_queue_len:
                raise QueueFullError(
                    f"too many requests waiting ({queued}, limit {self.max_queue_len}); retry later"
                )
            self._num_pending += count

    def _submit(self, command: _Add | list[str]) -> None:
        with self._cond:
            if self._dead is not None:  # nobody will read the inbox again
                if isinstance(command, _Add):
                    command.done.set_exception(EngineDeadError(f"the engine has failed: {self._dead}"))
                return
            self._inbox.append(command)
            self._cond.notify()

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stop or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stop:
                        return
                    commands, self._inbox = self._inbox, []
                deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []
                aborted = [out for command in commands for out in self._apply(command)]
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                for output in outputs:
                    queue = self._queues.get(output.request_id)
                    if output.finished:
                        self._queues.pop(output.request_id, None)
                    if queue is not None:
                        deliveries.append((queue, output))
                with self._cond:
                    self._num_waiting = len(self.engine.scheduler.waiting)
                if self._stats is not None:
                    self._stats.record(self.engine, outputs + aborted, ran_step=bool(outputs))
                self._deliver(deliveries)
        except BaseException as error:  # the engine cannot continue: fail every stream, then stop
            logger.exception("engine loop failed")
            dead = EngineDeadError(f"the engine has failed: {error}")
            with self._cond:
                self._dead = error
                for command in self._inbox:
                    if isinstance(command, _Add):
                        command.done.set_exception(dead)
                self._inbox = []
            self._deliver([(queue, dead) for queue in self._queues.values()])
            if self._on_dead is not None and self._loop is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._on_dead, error)

    def _apply(self, command: _Add | list[str]) -> list[RequestOutput]:
        """Apply one inbox command; returns the outputs of requests it aborted."""
        if isinstance(command, list):
            aborted = [self.engine.abort_request(request_id) for request_id in command]
            for request_id in command:
                self._queues.pop(request_id, None)
            return [out for out in aborted if out is not None]
        with self._cond:
            self._num_pending -= len(command.requests)
        added: list[str] = []
        try:
            for request in command.requests:
                self.engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.params,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                )
                added.append(request.request_id)
                self._queues[request.request_id] = command.queue
        except Exception as error:  # refused (InvalidRequestError): undo the group's earlier members
            for request_id in added:
                self.engine.abort_request(request_id)
                self._queues.pop(request_id, None)
            command.done.set_exception(error)
            return []
        command.done.set_result(None)
        return []

    def _deliver(self, deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
        if not deliveries or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(_put_all, deliveries)


class RequestStream:
    """The outputs of one group of engine requests, in the order the engine produced them."""

    def __init__(self, engine: AsyncEngine, queue: asyncio.Queue, request_ids: set[str]) -> None:
        self._engine = engine
        self._queue = queue
        self.remaining = set(request_ids)
        self._closed = False
        engine._opened()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.remaining:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.remaining.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Idempotent: abort whatever is unfinished and stop counting this stream as in flight."""
        if not self._closed:
            self._closed = True
            self._engine._closed(self.remaining)


def _put_all(deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
