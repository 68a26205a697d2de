"""Polling with a deadline: how a test waits for something that happens in the background.

Tests never sleep for a fixed time and hope; they poll a predicate until it returns something truthy
(which they get back) or the deadline passes, and then fail naming what they waited for and the last
value seen.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic, sleep
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    *,
    timeout_seconds: float,
    message: str,
    interval_seconds: float = 0.05,
    ignoring: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``predicate`` every ``interval_seconds`` until it returns a truthy value; return that value.

    The predicate is called at least once, and a last time at the deadline (the sleep before it is
    cut short). An exception of a type in ``ignoring`` counts as "not yet" and is the last value seen;
    any other exception propagates at once. At the deadline, raise ``AssertionError`` naming what
    was awaited (``message``, e.g. "the Deployment") and the last value seen.
    """
    deadline = monotonic() + timeout_seconds
    while True:
        try:
            value = predicate()
        except ignoring as exc:
            last: object = exc
        else:
            if value:
                return value
            last = value
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise AssertionError(
                f"timed out after {timeout_seconds}s waiting for {message}; last seen: {last!r}"
            )
        sleep(min(interval_seconds, remaining))
