"""The server's life: loading → ready → draining, and what /health answers in each state.

The HTTP server starts at once and answers /health with 503 while the model loads in a background
thread and one warm-up generation passes; then 200. While loading, the 503s say what is under way
when it is more than the model: a first start compiling our CPU kernels says which tier, that it
happens once, and how far it got (``not_ready_message``). On SIGTERM the server drains: /health and new
API requests get 503, in-flight requests run to completion for up to ``shutdown_timeout_seconds``;
whatever is still open then is cut off cleanly (a stream ends with an error event and
``data: [DONE]``, a non-streaming request gets a JSON 503), then the engine thread stops. A model
that fails to load, or an engine loop that fails, is fatal (``on_fatal``: the CLI exits 1 so
Kubernetes restarts the pod), not a server that stays up answering 503 forever. So is an engine
that stops making progress (``watchdog``): /health turns 503 and open requests fail at once, and
``on_fatal`` follows ``engine_stall_grace_seconds`` later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import gc
import logging
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers.kernel_build import current_build
from kunlun_runtime.layers.runtime_info import RuntimeInfo
from kunlun_runtime.options.lora import LoRAModule
from kunlun_runtime.server.async_engine import AsyncEngine
from kunlun_runtime.server.errors import unavailable
from kunlun_runtime.server.lora_metrics import LoRARequestsInfo
from kunlun_runtime.server.lora_routes import load_startup_adapters
from kunlun_runtime.server.metrics import EngineMetrics, build_metrics
from kunlun_runtime.server.served_model import DEFAULT_MAX_PROMPT_CHARS, ServedModel
from kunlun_runtime.server.spec_metrics import SpecDecodeMetrics
from kunlun_runtime.server.stats import StatsRecorder
from kunlun_runtime.server.tool_calls import validate_tool_flags
from kunlun_runtime.server.watchdog import (
    DEFAULT_ENGINE_STALL_GRACE_SECONDS,
    DEFAULT_ENGINE_STALL_TIMEOUT_SECONDS,
    EngineStalledError,
    watch_engine,
)

logger = logging.getLogger(__name__)

CUT_OFF_FLUSH_SECONDS = 2.0  # after the drain timeout, time for the cut-off answers to be sent


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


def _settle_heap() -> None:
    """Collect the garbage of loading, then exempt everything still alive (the model, the engine,
    the imported libraries: ~3 * 10^5 objects) from later cyclic collections. Otherwise the
    first full collection falls on the first requests: it walks every one of those objects while
    holding the GIL, the engine thread waits, and the first requests' TTFT pays for it. Only for a
    process that serves and nothing else: a frozen object that later becomes cyclic garbage is
    never freed."""
    gc.collect()
    gc.freeze()


class Lifecycle:
    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        *,
        max_queue_len: int | None = None,
        max_waiting_share: float | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        freeze_gc_after_load: bool = False,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        engine_stall_timeout_seconds: float = DEFAULT_ENGINE_STALL_TIMEOUT_SECONDS,
        engine_stall_grace_seconds: float = DEFAULT_ENGINE_STALL_GRACE_SECONDS,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        enable_prompt_tokens_details: bool = False,
        lora_modules: tuple[LoRAModule, ...] = (),
    ) -> None:
        validate_tool_flags(tool_call_parser, enable_auto_tool_choice)
        self._factory = engine_factory
        self.max_queue_len = max_queue_len
        self.max_waiting_share = max_waiting_share  # a tenant's share of the queue; None = no limit
        self.on_fatal = on_fatal
        # For a process that is the server and nothing else (the CLI): see `_settle_heap`.
        self.freeze_gc_after_load = freeze_gc_after_load
        self.max_prompt_chars = max_prompt_chars
        self.engine_stall_timeout_seconds = engine_stall_timeout_seconds
        self.engine_stall_grace_seconds = engine_stall_grace_seconds
        self.tool_call_parser = tool_call_parser  # --tool-call-parser: reads tool_choice "auto" output
        self.enable_auto_tool_choice = enable_auto_tool_choice  # --enable-auto-tool-choice
        self.enable_prompt_tokens_details = enable_prompt_tokens_details  # usage.prompt_tokens_details
        self.lora_modules = lora_modules  # --lora-modules: read and served before the server is ready
        self._watchdog: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.state = ServerState.LOADING
        self.served: ServedModel | None = None
        self.runtime_info: RuntimeInfo | None = None  # what the engine runs with (/version), once loaded
        self.metrics: EngineMetrics | None = None
        self.error: BaseException | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()

        def build() -> None:
            try:
                async_engine = AsyncEngine(
                    self._factory(),
                    max_queue_len=self.max_queue_len,
                    max_waiting_share=self.max_waiting_share,
                    on_dead=self._engine_died,
                )
                async_engine.warm_up()
                if self.freeze_gc_after_load:
                    _settle_heap()
                done.set_result(async_engine)
            except BaseException as error:  # reported to the event loop below
                done.set_exception(error)

        threading.Thread(target=build, name="model-loader", daemon=True).start()
        try:
            async_engine: AsyncEngine = await asyncio.wrap_future(done)
        except Exception as error:
            self._load_failed(error)
            return
        facts = async_engine.facts
        self.metrics = build_metrics(
            self.registry, facts.served_model_name, max_model_len=facts.max_model_len
        )
        self.metrics.set_cache_config(facts.cache_config)
        self.runtime_info = facts.runtime_info
        self.metrics.set_runtime_info(**facts.runtime_info.labels())
        lora_info = None
        if facts.enable_lora:
            lora_info = LoRARequestsInfo(self.registry, async_engine.lora_activity()[0])
        spec_metrics = None
        if async_engine.counters().spec_decode is not None:
            spec_metrics = SpecDecodeMetrics(self.registry, facts.served_model_name)
        stats = StatsRecorder(self.metrics, async_engine, lora_info, spec_metrics)
        stats.record(async_engine, [], ran_step=False)  # publish the idle gauges before the first request
        loop = asyncio.get_running_loop()
        async_engine.start(loop, stats)

        def group_failed(error: BaseException) -> None:  # a rank stopped answering while idle
            loop.call_soon_threadsafe(self._group_failed, error)

        async_engine.on_group_failure(group_failed)
        self.served = ServedModel.of(async_engine, max_prompt_chars=self.max_prompt_chars)
        self.served.tool_call_parser = self.tool_call_parser
        self.served.enable_auto_tool_choice = self.enable_auto_tool_choice
        self.served.enable_prompt_tokens_details = self.enable_prompt_tokens_details
        try:
            await load_startup_adapters(self.served, self.lora_modules)
        except ConfigError as error:  # a --lora-modules adapter that cannot be served
            self._load_failed(error)
            return
        self._watchdog = asyncio.ensure_future(
            watch_engine(async_engine, self.engine_stall_timeout_seconds, self._engine_stalled)
        )
        if self.state is ServerState.LOADING:
            self.state = ServerState.READY
        logger.info("ready: serving %s", facts.served_model_name)

    def _load_failed(self, error: BaseException) -> None:
        logger.error("model failed to load: %s", error)
        self.state, self.error = ServerState.FAILED, error
        if self.on_fatal is not None:
            self.on_fatal(error)

    def not_ready_message(self) -> str:
        """Why the server cannot serve now (the 503s of /health and the API): shutting down,
        failed, or loading, and then what the load is doing when it is more than the model."""
        if self.state is ServerState.DRAINING:
            return "the server is shutting down"
        if self.state is ServerState.FAILED:
            return "the engine has failed; the server is restarting"
        build = current_build()
        if build is not None:
            return f"the model is loading: first {build.describe()}"
        return "the model is loading"

    def _engine_died(self, error: BaseException) -> None:
        """The engine loop failed: not ready any more, and the process should be restarted."""
        logger.error("engine failed: %s", error)
        self.state, self.error = ServerState.FAILED, error
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _group_failed(self, error: BaseException) -> None:
        """Another rank died or stopped answering while idle: as when the engine loop fails."""
        logger.error("parallel group failed: %s", error)
        self.state, self.error = ServerState.FAILED, error
        if self.served is not None:
            self.served.engine.fail(error)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _engine_stalled(self, error: EngineStalledError) -> None:
        """No step finished within the bound: unhealthy now, every open request fails now (as
        when the engine loop fails), and the process ends after the grace period."""
        self.state, self.error = ServerState.FAILED, error
        if self.served is not None:
            self.served.engine.fail(error)
        if self.on_fatal is not None:
            on_fatal = self.on_fatal
            asyncio.get_running_loop().call_later(self.engine_stall_grace_seconds, on_fatal, error)

    def update_telemetry(self) -> None:
        if self.metrics is not None and self.served is not None:
            self.metrics.set_telemetry(self.served.engine.telemetry())

    async def drain(self, timeout_seconds: float) -> None:
        """Refuse new requests and wait (up to the timeout) for in-flight ones to finish."""
        self.state = ServerState.DRAINING
        if self.served is None:
            return
        logger.info("draining: %d request(s) in flight", self.served.engine.num_active)
        engine = self.served.engine
        try:
            await asyncio.wait_for(engine.wait_idle(), timeout_seconds)
        except TimeoutError:
            logger.warning("shutdown timeout: cutting off %d request(s) still in flight", engine.num_active)
            engine.cut_off(
                unavailable(
                    f"the server is shutting down; the request did not finish within {timeout_seconds} s"
                )
            )
            try:
                await asyncio.wait_for(engine.wait_idle(), CUT_OFF_FLUSH_SECONDS)
            except TimeoutError:
                logger.warning("%d request(s) still open after the cut-off", engine.num_active)

    async def stop(self) -> None:
        for task in (self._task, self._watchdog):
            if task is not None and not task.done():
                task.cancel()
        if self.served is not None:
            self.served.close()
            # A stalled engine thread may never return: do not wait long for it.
            timeout_seconds = 1.0 if self.served.engine.is_dead else 10.0
            await asyncio.to_thread(self.served.engine.shutdown, timeout_seconds)
