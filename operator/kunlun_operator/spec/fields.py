"""Typed readers of custom-resource fields; every error they raise names the field's path.

Owns: the small checks every field needs (type, bounds, enum, pattern). Used by ``spec`` only.
A reader given a ``default`` returns it for an absent or null field (the API server prunes nulls
before it applies the CRD's defaults), so its result is never None.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, overload

from kunlun_operator.errors import SpecError

#: A string type with a fixed set of values (a ``Literal``), as read by ``read_choice``.
Choice = TypeVar("Choice", bound=str)


def read_obj(data: Mapping[str, Any], key: str, path: str, *, required: bool = False) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        if required:
            raise SpecError(f"{path}.{key}", "is required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key}", f"must be an object, got {type(value).__name__}")
    return value


@overload
def read_str(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    required: Literal[True],
    pattern: re.Pattern[str] | None = None,
) -> str: ...
@overload
def read_str(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    required: bool = False,
    pattern: re.Pattern[str] | None = None,
    default: str,
) -> str: ...
@overload
def read_str(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    required: bool = False,
    pattern: re.Pattern[str] | None = None,
    default: None = None,
) -> str | None: ...
def read_str(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    required: bool = False,
    pattern: re.Pattern[str] | None = None,
    default: str | None = None,
) -> str | None:
    """The string at ``key``; None when absent and neither ``required`` nor ``default`` is given.

    Raises:
        SpecError: absent but ``required``; not a string (or empty but ``required``); no match
            for ``pattern``.
    """
    value = _value(data, key, default)
    field = f"{path}.{key}"
    if value is None:
        if required:
            raise SpecError(field, "is required")
        return None
    if not isinstance(value, str) or (required and not value):
        raise SpecError(field, f"must be a non-empty string, got {value!r}")
    if pattern is not None and not pattern.match(value):
        raise SpecError(field, f"{value!r} does not match {pattern.pattern}")
    return value


@overload
def read_choice(
    data: Mapping[str, Any], key: str, path: str, choices: tuple[Choice, ...], default: Choice
) -> Choice: ...
@overload
def read_choice(
    data: Mapping[str, Any], key: str, path: str, choices: tuple[Choice, ...], default: None = None
) -> Choice | None: ...
def read_choice(
    data: Mapping[str, Any], key: str, path: str, choices: tuple[Choice, ...], default: Choice | None = None
) -> Choice | None:
    """The value at ``key``, one of ``choices``; ``default`` (None unless given) when absent.

    Raises:
        SpecError: not a non-empty string, or not one of ``choices``.
    """
    value = _value(data, key, default)
    field = f"{path}.{key}"
    if value is None:
        return None
    if not isinstance(value, str):
        raise SpecError(field, f"must be a non-empty string, got {value!r}")
    for choice in choices:
        if value == choice:
            return choice
    raise SpecError(field, f"must be one of {', '.join(choices)}; got {value!r}")


@overload
def read_int(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    default: int,
) -> int: ...
@overload
def read_int(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    default: None = None,
) -> int | None: ...
def read_int(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    default: int | None = None,
) -> int | None:
    """The integer at ``key``; ``default`` (None unless given) when absent.

    Raises:
        SpecError: not an integer (booleans are not), or outside ``[minimum, maximum]``.
    """
    value = _value(data, key, default)
    field = f"{path}.{key}"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(field, f"must be ≥ {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(field, f"must be ≤ {maximum}, got {value}")
    return value


def read_number(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    above: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float | None:
    """The number at ``key`` as a float (an integer is a number too); None when absent.

    Raises:
        SpecError: not a finite number (booleans are not numbers), not above ``above``, or
            outside ``[minimum, maximum]``; naming the field.
    """
    value = data.get(key)
    if value is None:
        return None
    field = f"{path}.{key}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(field, f"must be a number, got {value!r}")
    if above is not None and value <= above:
        raise SpecError(field, f"must be > {above:g}, got {value}")
    if minimum is not None and value < minimum:
        raise SpecError(field, f"must be ≥ {minimum:g}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(field, f"must be ≤ {maximum:g}, got {value}")
    return float(value)


@overload
def read_bool(data: Mapping[str, Any], key: str, path: str, default: bool) -> bool: ...
@overload
def read_bool(data: Mapping[str, Any], key: str, path: str, default: None) -> bool | None: ...
def read_bool(data: Mapping[str, Any], key: str, path: str, default: bool | None) -> bool | None:
    """The boolean at ``key``; ``default`` when absent.

    Raises:
        SpecError: not ``true`` or ``false``.
    """
    value = _value(data, key, default)
    if value is None or isinstance(value, bool):
        return value
    raise SpecError(f"{path}.{key}", f"must be true or false, got {value!r}")


def read_int_or_str(data: Mapping[str, Any], key: str, path: str, default: int | str) -> int | str:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SpecError(f"{path}.{key}", f"must be an integer or a percentage, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise SpecError(f"{path}.{key}", f"must be ≥ 0, got {value}")
    if isinstance(value, str) and not re.match(r"^[0-9]+%$", value):
        raise SpecError(f"{path}.{key}", f"must be an integer or a percentage like '25%', got {value!r}")
    return value


def read_string_map(data: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    value = read_obj(data, key, path)
    for k, v in value.items():
        if not isinstance(v, str):
            raise SpecError(f"{path}.{key}.{k}", f"must be a string, got {v!r}")
    return dict(value)


def read_list(data: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key}", f"must be a list, got {type(value).__name__}")
    return value


def _value(data: Mapping[str, Any], key: str, default: object) -> object:
    """``data[key]``, or ``default`` when the key is absent or null."""
    value = data.get(key)
    return default if value is None else value
