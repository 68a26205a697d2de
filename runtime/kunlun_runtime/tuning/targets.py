"""What a recommendation aims for, the error when nothing can meet it, and how reasons write numbers.

Shared by the recommender and the placement planner (which the recommender calls), so that
neither imports the other. Pure values and formatting only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun_runtime.errors import KunlunRuntimeError

MIB = 1 << 20


class TuningError(KunlunRuntimeError):
    """The measurements cannot support a configuration (nothing measured, or the model cannot fit)."""


@dataclass(frozen=True, slots=True)
class Targets:
    """What the recommendation aims for."""

    memory_fraction: float = 0.9
    decode_step_target_seconds: float = 0.1
    decode_slowdown_limit: float = 2.0
    prefill_knee_ratio: float = 0.9
    max_prefill_step_seconds: float = 0.5
    block_size_tolerance: float = 0.1
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    # The nodes a replica may span: cards per node (None: the cards counted here) and at most how
    # many nodes; the time one stage boundary adds to a decode step, where measured or assumed.
    cards_per_node: int | None = None
    max_nodes: int = 16
    stage_boundary_seconds: float | None = None


def size(num_bytes: float) -> str:
    """Bytes for people: ``1.50 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(num_bytes)} B"


def ms(seconds: float) -> str:
    """Seconds for people: ``12.5 ms``."""
    return f"{seconds * 1000:.1f} ms"
