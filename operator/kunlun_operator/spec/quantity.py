"""Quantities written as text in a custom resource, parsed once into numbers with their unit.

Owns: memory quantities (``20Gi`` → bytes), parameter counts (``7B`` → parameters) and durations
(``2m30s`` → seconds), in the forms the CRD's patterns admit. Must not know where a quantity sits
in the spec: the caller passes the field's path. Invariant: every ``SpecError`` names that field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal

from kunlun_operator.errors import SpecError

#: A memory quantity as the CRD admits it (``spec.runtime.kvCacheMemory``): a plain or decimal
#: number of bytes, with an optional binary or decimal suffix.
QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
#: Bytes per suffix of a memory quantity.
BYTES_PER_UNIT: Mapping[str, int] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}
_PARAMETERS = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([MB])$")
_DURATION = re.compile(r"^(?=[0-9])(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?$")  # 1h, 2m30s, 45s


def parse_bytes(text: object, field: str) -> int:
    """A memory quantity in bytes: ``"20Gi"`` → 21474836480, ``"1.5Gi"`` → 1610612736,
    ``"500M"`` → 500000000, ``"1024"`` → 1024.

    Args:
        text: the quantity as written (a string; anything else is an error).
        field: the path of the field it was read from (``spec.runtime.kvCacheMemory``).

    Raises:
        SpecError: ``text`` is not such a quantity, or not a positive whole number of bytes
            (``"1.5"``, ``"0"``); ``field`` names it.
    """
    match = QUANTITY.match(text) if isinstance(text, str) else None
    if match is None:
        raise SpecError(field, f"must be a quantity like '20Gi', got {text!r}")
    number, unit = match.groups()
    size = Decimal(number) * (BYTES_PER_UNIT[unit] if unit else 1)  # exact: no float rounding
    if size != size.to_integral_value() or size <= 0:
        raise SpecError(field, f"must be a positive whole number of bytes, got {text!r}")
    return int(size)


def parse_parameters(text: str, field: str) -> int:
    """A parameter count: ``"7B"`` → 7_000_000_000; ``"135M"`` → 135_000_000.

    Raises:
        SpecError: ``text`` is not such a count; ``field`` names it.
    """
    match = _PARAMETERS.match(text)
    if not match:
        raise SpecError(field, f"{text!r} must look like '7B' or '135M'")
    return int(float(match.group(1)) * (1e9 if match.group(2) == "B" else 1e6))


def parse_duration_seconds(text: str, field: str) -> int:
    """``"2m30s"`` → 150; hours, minutes and seconds in that order, each at most once.

    Raises:
        SpecError: ``text`` is not such a duration; ``field`` names it.
    """
    match = _DURATION.match(text)
    if not match:
        raise SpecError(field, f"{text!r} must be a duration like '30s', '2m' or '1m30s'")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds
