"""A worker node reaching the leader's rendezvous port: real loopback sockets, virtual time.

A port bound but not listening refuses connections (and no other process can take it); the
clock advances only by the waits between attempts, so the attempt and log counts are exact.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator

import pytest

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.parallel.rendezvous import wait_for_leader


@pytest.fixture
def refusing_port() -> Iterator[socket.socket]:
    """A loopback port that refuses connections until the test calls ``listen()`` on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


class VirtualTime:
    def __init__(self, on_pause: Callable[[int], None] = lambda count: None) -> None:
        self.now = 0.0
        self.pauses = 0
        self._on_pause = on_pause

    def clock(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.pauses += 1
        self._on_pause(self.pauses)
        self.now += seconds


def test_a_listening_leader_is_reached_at_the_first_attempt_without_a_warning(refusing_port, caplog) -> None:
    refusing_port.listen()
    time = VirtualTime()
    port = refusing_port.getsockname()[1]
    with caplog.at_level(logging.INFO, logger="kunlun_runtime.parallel.rendezvous"):
        attempts = wait_for_leader("127.0.0.1", port, 10.0, node_rank=1, clock=time.clock, pause=time.pause)
    assert (attempts, time.pauses, caplog.records) == (1, 0, [])


def test_a_leader_that_starts_listening_late_is_reached_and_the_wait_is_logged(refusing_port, caplog) -> None:
    time = VirtualTime(on_pause=lambda count: refusing_port.listen() if count == 3 else None)
    port = refusing_port.getsockname()[1]
    with caplog.at_level(logging.INFO, logger="kunlun_runtime.parallel.rendezvous"):
        attempts = wait_for_leader("127.0.0.1", port, 10.0, node_rank=1, clock=time.clock, pause=time.pause)
    assert attempts == 4
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith(
        f"node 1: cannot reach the leader at 127.0.0.1:{port} yet (attempt 1, 0 of 10 s): "
    )
    assert "refused" in messages[0]
    assert messages[1:] == [f"node 1: reached the leader at 127.0.0.1:{port} after 4 attempts (1.5 s)"]


def test_an_unreachable_leader_is_logged_every_few_seconds_and_fails_after_the_timeout(
    refusing_port, caplog
) -> None:
    time = VirtualTime()
    port = refusing_port.getsockname()[1]
    with (
        caplog.at_level(logging.INFO, logger="kunlun_runtime.parallel.rendezvous"),
        pytest.raises(EngineDeadError) as failure,
    ):
        wait_for_leader("127.0.0.1", port, 12.0, node_rank=2, clock=time.clock, pause=time.pause)
    # an attempt every 0.5 s from 0 to 12 s; a warning at 0, 5 and 10 s
    assert time.pauses == 24
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert [w.split(": ", 1)[1].split("):")[0] for w in warnings] == [
        f"cannot reach the leader at 127.0.0.1:{port} yet (attempt {n}, {s} of 12 s"
        for n, s in ((1, 0), (11, 5), (21, 10))
    ]
    message = str(failure.value)
    assert message.startswith(
        f"parallel group: node 2 could not reach the leader at 127.0.0.1:{port} within 12 s (25 attempts; last: "
    )
    for named in ("--master-addr", "--master-port", "LWS_LEADER_ADDRESS", "--distributed-timeout"):
        assert named in message


def test_a_leader_name_that_does_not_resolve_is_retried_and_named(caplog) -> None:
    time = VirtualTime()
    with (
        caplog.at_level(logging.WARNING, logger="kunlun_runtime.parallel.rendezvous"),
        pytest.raises(EngineDeadError, match=r"leader at no-such-leader\.invalid:29500 within 1 s"),
    ):
        wait_for_leader("no-such-leader.invalid", 29500, 1.0, node_rank=1, clock=time.clock, pause=time.pause)
    assert time.pauses == 2
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(
            "node 1: cannot reach the leader at no-such-leader.invalid:29500 yet (attempt 1, 0 of 1 s): "
        )
    )
