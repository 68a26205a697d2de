"""``kunlun-runtime serve``: the OpenAI-compatible server on uvicorn, with a graceful SIGTERM.

The first SIGTERM (or Ctrl-C) drains: /health turns 503, new requests get 503, in-flight ones
finish for up to ``--shutdown-timeout`` seconds, then the server exits 0. A second signal exits at
once. uvicorn's own handler would re-raise the signal after shutting down (exit status 143), which
Kubernetes reports as a failure; this one does not. A model that fails to load exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from types import FrameType

import uvicorn

from kunlun_runtime.cli_args import Command, add_engine_args, engine_config_from_args
from kunlun_runtime.server.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_LEN = 256
_GRACE_AFTER_DRAIN_SECONDS = 2


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the lifecycle before stopping."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, shutdown_timeout_seconds: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout_seconds = shutdown_timeout_seconds
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        await self.lifecycle.drain(self.shutdown_timeout_seconds)
        self.should_exit = True

    def fail(self, error: BaseException) -> None:
        self.exit_code = 1
        self.should_exit = True


def _serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="most requests allowed to wait; more are answered 429 with Retry-After",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY, unset = open)",
    )
    group.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests"
    )
    group.add_argument("--uvicorn-log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    from kunlun_runtime.engine.llm_engine import LLMEngine
    from kunlun_runtime.platforms.cpu_features import cpu_capabilities
    from kunlun_runtime.server.app import create_app

    config = engine_config_from_args(args)
    if args.max_queue_len < 1:
        raise SystemExit("kunlun-runtime serve: error: --max-queue-len must be at least 1")
    lifecycle = Lifecycle(
        lambda: LLMEngine(config), max_queue_len=args.max_queue_len, freeze_gc_after_load=True
    )
    app = create_app(lambda: LLMEngine(config), api_key=args.api_key, lifecycle=lifecycle)
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=_GRACE_AFTER_DRAIN_SECONDS,
    )
    server = DrainingServer(uvicorn_config, lifecycle, args.shutdown_timeout)
    lifecycle.on_fatal = server.fail
    if config.device in ("auto", "cpu"):  # what every automatic CPU choice resolves against
        print(f"kunlun-runtime serve: {cpu_capabilities().summary()}", file=sys.stderr, flush=True)
    server.run()
    logging.getLogger(__name__).info("server stopped (exit %d)", server.exit_code)
    return server.exit_code


SERVE = Command(
    "serve",
    "serve the OpenAI-compatible HTTP API (and /health, /metrics)",
    _serve_args,
    run_serve,
)
