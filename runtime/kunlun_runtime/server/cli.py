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
from pathlib import Path
from types import FrameType

import uvicorn

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.flags import Command, add_engine_args, engine_config_from_args
from kunlun_runtime.options.lora import add_lora_serve_args, lora_serve_options
from kunlun_runtime.server.auth import build_tenants
from kunlun_runtime.server.door import DEFAULT_MAX_REQUEST_BODY_BYTES
from kunlun_runtime.server.fair_share import DEFAULT_MAX_WAITING_SHARE
from kunlun_runtime.server.lifecycle import Lifecycle
from kunlun_runtime.server.served_model import DEFAULT_MAX_PROMPT_CHARS
from kunlun_runtime.server.tool_calls import validate_tool_flags
from kunlun_runtime.server.tool_parsers import TOOL_CALL_PARSERS
from kunlun_runtime.server.watchdog import (
    DEFAULT_ENGINE_STALL_GRACE_SECONDS,
    DEFAULT_ENGINE_STALL_TIMEOUT_SECONDS,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_LEN = 256
# Loggers whose INFO lines a server always shows, whatever --log-level (default WARNING): the
# engine's start line (backend, tier, dtypes, KV capacity), the progress of a first start compiling
# our CPU kernels, and a leader's wait for its nodes (the last two may take minutes).
ANNOUNCING_LOGGERS = (
    "kunlun_runtime.layers.runtime_info",
    "kunlun_runtime.layers.kernel_build",
    "kunlun_runtime.parallel.group",
)
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
        "--api-keys-file",
        type=Path,
        default=os.environ.get("KUNLUN_API_KEYS_FILE"),
        help="YAML mapping 'tenant: key', one API key per tenant; tenants share no prefix cache "
        "(default: $KUNLUN_API_KEYS_FILE)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are answered 413 (default: 4 MiB)",
    )
    group.add_argument(
        "--max-waiting-share",
        type=float,
        default=DEFAULT_MAX_WAITING_SHARE,
        help="with several tenants, the most of --max-queue-len one tenant may hold; more get 429",
    )
    group.add_argument(
        "--metrics-token",
        default=os.environ.get("KUNLUN_METRICS_TOKEN"),
        help="require 'Authorization: Bearer TOKEN' on /metrics (default: $KUNLUN_METRICS_TOKEN, unset = open)",
    )
    group.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests"
    )
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="longest prompt (or sum of chat messages) in characters, checked before tokenizing; "
        "longer is answered 400",
    )
    group.add_argument(
        "--engine-stall-timeout-seconds",
        type=float,
        default=DEFAULT_ENGINE_STALL_TIMEOUT_SECONDS,
        help="with requests pending and no engine step finished for this long (or 10x the slowest "
        "recent step, if longer), /health turns 503 and open requests fail",
    )
    group.add_argument(
        "--engine-stall-grace-seconds",
        type=float,
        default=DEFAULT_ENGINE_STALL_GRACE_SECONDS,
        help="after a stall is detected, seconds until the process exits 1 to be restarted",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help="how tool calls are read from the model's output for tool_choice 'auto' (the model "
        "family: hermes for Qwen2.5/3 and Hermes, llama3_json for Llama 3.1/3.2, smollm2)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice 'auto' (the default when a request has tools); needs --tool-call-parser",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache",
    )
    add_lora_serve_args(group)
    group.add_argument("--uvicorn-log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    from kunlun_runtime.engine.llm_engine import LLMEngine
    from kunlun_runtime.platforms.cpu_features import cpu_capabilities
    from kunlun_runtime.server.app import create_app

    config = engine_config_from_args(args)
    if config.node_rank != 0:  # a node after the first follows the leader and serves nothing
        from kunlun_runtime.parallel.rank_plan import serve_worker_node

        logger = logging.getLogger("kunlun_runtime")  # its start, stop and failure, whatever --log-level
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        code = serve_worker_node(config)
        if code != 0:  # a failed group: torch.distributed's teardown can block on a dead peer
            logging.shutdown()
            os._exit(code)
        return code
    if args.max_queue_len < 1:
        raise SystemExit("kunlun-runtime serve: error: --max-queue-len must be at least 1")
    if args.max_request_body_bytes < 1:
        raise SystemExit("kunlun-runtime serve: error: --max-request-body-bytes must be at least 1")
    if args.max_prompt_chars < 1:
        raise SystemExit("kunlun-runtime serve: error: --max-prompt-chars must be at least 1")
    if args.engine_stall_timeout_seconds <= 0 or args.engine_stall_grace_seconds < 0:
        raise SystemExit(
            "kunlun-runtime serve: error: --engine-stall-timeout-seconds must be positive and "
            "--engine-stall-grace-seconds not negative"
        )
    try:
        validate_tool_flags(args.tool_call_parser, args.enable_auto_tool_choice)
        tenants = build_tenants(args.api_key, args.api_keys_file)
        max_waiting_share = tenants.queue_share(args.max_waiting_share)
        lora = lora_serve_options(args, config, os.environ)
    except ConfigError as error:
        raise SystemExit(f"kunlun-runtime serve: error: {error}") from error
    lifecycle = Lifecycle(
        lambda: LLMEngine(config),
        max_queue_len=args.max_queue_len,
        max_waiting_share=max_waiting_share,
        freeze_gc_after_load=True,
        max_prompt_chars=args.max_prompt_chars,
        engine_stall_timeout_seconds=args.engine_stall_timeout_seconds,
        engine_stall_grace_seconds=args.engine_stall_grace_seconds,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        lora_modules=lora.modules,
    )
    app = create_app(
        lambda: LLMEngine(config),
        tenants=tenants,
        max_request_body_bytes=args.max_request_body_bytes,
        metrics_token=args.metrics_token,
        lifecycle=lifecycle,
        allow_runtime_lora_updating=lora.allow_runtime_updating,
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=_GRACE_AFTER_DRAIN_SECONDS,
    )
    server = DrainingServer(uvicorn_config, lifecycle, args.shutdown_timeout)
    lifecycle.on_fatal = server.fail
    for name in ANNOUNCING_LOGGERS:
        announcer = logging.getLogger(name)
        announcer.setLevel(min(announcer.getEffectiveLevel(), logging.INFO))
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
