"""Reaching the leader's rendezvous port before a worker node joins the group.

torch.distributed's TCP rendezvous retries a refused or unresolvable leader in silence until
its timeout (the 30-minute startup timeout here), so a worker pointed at the wrong address, or
at a leader that never came up, would wait half an hour without a word. A worker node therefore
first opens plain TCP connections to the leader's port (``wait_for_leader``): it logs its
failed attempts with the address every few seconds and gives up after ``--leader-wait-timeout``
(by default ``--distributed-timeout``)with an error naming the address and the flags that set it.

It only connects and closes; it never speaks the store's protocol. Reaching the port says the
leader is up, not that the group will form: joining then waits for every node (startup timeout).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from kunlun_runtime.errors import EngineDeadError

logger = logging.getLogger(__name__)
RETRY_SECONDS = 0.5  # between connection attempts
LOG_EVERY_SECONDS = 5.0  # a failed attempt is logged at most this often (the first at once)
CONNECT_TIMEOUT_SECONDS = 2.0  # one attempt (a dropped SYN, a slow DNS answer)


def try_connect(host: str, port: int, timeout_seconds: float) -> str | None:
    """Open and close one TCP connection to ``host:port``; returns why it failed, or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            return None
    except OSError as error:  # refused, unreachable, timed out, name not resolved
        return str(error) or type(error).__name__


def wait_for_leader(
    host: str,
    port: int,
    timeout_seconds: float,
    *,
    node_rank: int,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> int:
    """Retry a TCP connection to the leader at ``host:port`` until one succeeds or
    ``timeout_seconds`` have passed; returns the number of attempts.

    ``clock`` and ``pause`` are the time source and the wait between attempts.

    Raises:
        EngineDeadError: the leader was not reached in time, naming the address, the attempts,
            the last error and the flags that set the address.
    """
    started = clock()
    deadline = started + timeout_seconds
    attempts = 0
    logged_at: float | None = None
    while True:
        attempts += 1
        error = try_connect(host, port, max(0.1, min(CONNECT_TIMEOUT_SECONDS, deadline - clock())))
        now = clock()
        if error is None:
            if attempts > 1:
                logger.info(
                    "node %d: reached the leader at %s:%d after %d attempts (%.1f s)",
                    node_rank,
                    host,
                    port,
                    attempts,
                    now - started,
                )
            return attempts
        if now >= deadline:
            raise EngineDeadError(
                f"parallel group: node {node_rank} could not reach the leader at {host}:{port} within "
                f"{timeout_seconds:g} s ({attempts} attempts; last: {error}): check --master-addr and "
                "--master-port (under LeaderWorkerSet: LWS_LEADER_ADDRESS), that the leader (node 0) is "
                f"running, and that port {port} is open between the nodes; --leader-wait-timeout "
                "(default: --distributed-timeout) sets how long a worker waits"
            )
        if logged_at is None or now - logged_at >= LOG_EVERY_SECONDS:
            logger.warning(
                "node %d: cannot reach the leader at %s:%d yet (attempt %d, %.0f of %g s): %s",
                node_rank,
                host,
                port,
                attempts,
                now - started,
                timeout_seconds,
                error,
            )
            logged_at = now
        pause(min(RETRY_SECONDS, deadline - now))
