"""A time budget split into phases, on an injectable clock (tests use a fake one, never sleep).

Each sweep predicts the cost of its next point from the last one and asks ``allows()`` first;
the first point of a sweep always runs (a recommendation needs at least one), so a run ends
within the budget unless those minimal points alone take longer.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Budget:
    """``total_seconds`` from creation; ``phase(share)`` gives a phase that share of what is left."""

    def __init__(self, total_seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        if total_seconds <= 0:
            raise ValueError(f"budget must be positive, got {total_seconds}")
        self.clock = clock
        self.start = clock()
        self.deadline = self.start + total_seconds
        self.phase_deadline = self.deadline

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def phase(self, share: float) -> None:
        """Start a phase that may use ``share`` (0..1] of the time still left."""
        now = self.clock()
        self.phase_deadline = now + share * max(0.0, self.deadline - now)

    def allows(self, predicted_seconds: float) -> bool:
        """Whether work predicted to take this long ends before the current phase does."""
        return self.clock() + predicted_seconds <= self.phase_deadline
