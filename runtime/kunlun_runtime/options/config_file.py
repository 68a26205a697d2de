"""Engine options from a YAML file: ``load_engine_options(path)`` for ``serve --config FILE``.

Accepted shapes:

- the output of ``kunlun-runtime tune``: a mapping with an ``engine`` section (the options) and the
  documentation sections ``why``, ``measurements`` and ``cpu`` (ignored);
- a flat mapping of options.

Keys are ``EngineConfig`` field names (``max_num_seqs``) or their flag spelling (``max-num-seqs``);
``kv_cache_memory`` (bytes or a size such as ``4GiB``) stands for ``kv_cache_memory_bytes``.
Every value is type-checked and the whole set validated by ``EngineConfig.validate()``; any error
is a ``ConfigError`` naming the file and the key. Nothing here touches torch or the model.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from kunlun_runtime.config import EngineConfig, parse_memory
from kunlun_runtime.errors import ConfigError

DOCUMENTATION_SECTIONS = frozenset({"why", "measurements", "cpu"})
# Python types a YAML value may have for a field of each annotated type (bool is not an int here;
# a Literal option is a string whose value ``EngineConfig.validate()`` checks).
_SCALARS: dict[object, tuple[type, ...]] = {int: (int,), bool: (bool,), float: (int, float), str: (str,)}


def _accepted_types(hint: object) -> tuple[type, ...] | None:
    """What YAML may hold for a field annotated ``hint``; None for fields a file cannot set."""
    if hint is type(None):
        return (type(None),)
    if get_origin(hint) is Literal:
        return (str,)
    if get_origin(hint) in (Union, UnionType):
        parts = [_accepted_types(arg) for arg in get_args(hint)]
        return None if any(p is None for p in parts) else tuple(t for p in parts if p for t in p)
    return _SCALARS.get(hint)


OPTION_TYPES = {
    name: accepted
    for name, hint in get_type_hints(EngineConfig).items()
    if (accepted := _accepted_types(hint)) is not None
}


def _error(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {message}", field=key)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror})", field="config") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})", field="config") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of engine options", field="config")
    if "engine" not in data:
        return data
    extra = sorted(set(data) - {"engine"} - DOCUMENTATION_SECTIONS)
    if extra:
        raise _error(path, extra[0], "unknown section (a tune file has engine, why, measurements, cpu)")
    if not isinstance(data["engine"], dict):
        raise _error(path, "engine", "must be a mapping of engine options")
    return data["engine"]


def _option(path: Path, key: Any, value: Any) -> tuple[str, Any]:
    if not isinstance(key, str):
        raise _error(path, str(key), "option names must be strings")
    name = key.replace("-", "_")
    if name == "kv_cache_memory":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _error(path, key, f"must be a byte count or a size such as 4GiB, got {value!r}")
        try:
            return "kv_cache_memory_bytes", parse_memory(value, field_name=key)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}", field=key) from error
    if name not in OPTION_TYPES:
        known = ", ".join(sorted([*OPTION_TYPES, "kv_cache_memory"]))
        raise _error(path, key, f"unknown engine option (known: {known})")
    types = OPTION_TYPES[name]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise _error(path, key, f"must be {wanted}, got {type(value).__name__} {value!r}")
    return name, value


def load_engine_options(path: str | Path) -> dict[str, Any]:
    """Read engine options from ``path``; returns EngineConfig field names → values.

    The result can be passed as ``EngineConfig(**options)`` or ``LLM(**options)``.

    Raises:
        ConfigError: unreadable file, not YAML, unknown section or option, wrong type or invalid
            value; the message names the file and the key, ``field`` the key.
    """
    path = Path(path)
    options: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in _read(path).items():
        name, parsed = _option(path, key, value)
        if name in options:
            raise _error(path, str(key), f"given twice (also as {keys[name]!r})")
        options[name], keys[name] = parsed, str(key)
    try:
        EngineConfig(**options).validate()
    except ConfigError as error:
        key = keys.get(error.field or "", error.field or "config")
        if error.field == "kv_cache_memory":
            key = keys.get("kv_cache_memory_bytes", key)
        raise ConfigError(f"{path}: {error}", field=key) from error
    return options
