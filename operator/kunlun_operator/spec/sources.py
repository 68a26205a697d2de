"""Parse where weights come from: the model's source, its LoRA adapters and the runtime's LoRA limits.

Owns: ``spec.model.source`` and each ``spec.model.adapters[].source`` (one parser: the same kinds,
pvc, hostPath and image, with the same checks), the adapters' names, and ``spec.runtime.lora``.
Must not talk to the API. Invariant: every ``SpecError`` names the field, with the adapter's index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.fields import read_bool, read_choice, read_int, read_list, read_obj, read_str
from kunlun_operator.spec.quantity import parse_bytes
from kunlun_operator.spec.values import (
    MAX_ADAPTERS,
    MAX_LORA_RANK,
    PULL_POLICIES,
    SOURCE_KINDS,
    Adapter,
    LoRASpec,
    ModelSource,
)

#: An adapter's served name: what requests put in ``model``. No commas (``vllm:lora_requests_info``
#: lists adapters comma-separated), no ``=`` (``--lora-modules name=path``), no white space.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/:-]{0,126}[A-Za-z0-9])?$")

#: What no source path may hold (the CRD's pattern on every source ``path``, too).
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def parse_source(source: Mapping[str, Any], path: str) -> ModelSource:
    """The source object at ``path`` (``spec.model.source``): exactly one of pvc, hostPath, image.

    Raises:
        SpecError: none or several kinds, or a kind's field missing or malformed.
    """
    kinds = [k for k in SOURCE_KINDS if source.get(k) is not None]
    if len(kinds) != 1:
        raise SpecError(path, f"exactly one of pvc, hostPath, image must be set; got {kinds or 'none'}")
    kind = kinds[0]
    sp = f"{path}.{kind}"
    body = read_obj(source, kind, path)
    if kind == "pvc":
        parsed = ModelSource(
            kind,
            claim_name=read_str(body, "claimName", sp, required=True),
            path=read_str(body, "path", sp, default=""),
        )
        if parsed.path.startswith("/") or ".." in parsed.path.split("/"):
            raise SpecError(f"{sp}.path", f"must be relative inside the claim, got {parsed.path!r}")
        return _without_control_characters(parsed, sp)
    if kind == "hostPath":
        parsed = ModelSource(kind, path=read_str(body, "path", sp, required=True, pattern=re.compile(r"^/")))
        return _without_control_characters(parsed, sp)
    return ModelSource(
        kind,
        reference=read_str(body, "reference", sp, required=True),
        pull_policy=read_choice(body, "pullPolicy", sp, PULL_POLICIES, default="IfNotPresent"),
    )


def _without_control_characters(source: ModelSource, path: str) -> ModelSource:
    """``source`` unless its path holds a control character: a newline would split the adapter list
    the runtime's wrapper reads one value a line (``builders/adapters.LORA_WRAPPER``).

    Raises:
        SpecError: naming ``path``'s ``path`` field.
    """
    if CONTROL_CHARACTER.search(source.path or ""):
        raise SpecError(f"{path}.path", f"must not contain control characters, got {source.path!r}")
    return source


def parse_adapters(model: Mapping[str, Any], model_name: str) -> tuple[Adapter, ...]:
    """``spec.model.adapters``: names unique, valid as served names and not the model's own.

    Raises:
        SpecError: naming ``spec.model.adapters[i]`` and the field.
    """
    p = "spec.model.adapters"
    items = read_list(model, "adapters", "spec.model")
    if len(items) > MAX_ADAPTERS:
        raise SpecError(p, f"at most {MAX_ADAPTERS} adapters, got {len(items)}")
    adapters: list[Adapter] = []
    for i, item in enumerate(items):
        ip = f"{p}[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(ip, "must be an object")
        name = read_str(item, "name", ip, required=True, pattern=ADAPTER_NAME)
        if name == model_name:
            raise SpecError(f"{ip}.name", f"{name!r} is the base model's name (spec.model.name)")
        if any(a.name == name for a in adapters):
            raise SpecError(f"{ip}.name", f"{name!r} is listed twice")
        size = item.get("size")
        adapters.append(
            Adapter(
                name=name,
                source=parse_source(read_obj(item, "source", ip, required=True), f"{ip}.source"),
                size_bytes=None if size is None else parse_bytes(size, f"{ip}.size"),
            )
        )
    return tuple(adapters)


def parse_lora(rt: Mapping[str, Any], *, has_adapters: bool) -> LoRASpec | None:
    """``spec.runtime.lora``; None (LoRA off) when it is absent and no adapter is listed.

    Raises:
        SpecError: a limit out of bounds, or maxCpuLoras below maxLoras.
    """
    if rt.get("lora") is None and not has_adapters:
        return None
    lora = read_obj(rt, "lora", "spec.runtime")
    p = "spec.runtime.lora"
    parsed = LoRASpec(
        max_loras=read_int(lora, "maxLoras", p, minimum=1, default=1),
        max_lora_rank=read_int(lora, "maxLoraRank", p, minimum=1, maximum=MAX_LORA_RANK, default=16),
        max_cpu_loras=read_int(lora, "maxCpuLoras", p, minimum=1),
        runtime_updates=read_bool(lora, "runtimeUpdates", p, False),
    )
    if parsed.max_cpu_loras is not None and parsed.max_cpu_loras < parsed.max_loras:
        raise SpecError(f"{p}.maxCpuLoras", f"{parsed.max_cpu_loras} is below maxLoras ({parsed.max_loras})")
    return parsed
