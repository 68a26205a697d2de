"""The Node annotation `kunlun.dev/xpu-failures`: each card's recent failure times, versioned.

Format (version 1), compact JSON with sorted keys and no spaces::

    {"failures":{"GPU-7c1f…":[1764558000.123,1764558123.456]},"version":1}

`failures` maps a card UUID to its failure times within the quarantine window, in Unix seconds
(milliseconds kept), oldest first. The node agent owns the annotation: it writes it whenever it
counts a failure, and a restarted agent reads it back, so a card that failed twice before a restart
and once after is quarantined (with `--quarantine-failures 3`). Removing the annotation resets
every count.

Invariant: pure; `parse_failures` accepts exactly what `format_failures` writes (up to the number
of times per card) and raises `FaultStateError` naming the field for anything else — never another
exception, so a hand-edited value can never crash the agent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from kunlun_device.errors import FaultStateError
from kunlun_device.faults.quarantine import UUID_PATTERN, History
from kunlun_device.labels import FAILURES_ANNOTATION

VERSION = 1
MAX_TIMES_PER_CARD = 64  # far above any sane --quarantine-failures: more is not ours


def format_failures(history: Mapping[str, tuple[float, ...]]) -> str | None:
    """The annotation value for `history`; None (remove the annotation) when no card has failures."""
    failures = {uuid: [round(t, 3) for t in times] for uuid, times in sorted(history.items()) if times}
    if not failures:
        return None
    return json.dumps({"failures": failures, "version": VERSION}, separators=(",", ":"), sort_keys=True)


def parse_failures(value: str | None, source: str = FAILURES_ANNOTATION) -> History:
    """The history in an annotation value (None: no annotation, no failures).

    Raises:
        FaultStateError: not JSON, another version, or a field of the wrong shape (named).
    """
    if value is None:
        return {}
    try:
        data = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise FaultStateError(source, f"not JSON ({exc})") from None
    return parse_history_document(data, source)


def parse_history_document(data: Any, source: str) -> History:
    """The history in a decoded version-1 document (also embedded in the plugin's state file).

    Raises:
        FaultStateError: as `parse_failures`.
    """
    if not isinstance(data, dict):
        raise FaultStateError(source, "not a JSON object")
    if data.get("version") != VERSION:
        raise FaultStateError(source, f"version is {data.get('version')!r}, expected {VERSION}")
    if set(data) != {"version", "failures"}:
        raise FaultStateError(source, f"fields {sorted(data)}, expected ['failures', 'version']")
    return parse_history(data["failures"], source, "failures")


def parse_history(failures: Any, source: str, field: str) -> History:
    """A `{uuid: [seconds, ...]}` object (field `field` of `source`), validated.

    Raises:
        FaultStateError: naming the field and the card.
    """
    if not isinstance(failures, dict):
        raise FaultStateError(source, f"{field} is not an object")
    history: History = {}
    for uuid, times in failures.items():
        if not UUID_PATTERN.fullmatch(uuid):
            raise FaultStateError(source, f"{field}: {uuid!r} is not a card UUID")
        if not isinstance(times, list) or len(times) > MAX_TIMES_PER_CARD:
            raise FaultStateError(
                source, f"{field}.{uuid}: expected a list of at most {MAX_TIMES_PER_CARD} times"
            )
        for t in times:
            if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
                raise FaultStateError(source, f"{field}.{uuid}: {t!r} is not a time in Unix seconds")
        history[uuid] = tuple(sorted(float(t) for t in times))
    return history
