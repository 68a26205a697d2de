"""The node taint `kunlun.dev/xpu-unhealthy:NoSchedule`: needed or not, and the taint list to write (pure).

Invariant: taints of others are kept as they are, in their order; only ours is added or removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kunlun_device.labels import UNHEALTHY_TAINT

TAINT_EFFECT = "NoSchedule"


def taint_needed(healthy: Iterable[bool]) -> bool:
    """True when the node has cards and none of them is healthy."""
    flags = list(healthy)
    return bool(flags) and not any(flags)


def has_taint(taints: Sequence[dict[str, Any]]) -> bool:
    return any(t.get("key") == UNHEALTHY_TAINT and t.get("effect") == TAINT_EFFECT for t in taints)


def build_taints(current: Sequence[dict[str, Any]], needed: bool) -> list[dict[str, Any]] | None:
    """The node's new `spec.taints`, or None when `current` is already right."""
    if has_taint(current) == needed:
        return None
    others = [t for t in current if not (t.get("key") == UNHEALTHY_TAINT and t.get("effect") == TAINT_EFFECT)]
    if needed:
        return [*others, {"key": UNHEALTHY_TAINT, "value": "true", "effect": TAINT_EFFECT}]
    return others
