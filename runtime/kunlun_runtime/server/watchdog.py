"""The engine-progress watchdog: a stuck engine step turns the server unhealthy, then ends it.

``/health`` answers from the event loop, so an engine thread stuck inside a step (a hung device
call, a deadlocked collective) would leave the pod "healthy" while no request ever finishes. The
watchdog polls ``AsyncEngine.stalled_seconds``: busy without finishing a step for longer than
``stall_bound_seconds`` (the configured floor, or ``STALL_STEP_FACTOR`` times the slowest recent
step when that is longer, so a slow but moving engine is never declared stuck) means stalled.
It only watches: what a stall does (fail the streams, turn /health 503, exit after a grace
period) is the lifecycle's ``on_stall``. It cannot help when the stuck code holds the GIL; then
/health stops answering at all and the liveness probe's timeout catches it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kunlun_runtime.errors import KunlunRuntimeError
from kunlun_runtime.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_STALL_TIMEOUT_SECONDS = 60.0
DEFAULT_ENGINE_STALL_GRACE_SECONDS = 5.0
STALL_STEP_FACTOR = 10.0  # a step this many times slower than the slowest recent one is stuck
MAX_POLL_INTERVAL_SECONDS = 1.0


class EngineStalledError(KunlunRuntimeError):
    """No engine step finished within the stall bound while work was pending."""


def stall_bound_seconds(timeout_seconds: float, slowest_recent_step_seconds: float) -> float:
    """How long the engine may be busy without finishing a step before it counts as stalled."""
    return max(timeout_seconds, STALL_STEP_FACTOR * slowest_recent_step_seconds)


async def watch_engine(
    engine: AsyncEngine, timeout_seconds: float, on_stall: Callable[[EngineStalledError], None]
) -> None:
    """Poll ``engine`` until it stalls (then call ``on_stall`` once and return) or dies."""
    interval_seconds = min(MAX_POLL_INTERVAL_SECONDS, timeout_seconds / 4)
    while not engine.is_dead:
        await asyncio.sleep(interval_seconds)
        bound = stall_bound_seconds(timeout_seconds, engine.slowest_recent_step_seconds)
        stalled = engine.stalled_seconds()
        if stalled > bound:
            error = EngineStalledError(
                f"no engine step finished for {stalled:.1f} s while requests were pending "
                f"(bound {bound:.1f} s, --engine-stall-timeout-seconds)"
            )
            logger.error("engine stalled: %s", error)
            on_stall(error)
            return
