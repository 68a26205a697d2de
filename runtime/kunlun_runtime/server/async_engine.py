"""``AsyncEngine``: the single-threaded ``LLMEngine`` driven from its own thread, for asyncio callers.

The engine thread owns the engine: only it calls ``add_request``/``step``/``abort_request``. The
event loop hands it commands through a locked inbox and receives outputs through per-request
asyncio queues (filled with ``call_soon_threadsafe``, one call per step), so a step never blocks
the event loop and the loop never touches engine state. A caller that stops listening (client
disconnect, cancellation) aborts its requests, which returns their KV blocks.

Backpressure: at most ``max_queue_len`` requests may wait (in the scheduler or in the inbox); more
raises ``QueueFullError`` at once instead of growing an unbounded queue, and so does a tenant
holding more than its share of those places (``fair_share``). A group larger than
``max_queue_len``, or than its tenant's share of it, could never be admitted: it is a 400 naming
``n``, not a 429. If a step raises,
the engine is dead: every open stream gets ``EngineDeadError`` and so does every later call.

Liveness: the engine thread stamps when it last made progress and how long recent steps took;
``stalled_seconds`` tells the lifecycle's watchdog how long it has been busy without finishing a
turn, and ``fail`` ends every open stream from the event loop when the thread cannot (it is stuck).
``cut_off`` ends every open stream with a given error (the drain timeout).

The one door: the server reaches the engine only through this class. What it knows of the engine
is read once (``facts``); what it asks later (the tokenizer, a constraint's compile, telemetry,
counters, a failing rank, an adapter's read) has a method here; nothing else holds the
``LLMEngine``, and quick work on it between steps (registering an adapter) is a command in the
inbox like the others (``run_on_engine_thread``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.outputs import EngineCounters, RequestOutput
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import EngineDeadError, KunlunRuntimeError
from kunlun_runtime.lora.checkpoint import LoRAAdapter
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.models.tokenizer import Tokenizer
from kunlun_runtime.platforms.base import Telemetry
from kunlun_runtime.server.engine_facts import read_facts
from kunlun_runtime.server.errors import QueueFullError
from kunlun_runtime.server.fair_share import WaitingShares
from kunlun_runtime.server.request_stream import EngineRequest, RequestStream, put_all
from kunlun_runtime.server.stats import StatsRecorder
from kunlun_runtime.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

NUM_RECENT_STEPS = 64  # how many step durations the watchdog's bound is derived from
WARMUP_MAX_TOKENS = 2
T = TypeVar("T")


@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    queue: asyncio.Queue
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class _Call:  # work(engine) on the engine thread between two steps (run_on_engine_thread)
    work: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queue_len: int | None = None,
        max_waiting_share: float | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._engine = engine  # the engine thread's alone once started
        self.facts = read_facts(engine)
        self.max_queue_len = max_queue_len
        self._shares = WaitingShares(max_waiting_share, max_queue_len)  # guarded by _cond
        self._stats: StatsRecorder | None = None  # set by start()
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Call | list[str]] = []  # guarded by _cond
        self._num_pending = 0  # requests in the inbox, guarded by _cond
        self._num_waiting = 0  # scheduler's waiting requests after the last step, guarded by _cond
        self._queues: dict[str, asyncio.Queue] = {}  # engine thread only
        self._stop = False
        self._dead: BaseException | None = None
        self._on_dead = on_dead  # called on the event loop once the engine has failed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_active = 0  # open RequestStreams (event loop only)
        self._streams: set[RequestStream] = set()  # open RequestStreams (event loop only)
        self._idle: asyncio.Event | None = None
        # Liveness, written by the engine thread, read by the watchdog (single floats: atomic).
        self._busy_since: float | None = None  # monotonic time of the last progress while busy
        self._recent_step_seconds: deque[float] = deque(maxlen=NUM_RECENT_STEPS)  # engine thread only
        self.slowest_recent_step_seconds = 0.0  # the longest of those steps

    # -- what the server asks of the engine -------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (thread-safe: routes tokenize on their own pool)."""
        return self._engine.tokenizer

    def compile_structured(self, params: StructuredOutputsParams) -> None:
        """Compile the constraint ``params`` on the calling thread (the grammar engine is
        thread-safe and caches it: the engine thread's own compile is then a hit). Raises
        InvalidRequestError naming the constraint's field when the grammar engine refuses it."""
        self._engine.structured.compile(params)

    def read_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """``lora``'s checkpoint read and checked on the calling thread (thread-safe, slow: off the
        event loop and the engine thread). Raises InvalidRequestError."""
        return self._engine.read_lora(lora)

    def lora_is_loaded(self, lora: LoRARequest) -> bool:
        """Whether a request on ``lora`` reads no checkpoint in the engine (else ``read_lora``
        first, off the engine thread, and hand the weights along)."""
        return self._engine.lora_is_loaded(lora)

    def lora_activity(self) -> tuple[int, list[str], list[str]]:
        """(max_loras, running requests' adapters, waiting requests' adapters); engine thread."""
        return self._engine.lora_activity()

    async def run_on_engine_thread(self, work: Callable[[LLMEngine], T]) -> T:
        """``work(engine)``'s result (or error), run on the engine thread between two steps (so
        quick work only: an adapter's registration, never its read)."""
        call = _Call(work)
        self._submit(call)
        result: T = await asyncio.wrap_future(call.done)
        return result

    def telemetry(self) -> Telemetry:
        """What the device reports now: utilisation, memory, temperature, power."""
        return self._engine.platform.telemetry()

    def counters(self) -> EngineCounters:
        """The engine's queue sizes and running totals (engine thread, or before ``start``)."""
        return self._engine.counters()

    def on_group_failure(self, handler: Callable[[BaseException], None]) -> None:
        """Have ``handler`` called (from another thread) when another rank dies or stops
        answering while the engine is idle; a single rank has none to watch."""
        if self._engine.group is not None:
            self._engine.group.set_failure_handler(handler)

    def warm_up(self) -> None:
        """Before ``start``, on the calling thread: one short greedy generation through every
        stage (prefill, decode, sampling)."""
        assert self._thread is None, "warm up before start()"
        engine = self._engine
        prompt_ids = engine.tokenizer.encode("Hello") or [0]
        engine.add_request(
            "warmup", prompt_ids, SamplingParams(max_tokens=WARMUP_MAX_TOKENS, temperature=0.0)
        )
        while engine.has_unfinished_requests():
            engine.step()

    # -- lifecycle (event loop) --------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, stats: StatsRecorder | None = None) -> None:
        """Start the engine thread; it feeds ``stats`` after each turn."""
        self._stats = stats
        self._loop = loop
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Stop the engine thread, then close the engine (its last KV events sent, its publisher's
        sockets and the other ranks closed). An engine thread still running after the timeout is
        stuck in a step: the engine is left as it is (the process is ending) and that is logged."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            if self._thread.is_alive():
                logger.warning(
                    "the engine thread did not stop within %s s; the engine is not closed", timeout_seconds
                )
                return
        self._engine.close()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def stalled_seconds(self, now: float | None = None) -> float:
        """How long the engine thread has been working without finishing a turn (0 when idle)."""
        busy_since = self._busy_since
        if busy_since is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - busy_since)

    def fail(self, error: BaseException) -> None:
        """From the event loop: declare the engine dead (it is stuck) and end every open stream
        with ``EngineDeadError``; later calls get it too. The engine thread stops if it returns."""
        dead = EngineDeadError(f"the engine has failed: {error}")
        with self._cond:
            if self._dead is not None:
                return
            self._dead = error
            for command in self._inbox:
                if not isinstance(command, list):
                    command.done.set_exception(dead)
            self._inbox = []
            self._cond.notify()
        self.cut_off(dead)

    def cut_off(self, error: BaseException) -> None:
        """From the event loop: end every open stream now with ``error`` (their readers raise it;
        closing them then aborts their requests), and every ``add`` the engine thread has not
        taken in yet (it will skip them)."""
        with self._cond:
            for command in self._inbox:
                if isinstance(command, _Add) and not command.done.done():
                    command.done.set_exception(error)
        for stream in list(self._streams):
            stream.put_error(error)

    async def wait_idle(self) -> None:
        """Return once no RequestStream is open (used to drain on shutdown)."""
        assert self._idle is not None, "start() first"
        await self._idle.wait()

    # -- requests (event loop) ---------------------------------------------------------------------
    def reserve(self, count: int, tenant: str | None) -> None:
        """Take ``count`` queue places for a group that ``add(..., reserved=True)`` will queue once
        it is prepared (tokenized), so a full queue is answered before that work. Raises as
        ``add`` does; ``release`` gives the places back when the group is never added."""
        self._admit(count, tenant)

    def release(self, count: int, tenant: str | None) -> None:
        with self._cond:
            self._num_pending -= count
            self._shares.released(tenant, count)

    async def add(self, requests: list[EngineRequest], *, reserved: bool = False) -> RequestStream:
        """Queue ``requests`` (one HTTP request's children) and return the stream of their outputs.

        Raises InvalidRequestError for a request the engine refuses (nothing of the group stays
        queued), QueueFullError when too many requests wait, EngineDeadError when the engine has
        failed. The caller must ``close()`` the stream; closing early aborts what is unfinished.
        ``reserved``: the group's places were taken by ``reserve``.
        """
        if not reserved:
            self._admit(len(requests), requests[0].tenant if requests else None)
        add = _Add(requests, asyncio.Queue())
        stream = RequestStream(add.queue, {r.request_id for r in requests}, self._closed)
        self._opened(stream)
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

    def _opened(self, stream: RequestStream) -> None:
        assert self._idle is not None, "start() first"  # streams come from add(), after start()
        self._streams.add(stream)
        self.num_active += 1
        self._idle.clear()

    def _closed(self, stream: RequestStream) -> None:
        if stream.remaining:
            self._submit(sorted(stream.remaining))
        self._streams.discard(stream)
        self.num_active -= 1
        if self.num_active == 0:
            assert self._idle is not None, "start() first"  # a stream was opened, after start()
            self._idle.set()

    def _admit(self, count: int, tenant: str | None = None) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead}")
        self._shares.check_fits(tenant, count)
        with self._cond:
            queued = self._num_waiting + self._num_pending
            if self.max_queue_len is not None and queued + count > self.max_queue_len:
                raise QueueFullError(
                    f"too many requests waiting ({queued}, limit {self.max_queue_len}); retry later"
                )
            self._shares.admit(tenant, count)
            self._num_pending += count

    def _submit(self, command: _Add | _Call | list[str]) -> None:
        with self._cond:
            if self._dead is not None:  # nobody will read the inbox again
                if not isinstance(command, list):
                    command.done.set_exception(EngineDeadError(f"the engine has failed: {self._dead}"))
                return
            self._inbox.append(command)
            self._cond.notify()

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stop or self._engine.has_unfinished_requests()):
                        self._busy_since = None
                        self._cond.wait()
                    if self._stop or self._dead is not None:  # dead: declared stuck by the watchdog
                        return
                    commands, self._inbox = self._inbox, []
                    if self._busy_since is None:
                        self._busy_since = time.monotonic()
                deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []
                aborted = [out for command in commands for out in self._apply(command)]
                outputs = self._timed_step() if self._engine.has_unfinished_requests() else []
                for output in outputs:
                    queue = self._queues.get(output.request_id)
                    if output.finished:
                        self._queues.pop(output.request_id, None)
                        self._shares.forget(output.request_id)
                    if queue is not None:
                        deliveries.append((queue, output))
                waiting_ids = self._engine.waiting_request_ids()
                waiting_by_tenant = self._shares.count_waiting(waiting_ids)
                with self._cond:
                    self._num_waiting = len(waiting_ids)
                    self._shares.set_waiting(waiting_by_tenant)
                if self._stats is not None:
                    self._stats.record(self._engine, outputs + aborted, ran_step=bool(outputs))
                self._deliver(deliveries)
        except BaseException as error:  # the engine cannot continue: fail every stream, then stop
            logger.exception("engine loop failed")
            dead = EngineDeadError(f"the engine has failed: {error}")
            with self._cond:
                self._dead = error
                for command in self._inbox:
                    if not isinstance(command, list):
                        command.done.set_exception(dead)
                self._inbox = []
            self._deliver([(queue, dead) for queue in self._queues.values()])
            if self._on_dead is not None and self._loop is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._on_dead, error)

    def _timed_step(self) -> list[RequestOutput]:
        """One engine step; records its duration and stamps progress for the watchdog."""
        began = time.monotonic()
        outputs = self._engine.step()
        now = time.monotonic()
        self._recent_step_seconds.append(now - began)
        self.slowest_recent_step_seconds = max(self._recent_step_seconds)
        self._busy_since = now
        return outputs

    def _apply(self, command: _Add | _Call | list[str]) -> list[RequestOutput]:
        """Apply one inbox command; returns the outputs of requests it aborted."""
        if isinstance(command, _Call):
            try:
                command.done.set_result(command.work(self._engine))
            except Exception as error:  # the caller's to answer (a refused adapter: 400)
                command.done.set_exception(error)
            return []
        if isinstance(command, list):
            aborted = [self._engine.abort_request(request_id) for request_id in command]
            for request_id in command:
                self._queues.pop(request_id, None)
                self._shares.forget(request_id)
            return [out for out in aborted if out is not None]
        with self._cond:
            # Taken in: they wait in the scheduler now, until the next step recounts the waiting.
            self._num_pending -= len(command.requests)
            self._num_waiting += len(command.requests)
            if command.requests:
                self._shares.taken_in(command.requests[0].tenant, len(command.requests))
            if command.done.done():  # cut off while it waited in the inbox
                return []
        added: list[str] = []
        try:
            for request in command.requests:
                self._engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.params,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    lora_request=request.lora_request,
                    lora_adapter=request.lora_adapter,
                    register_lora=False,  # a name unloaded since the route checked it is a 404
                )
                added.append(request.request_id)
                self._queues[request.request_id] = command.queue
                self._shares.track(request.request_id, request.tenant)
        except Exception as error:  # refused (InvalidRequestError): undo the group's earlier members
            for request_id in added:
                self._engine.abort_request(request_id)
                self._queues.pop(request_id, None)
                self._shares.forget(request_id)
            command.done.set_exception(error)
            return []
        if self._stats is not None:
            self._stats.expect(added)
        command.done.set_result(None)
        return []

    def _deliver(self, deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
        if not deliveries or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(put_all, deliveries)
