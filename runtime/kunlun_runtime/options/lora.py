"""LoRA adapter flags, vLLM's names and forms: the engine's limits and the server's adapters.

Engine flags (``add_lora_engine_args``, part of every engine-running command): ``--enable-lora``,
``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``, one to one onto ``EngineConfig`` fields
(so a ``--config`` file sets them by the same names). Server flags (``add_lora_serve_args``):
``--lora-modules`` (``name=path`` or vLLM's JSON form ``{"name", "path", "base_model_name"}``,
several values and repeatable) and ``--allow-runtime-lora-updating`` (default: vLLM's environment
variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Parsing is pure; reading the adapters is the
server's, at start. Every error is a ``ConfigError`` naming the flag.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.errors import ConfigError

ALLOW_RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the routes
_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})
_FLAG = "--lora-modules"


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the name requests use, the PEFT directory, and optionally the
    base model it was trained for (must then be the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoRAServeOptions:
    """What the server does with adapters: those it reads at start (ids 1, 2, ... in this order)
    and whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` exist."""

    modules: tuple[LoRAModule, ...] = ()
    allow_runtime_updating: bool = False


def add_lora_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters on the base model (vLLM's flag)"
    )
    parser.add_argument("--max-loras", type=int, default=1, help="most distinct adapters in one batch")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in host memory, least recently used unloaded beyond (default: --max-loras)",
    )


def add_lora_serve_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        _FLAG,
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve, read at start: name=path or JSON "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\'; needs --enable-lora',
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter; needs --enable-lora "
        f"(default: ${ALLOW_RUNTIME_LORA_UPDATING_ENV}, else off)",
    )


def lora_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields of the engine's LoRA flags."""
    return {
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }


def validate_adapter_name(name: object, source: str) -> str:
    """``name`` as an adapter's served name: a non-empty string without commas (the
    ``vllm:lora_requests_info`` labels list adapters comma-separated). Raises ConfigError naming
    ``source``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{source}: an adapter's name must be a non-empty string, got {name!r}", field=source
        )
    if "," in name:
        raise ConfigError(
            f"{source}: adapter name {name!r} contains ',' (metrics list adapters comma-separated)",
            field=source,
        )
    return name


def parse_lora_module(text: str) -> LoRAModule:
    """One ``--lora-modules`` value: ``name=path`` or a JSON object with ``name``, ``path`` and
    optionally ``base_model_name``. Raises ConfigError naming the flag and what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{_FLAG}: not valid JSON ({error.msg}): {text!r}", field=_FLAG) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{_FLAG}: the JSON form must be an object, got {text!r}", field=_FLAG)
        unknown = sorted(set(data) - _MODULE_KEYS)
        if unknown:
            known = ", ".join(sorted(_MODULE_KEYS))
            raise ConfigError(
                f"{_FLAG}: unknown key {unknown[0]!r} in {text!r} (known: {known})", field=_FLAG
            )
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise ConfigError(f"{_FLAG}: base_model_name must be a non-empty string in {text!r}", field=_FLAG)
    else:
        name, separator, path = text.partition("=")
        if not separator:
            raise ConfigError(f"{_FLAG}: expected name=path or a JSON object, got {text!r}", field=_FLAG)
        base = None
    validate_adapter_name(name, _FLAG)
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{_FLAG}: adapter {name!r} needs a non-empty path", field=_FLAG)
    return LoRAModule(str(name), path, base)


def parse_lora_modules(values: Iterable[str]) -> tuple[LoRAModule, ...]:
    """Every ``--lora-modules`` value, in order; a name given twice is a ConfigError."""
    modules: list[LoRAModule] = []
    for value in values:
        module = parse_lora_module(value)
        if any(m.name == module.name for m in modules):
            raise ConfigError(f"{_FLAG}: adapter name {module.name!r} given twice", field=_FLAG)
        modules.append(module)
    return tuple(modules)


def lora_serve_options(
    args: argparse.Namespace, config: EngineConfig, env: Mapping[str, str]
) -> LoRAServeOptions:
    """The server's LoRA options from its flags (the switch from ``env`` when the flag is not
    given), checked against the merged engine ``config``: adapters and run-time updating need
    LoRA enabled. Raises ConfigError naming the flag."""
    from kunlun_runtime.options.flags import env_flag  # flags imports this module

    modules = parse_lora_modules(args.lora_modules)
    allow = args.allow_runtime_lora_updating
    source = "--allow-runtime-lora-updating"
    if allow is None:
        allow, source = env_flag(env, ALLOW_RUNTIME_LORA_UPDATING_ENV), f"${ALLOW_RUNTIME_LORA_UPDATING_ENV}"
    if not config.enable_lora:
        if modules:
            raise ConfigError(f"{_FLAG}: serving adapters needs --enable-lora", field=_FLAG)
        if allow:
            raise ConfigError(f"{source}: loading adapters at run time needs --enable-lora", field=source)
    return LoRAServeOptions(modules, allow)
