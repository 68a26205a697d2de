"""LoRA adapters in the runtime pod: their volumes, mounts, fetch init containers, paths and flags.

Owns: where each adapter of ``spec.model.adapters`` is found inside the runtime container, and the
runtime's LoRA flags (``--enable-lora``, the limits of ``spec.runtime.lora``, ``--lora-modules``).
Adapters share a volume where their sources do (every adapter of one PVC is one volume, told apart
by its sub-path), so a volume's name depends only on its source: adding an adapter inside a claim
already mounted changes no volume. With ``runtimeUpdates`` the adapter list is not in the pod's
arguments but in the ConfigMap's ``lora-modules`` key, which a new pod reads at start and which the
config hash leaves out (docs/operator.md "LoRA adapters"). Pure.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.sources import IMAGE_MODEL_DIR, fetch_container, source_volume
from kunlun_operator.spec.values import InferenceSpec, ModelSource

ADAPTERS_MOUNT_PATH = "/adapters"
#: The ConfigMap key (a file in CONFIG_MOUNT_PATH) holding ``--lora-modules`` and its values, one a
#: line, under ``runtimeUpdates``; the config hash does not cover it.
LORA_MODULES_KEY = "lora-modules"
LORA_MODULES_FILE = f"{names.CONFIG_MOUNT_PATH}/{LORA_MODULES_KEY}"
#: The runtime's command under ``runtimeUpdates``: the arguments, then the file's lines as more
#: arguments (split at newlines only, no globbing). ``$$`` is Kubernetes' escape for ``$``.
LORA_WRAPPER = f"set -f\nIFS='\n'\nexec kunlun-runtime \"$@\" $$(cat {LORA_MODULES_FILE})"


@dataclass(frozen=True, slots=True)
class AdapterMount:
    """One adapter as the runtime container sees it."""

    name: str
    path: str  # the PEFT directory inside the container
    volume: str  # the pod volume it is read from


def adapter_volume_name(source: ModelSource) -> str:
    """``adapter-`` and a hash of what the volume holds (a PVC: the claim, not the sub-path)."""
    key = {
        "pvc": f"pvc:{source.claim_name}",
        "hostPath": f"hostPath:{source.path}",
        "image": f"image:{source.reference}:{source.pull_policy}",
    }[source.kind]
    return f"adapter-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def adapter_mounts(spec: InferenceSpec, *, image_volumes: bool) -> tuple[AdapterMount, ...]:
    """Every adapter of ``spec``, in order, with its path and volume."""
    out = []
    for adapter in spec.model.adapters:
        source = adapter.source
        volume = adapter_volume_name(source)
        path = f"{ADAPTERS_MOUNT_PATH}/{volume}"
        if source.kind == "pvc" and source.path:
            path = f"{path}/{source.path.strip('/')}"
        elif source.kind == "image" and image_volumes:
            path = f"{path}{IMAGE_MODEL_DIR}"
        out.append(AdapterMount(adapter.name, path, volume))
    return tuple(out)


def _sources_by_volume(spec: InferenceSpec) -> dict[str, ModelSource]:
    """Each adapter volume once, in the order of the adapters first using it."""
    found: dict[str, ModelSource] = {}
    for adapter in spec.model.adapters:
        found.setdefault(adapter_volume_name(adapter.source), adapter.source)
    return found


def adapter_volumes(spec: InferenceSpec, *, image_volumes: bool) -> list[dict[str, Any]]:
    return [
        source_volume(volume, source, image_volumes=image_volumes)
        for volume, source in _sources_by_volume(spec).items()
    ]


def adapter_volume_mounts(spec: InferenceSpec) -> list[dict[str, Any]]:
    """The runtime container's read-only mounts of the adapter volumes."""
    return [
        {"name": volume, "mountPath": f"{ADAPTERS_MOUNT_PATH}/{volume}", "readOnly": True}
        for volume in _sources_by_volume(spec)
    ]


def adapter_fetch_containers(spec: InferenceSpec, *, image_volumes: bool) -> list[dict[str, Any]]:
    """``fetch-<volume>`` init containers for image adapters without image volumes."""
    if image_volumes:
        return []
    return [
        fetch_container(f"fetch-{volume}", source, volume)
        for volume, source in _sources_by_volume(spec).items()
        if source.kind == "image"
    ]


def lora_module_values(spec: InferenceSpec, *, image_volumes: bool) -> list[str]:
    """``name=path`` per adapter (``--lora-modules``'s values)."""
    return [f"{m.name}={m.path}" for m in adapter_mounts(spec, image_volumes=image_volumes)]


def lora_flags(spec: InferenceSpec, *, image_volumes: bool) -> list[tuple[str, Any]]:
    """The runtime's LoRA flags (empty with LoRA off); ``--lora-modules`` takes a list of values,
    and is left out under ``runtimeUpdates`` (its values are in ``lora_modules_file``)."""
    lora = spec.runtime.lora
    if lora is None:
        return []
    flags: list[tuple[str, Any]] = [
        ("--enable-lora", None),
        ("--max-loras", lora.max_loras),
        ("--max-lora-rank", lora.max_lora_rank),
    ]
    if lora.max_cpu_loras is not None:
        flags.append(("--max-cpu-loras", lora.max_cpu_loras))
    if lora.runtime_updates:
        flags.append(("--allow-runtime-lora-updating", None))
    elif spec.model.adapters:
        flags.append(("--lora-modules", lora_module_values(spec, image_volumes=image_volumes)))
    return flags


def lora_modules_file(spec: InferenceSpec, *, image_volumes: bool) -> dict[str, str]:
    """The ConfigMap's ``lora-modules`` entry under ``runtimeUpdates`` (else none): the flag and one
    value a line, or empty without adapters."""
    lora = spec.runtime.lora
    if lora is None or not lora.runtime_updates:
        return {}
    values = lora_module_values(spec, image_volumes=image_volumes)
    text = "".join(f"{line}\n" for line in ("--lora-modules", *values)) if values else ""
    return {LORA_MODULES_KEY: text}


def runtime_command(spec: InferenceSpec) -> list[str]:
    """The runtime container's command: ``kunlun-runtime``, or under ``runtimeUpdates`` a shell
    that appends the ConfigMap's current adapters to the arguments."""
    lora = spec.runtime.lora
    if lora is None or not lora.runtime_updates:
        return ["kunlun-runtime"]
    return ["sh", "-c", LORA_WRAPPER, "kunlun-runtime"]
