"""Parse ``spec.routing``: how requests reach the replicas, and the checks it shares with the rest.

Owns: ``RoutingSpec`` from its raw mapping (the CRD's defaults applied), the rules the CRD's CEL
also makes (gateway, picker, precise and hashSeed only where they mean something; no metrics token
the picker cannot send; no precise routing without the prefix cache whose events it indexes), and
the hash seed a precise service uses when it names none. Must not talk to the API.
Invariant: every ``SpecError`` names the field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.fields import read_bool, read_choice, read_int, read_obj, read_str
from kunlun_operator.spec.values import (
    FAILURE_MODES,
    MAX_PICKER_REPLICAS,
    ROUTING_TYPES,
    GatewayRef,
    PickerSpec,
    RoutingSpec,
    RuntimeSpec,
    SecretKeyRef,
)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SECTION_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,251}[a-z0-9])?$")
_HASH_SEED = re.compile(r"^[0-9]{1,10}$")
#: PYTHONHASHSEED's range: Python refuses a larger value at start.
MAX_HASH_SEED = 4_294_967_295


def parse_routing(routing: Mapping[str, Any]) -> RoutingSpec:
    """``spec.routing`` (``{}`` when absent) as a ``RoutingSpec``.

    Raises:
        SpecError: a field of the wrong type or out of bounds, or a field that only means something
            with ``type: InferencePool`` (``gateway``, ``picker``, ``precise``) or with ``precise``
            (``hashSeed``, ``picker.replicas`` above 1) set without it.
    """
    p = "spec.routing"
    parsed = RoutingSpec(
        type=read_choice(routing, "type", p, ROUTING_TYPES, default="Service"),
        precise=read_bool(routing, "precise", p, False),
        gateway=_parse_gateway(routing),
        picker=_parse_picker(routing),
        hash_seed=_parse_hash_seed(routing),
    )
    if not parsed.inference_pool:
        for key, given in (
            ("precise", parsed.precise),
            ("gateway", routing.get("gateway") is not None),
            ("picker", routing.get("picker") is not None),
        ):
            if given:
                raise SpecError(f"{p}.{key}", f"{key} needs type InferencePool")
    if parsed.hash_seed is not None and not parsed.precise:
        raise SpecError(f"{p}.hashSeed", "hashSeed needs precise true")
    if parsed.picker.replicas > 1 and not parsed.precise:
        raise SpecError(
            f"{p}.picker.replicas",
            "picker.replicas above 1 needs precise true: approximate pickers estimate the prefix caches "
            "from their own routing history, which several replicas split",
        )
    return parsed


def check_routing(
    routing: RoutingSpec, runtime: RuntimeSpec, metrics_token_secret: SecretKeyRef | None
) -> None:
    """The rules between ``routing`` and the rest of the spec.

    Raises:
        SpecError: an InferencePool with a ``/metrics`` token (the picker scrapes ``/metrics``
            without one), or precise routing with the prefix cache turned off (no KV events).
    """
    if routing.inference_pool and metrics_token_secret is not None:
        raise SpecError(
            "spec.metricsTokenSecretRef",
            "the endpoint picker reads /metrics without a token, so routing.type InferencePool "
            "cannot be combined with metricsTokenSecretRef",
        )
    if routing.precise and runtime.enable_prefix_caching is False:
        raise SpecError(
            "spec.runtime.enablePrefixCaching",
            "routing.precise indexes the prefix cache's KV events, which enablePrefixCaching false turns off",
        )


def hash_seed(routing: RoutingSpec, namespace: str, name: str) -> str:
    """The PYTHONHASHSEED a precise service's pods and picker share: ``routing.hashSeed``, else one
    derived from the service's namespace and name (stable across restarts and dry runs, different
    between services)."""
    if routing.hash_seed is not None:
        return routing.hash_seed
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return str(int.from_bytes(digest[:4], "big"))


def _parse_gateway(routing: Mapping[str, Any]) -> GatewayRef | None:
    if routing.get("gateway") is None:
        return None
    gateway = read_obj(routing, "gateway", "spec.routing")
    p = "spec.routing.gateway"
    return GatewayRef(
        name=read_str(gateway, "name", p, required=True, pattern=_DNS_SUBDOMAIN),
        namespace=read_str(gateway, "namespace", p, pattern=_DNS_LABEL),
        section_name=read_str(gateway, "sectionName", p, pattern=_SECTION_NAME),
    )


def _parse_picker(routing: Mapping[str, Any]) -> PickerSpec:
    picker = read_obj(routing, "picker", "spec.routing")
    p = "spec.routing.picker"
    resources = read_obj(picker, "resources", p)
    return PickerSpec(
        replicas=read_int(picker, "replicas", p, minimum=1, maximum=MAX_PICKER_REPLICAS, default=1),
        image=read_str(picker, "image", p),
        failure_mode=read_choice(picker, "failureMode", p, FAILURE_MODES, default="FailOpen"),
        resources=dict(resources) if resources else None,
    )


def _parse_hash_seed(routing: Mapping[str, Any]) -> str | None:
    seed = read_str(routing, "hashSeed", "spec.routing", pattern=_HASH_SEED)
    if seed is not None and int(seed) > MAX_HASH_SEED:
        raise SpecError("spec.routing.hashSeed", f"must be at most {MAX_HASH_SEED} (PYTHONHASHSEED's range)")
    return seed
