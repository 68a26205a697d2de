"""The cluster admin's admission policy: which images, host paths and flag overrides a service may use.

Owns: parsing the policy file (the chart renders it from ``admissionPolicy`` in its values) and
checking a parsed spec against it. Pure: no API, no files read here. The webhook denies a service
outside the policy and the reconcile re-checks it before building anything, so a service admitted
under an older, looser policy is not deployed. Invariant: a violation names the field, and the
empty policy allows nothing beyond the operator's own default runtime image.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.values import InferenceSpec, ModelSource

POLICY_REASON = "PolicyViolation"
#: Flags the operator sets itself (its ConfigMap's keys) plus the ones that carry secrets or bind
#: the server; ``extraArgs`` may not set them, nor any abbreviation argparse would accept.
RESERVED_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--port",
        "--host",
        "--dtype",
        "--tensor-parallel-size",
        "--quantization",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--config",
        "--api-key",
        "--metrics-token",
        # LoRA: spec.runtime.lora and spec.model.adapters (docs/operator.md "LoRA adapters")
        "--enable-lora",
        "--max-loras",
        "--max-lora-rank",
        "--max-cpu-loras",
        "--lora-modules",
        "--allow-runtime-lora-updating",
        "--no-allow-runtime-lora-updating",
        "--speculative-config",  # spec.runtime.speculative
    }
)
#: Environment the operator or the device plugin sets, and loader/interpreter hooks that would run
#: code from a model volume inside an allowed image.
RESERVED_ENV = frozenset(
    {
        "HOME",
        "VLLM_API_KEY",
        "KUNLUN_METRICS_TOKEN",
        "XPU_VISIBLE_DEVICES",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    }
)
#: What the operator sets or relies on for the pods of a precisely routed service
#: (``spec.routing.precise``): the KV events, their wire encoding (the runtime's default is the one
#: the picker's indexer decodes) and the block hashes the indexer recomputes, from the seed it shares.
PRECISE_RESERVED_FLAGS = frozenset(
    {"--kv-events-config", "--kv-events-encoding", "--prefix-caching-hash-algo"}
)
PRECISE_RESERVED_ENV = frozenset({"PYTHONHASHSEED", "POD_IP"})


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """What a KunlunInferenceService may ask for; the default allows nothing extra."""

    runtime_images: tuple[str, ...] = ()  # prefixes of `spec.runtime.image` (unset is always allowed)
    #: prefixes of `spec.model.source.image.reference` (and of every adapter's)
    model_images: tuple[str, ...] = ()
    #: directories `spec.model.source.hostPath.path` (and every adapter's) may be under
    host_paths: tuple[str, ...] = ()
    picker_images: tuple[str, ...] = ()  # prefixes of `spec.routing.picker.image` (unset: the operator's)
    allow_flag_overrides: bool = False  # may extraArgs/env set RESERVED_FLAGS / RESERVED_ENV


#: The policy without a policy file: only the operator's default runtime image, no host paths, no
#: image model sources, no overrides.
STRICTEST = AdmissionPolicy()


def parse_policy(text: str, *, source: str) -> AdmissionPolicy:
    """Parse the policy YAML (keys ``runtimeImages``, ``modelImages``, ``hostPaths``,
    ``pickerImages``, ``allowFlagOverrides``; all optional).

    Raises:
        ValueError: not YAML, not a mapping, an unknown key, or a value of the wrong type; the
            message names ``source`` and the key.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: not YAML: {error}") from error
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: must be a mapping")
    unknown = set(data) - {"runtimeImages", "modelImages", "hostPaths", "pickerImages", "allowFlagOverrides"}
    if unknown:
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}")
    overrides = data.get("allowFlagOverrides", False)
    if not isinstance(overrides, bool):
        raise ValueError(f"{source}: allowFlagOverrides must be true or false")
    host_paths = _strings(data, "hostPaths", source)
    for path in host_paths:
        if not path.startswith("/") or posixpath.normpath(path) != path.rstrip("/") or path == "/":
            raise ValueError(f"{source}: hostPaths entry {path!r} must be a normalised absolute directory")
    return AdmissionPolicy(
        runtime_images=_strings(data, "runtimeImages", source),
        model_images=_strings(data, "modelImages", source),
        host_paths=host_paths,
        picker_images=_strings(data, "pickerImages", source),
        allow_flag_overrides=overrides,
    )


def _strings(data: Mapping[str, Any], key: str, source: str) -> tuple[str, ...]:
    value = data.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{source}: {key} must be a list of non-empty strings")
    return tuple(value)


def check_policy(spec: InferenceSpec, policy: AdmissionPolicy) -> SpecError | None:
    """The first way ``spec`` breaks ``policy``, or None when it keeps it."""
    rt = spec.runtime
    if rt.image is not None and not image_allowed(rt.image, policy.runtime_images):
        return _violation("spec.runtime.image", rt.image, policy.runtime_images, "runtimeImages")
    sources = [("spec.model.source", spec.model.source)]
    sources += [(f"spec.model.adapters[{i}].source", a.source) for i, a in enumerate(spec.model.adapters)]
    for path, source in sources:
        violation = _source_violation(path, source, policy)
        if violation is not None:
            return violation
    picker = spec.routing.picker.image
    if picker is not None and not image_allowed(picker, policy.picker_images):
        return _violation("spec.routing.picker.image", picker, policy.picker_images, "pickerImages")
    if policy.allow_flag_overrides:
        return None
    precise = spec.routing.precise
    flags = RESERVED_FLAGS | PRECISE_RESERVED_FLAGS if precise else RESERVED_FLAGS
    env = RESERVED_ENV | PRECISE_RESERVED_ENV if precise else RESERVED_ENV
    for i, arg in enumerate(rt.extra_args):
        flag = reserved_flag(arg, flags)
        if flag is not None:
            return SpecError(
                f"spec.runtime.extraArgs[{i}]",
                f"{arg!r} overrides the operator's flag {flag} (admission policy allowFlagOverrides: false)",
                reason=POLICY_REASON,
            )
    for i, var in enumerate(rt.env):
        if var["name"] in env:
            return SpecError(
                f"spec.runtime.env[{i}].name",
                f"{var['name']} is reserved (admission policy allowFlagOverrides: false)",
                reason=POLICY_REASON,
            )
    return None


def _source_violation(path: str, source: ModelSource, policy: AdmissionPolicy) -> SpecError | None:
    """How the weights' ``source`` at ``path`` (the model's or an adapter's) breaks ``policy``."""
    if source.kind == "image" and not image_allowed(source.reference or "", policy.model_images):
        return _violation(f"{path}.image.reference", source.reference, policy.model_images, "modelImages")
    if source.kind == "hostPath" and not host_path_allowed(source.path, policy.host_paths):
        return _violation(f"{path}.hostPath.path", source.path, policy.host_paths, "hostPaths")
    return None


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """True when ``image`` lies under one of ``prefixes``, on a path boundary: ``reg.io/team`` allows
    ``reg.io/team/x:1`` and ``reg.io/team:1`` but not ``reg.io/team-evil/x``."""
    for prefix in prefixes:
        if image == prefix or (
            image.startswith(prefix) and (prefix[-1] in "/:@" or image[len(prefix)] in "/:@")
        ):
            return True
    return False


def host_path_allowed(path: str, prefixes: tuple[str, ...]) -> bool:
    """True when the normalised ``path`` is one of ``prefixes`` or below one (``..`` never helps)."""
    if ".." in path.split("/"):
        return False
    normal = posixpath.normpath(path)
    return any(normal == p.rstrip("/") or normal.startswith(p.rstrip("/") + "/") for p in prefixes)


def reserved_flag(arg: str, reserved: frozenset[str] = RESERVED_FLAGS) -> str | None:
    """The flag of ``reserved`` that ``arg`` sets (itself, ``--flag=value`` or an abbreviation),
    else None."""
    if not arg.startswith("--") or len(arg) <= 2:
        return None
    name = arg.split("=", 1)[0]
    matches = sorted(f for f in reserved if f.startswith(name))
    return name if name in reserved else (matches[0] if matches else None)


def _violation(field: str, value: str | None, allowed: tuple[str, ...], key: str) -> SpecError:
    listed = ", ".join(allowed) if allowed else "nothing"
    return SpecError(
        field, f"{value!r} is not allowed by the admission policy ({key}: {listed})", reason=POLICY_REASON
    )
