"""The health states that `ListAndWatch` streams, with a version number that waiters block on.

Generic in the state type: the classic plugin publishes `HealthState`s, the DRA plugin its
three-valued device health (`kunlun_device.dra.health`).

Invariant: `version` increases exactly when the published states change; waiters wake on every
change and on `close()`.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

S = TypeVar("S")


class DeviceStates(Generic[S]):
    """Thread-safe map card index -> health state with change notification."""

    def __init__(self, states: dict[int, S]) -> None:
        self._states = dict(states)
        self._version = 0
        self._closed = False
        self._changed = threading.Condition()

    def snapshot(self) -> tuple[int, dict[int, S]]:
        """(version, states) as they are now."""
        with self._changed:
            return self._version, dict(self._states)

    def publish(self, states: dict[int, S]) -> bool:
        """Replace the states; True (and waiters woken) when anything changed."""
        with self._changed:
            if states == self._states:
                return False
            self._states = dict(states)
            self._version += 1
            self._changed.notify_all()
            return True

    def wait_newer(self, version: int, timeout_seconds: float) -> tuple[int, dict[int, S]] | None:
        """Block until the version differs from `version`; None on timeout or when closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != version or self._closed, timeout_seconds)
            if self._closed or self._version == version:
                return None
            return self._version, dict(self._states)

    @property
    def closed(self) -> bool:
        with self._changed:
            return self._closed

    def close(self) -> None:
        """Wake every waiter for good (the server is stopping)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
