"""The ResourceClaimTemplate of a service with ``spec.resources.allocation: dra``, and its CEL.

Owns: what a pod asks of Dynamic Resource Allocation (``resource.k8s.io/v1``): one request,
``xpus``, for exactly ``spec.resources.xpus`` devices of the DeviceClass ``xpu.kunlun.dev``, with
CEL selectors the scheduler evaluates per card against the attributes the DRA kubelet plugin
publishes (``kunlun_device.dra.slices``): the certified version stacks (an OR over them; each
version compared as the plugin maps it to semver, ``kunlun_device.dra.semver``), the product
(``spec.resources.xpuProduct`` against the label-safe form of ``model``, as the classic node
selector compares the labeler's ``kunlun.dev/xpu.product``), and for ``tensorParallelSize > 1`` a
``matchAttribute`` on ``linkGroup`` so one pod's cards share an XPU Link group — unless the pod
asks for more cards than any link group holds (``MAX_LINK_GROUP_CARDS``), where the constraint
could never be met.

A template's spec cannot change (the API server refuses updates), so its name carries a hash of
its spec: a changed request is a new template, the pods roll to it, and the controller prunes the
old one. Must not talk to the API. Invariant: every attribute a selector reads is guarded by
``has()``, so a card that does not publish it simply does not match (an unguarded missing
attribute is an evaluation error, which aborts the whole allocation).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from kunlun_device.dra.semver import to_semver
from kunlun_device.labels import DRA_DRIVER
from kunlun_operator import names
from kunlun_operator.builders.common import header, owner_reference
from kunlun_operator.policy.matrix import CertifiedStack
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

#: The pod's claim and the template's one request carry this name (``resources.claims[].name``).
CLAIM_NAME = "xpus"
DEVICE_CLASS = DRA_DRIVER  # the chart's DeviceClass, named like the driver
#: The attribute one pod's cards must share when the engine is split over them.
LINK_GROUP_ATTRIBUTE = "linkGroup"
#: The most cards one XPU Link group holds on any Kunlun node: an 8-card P800 node is two fully
#: linked quads (``kunlun_device.dra.links``); no product we serve has a larger all-to-all group.
#: A pod of more cards spans groups on every node, so it gets no ``linkGroup`` constraint (a claim
#: for 8 cards in one group would never be allocated); its cards still come from one node.
MAX_LINK_GROUP_CARDS = 4
#: Spec fields → the device attributes that hold them.
VERSION_ATTRIBUTES = (("driver", "driverVersion"), ("firmware", "firmwareVersion"), ("kml", "kmlVersion"))
_HASH_LENGTH = 10


def attribute(name: str) -> str:
    """The CEL path of our driver's attribute ``name``."""
    return f"device.attributes[{json.dumps(DRA_DRIVER)}].{name}"


def model_pattern(product: str) -> str:
    """The RE2 pattern a card's ``model`` matches when the labeler would label it ``product``: its
    unsafe runs (``[^A-Za-z0-9._-]+``) become ``-`` and non-alphanumeric ends are trimmed
    (``kunlun_device.labeler.values.label_safe``), so ``P800-OAM`` matches ``P800 OAM``."""
    pieces = [r"(?:-|[^A-Za-z0-9._-]+)" if char == "-" else re.escape(char) for char in product]
    return "^[^A-Za-z0-9]*" + "".join(pieces) + "[^A-Za-z0-9]*$"


def _version_test(name: str, versions: Sequence[str]) -> str:
    """``name`` (a version attribute) equals one of ``versions`` (as the plugin maps them)."""
    path = attribute(name)
    tests = []
    for version in versions:
        semver = to_semver(version)
        # A version the plugin cannot map is never published: no card can have it.
        tests.append("false" if semver is None else f"{path}.compareTo(semver({json.dumps(semver)})) == 0")
    either = tests[0] if len(tests) == 1 else "(" + " || ".join(tests) + ")"
    return f"has({path}) && {either}"


def versions_selector(stacks: Sequence[CertifiedStack]) -> str | None:
    """One CEL expression: the card's driver, firmware and KML are those of one of ``stacks`` (the
    certified entries narrowed to the service's versions); None when there is nothing to lock."""
    clauses = []
    for stack in stacks:
        tests = [_version_test(attr, getattr(stack, field)) for field, attr in VERSION_ATTRIBUTES]
        clauses.append(" && ".join(tests))
    if not clauses:
        return None
    return clauses[0] if len(clauses) == 1 else " || ".join(f"({c})" for c in clauses)


def product_selector(product: str) -> str:
    """``model`` is the card product ``product`` (``spec.resources.xpuProduct``, a label value)."""
    path = attribute("model")
    return f"has({path}) && {path}.matches({json.dumps(model_pattern(product))})"


def device_selectors(spec: InferenceSpec, stacks: Sequence[CertifiedStack]) -> list[str]:
    """The request's CEL selectors (ANDed by the scheduler): versions under ``Strict``, product."""
    selectors = []
    locked = versions_selector(stacks) if spec.versions.policy == "Strict" else None
    if locked is not None:
        selectors.append(locked)
    if spec.resources.xpu_product:
        selectors.append(product_selector(spec.resources.xpu_product))
    return selectors


def needs_link_group(spec: InferenceSpec) -> bool:
    """One pod's cards must share a link group: its engine is split over them
    (``tensorParallelSize > 1``) and they fit in one (``MAX_LINK_GROUP_CARDS``)."""
    return spec.runtime.tensor_parallel_size > 1 and spec.resources.xpus <= MAX_LINK_GROUP_CARDS


def build_claim_spec(spec: InferenceSpec, stacks: Sequence[CertifiedStack]) -> dict[str, Any]:
    """The ResourceClaimSpec every pod's claim gets: ``resources.xpus`` cards of the class, the
    selectors, and one link group when ``needs_link_group``."""
    exactly: dict[str, Any] = {
        "deviceClassName": DEVICE_CLASS,
        "allocationMode": "ExactCount",
        "count": spec.resources.xpus,
    }
    selectors = device_selectors(spec, stacks)
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    devices: dict[str, Any] = {"requests": [{"name": CLAIM_NAME, "exactly": exactly}]}
    if needs_link_group(spec):
        devices["constraints"] = [
            {"requests": [CLAIM_NAME], "matchAttribute": f"{DRA_DRIVER}/{LINK_GROUP_ATTRIBUTE}"}
        ]
    return {"devices": devices}


#: A container's ``resources.claims``: the runtime and the preflight share the pod's one claim,
#: so the kubelet injects the same cards (CDI: device nodes and ``XPU_VISIBLE_DEVICES``) into both.
CONTAINER_CLAIMS = ({"name": CLAIM_NAME},)


def pod_resource_claims(template_name: str) -> list[dict[str, Any]]:
    """The pod's ``spec.resourceClaims``: one claim per pod, made from the template ``template_name``."""
    return [{"name": CLAIM_NAME, "resourceClaimTemplateName": template_name}]


def claim_template_name(ref: ServiceRef, claim_spec: dict[str, Any]) -> str:
    """``<service>-xpus-<hash of the claim spec>``: a new name for every new (immutable) spec."""
    text = json.dumps(claim_spec, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:_HASH_LENGTH]
    return f"{ref.name}{names.RESOURCE_CLAIM_TEMPLATE.suffix}-{digest}"


def build_resource_claim_template(
    ref: ServiceRef, spec: InferenceSpec, stacks: Sequence[CertifiedStack]
) -> dict[str, Any]:
    """The service's ResourceClaimTemplate (its name: ``claim_template_name``)."""
    claim_spec = build_claim_spec(spec, stacks)
    labels = names.common_labels(ref.name)
    return {
        **header(names.RESOURCE_CLAIM_TEMPLATE),
        "metadata": {
            "name": claim_template_name(ref, claim_spec),
            "namespace": ref.namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(ref)],
        },
        "spec": {"metadata": {"labels": labels}, "spec": claim_spec},
    }
