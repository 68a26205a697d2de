"""Cards through Dynamic Resource Allocation: what a ``dra`` service needs, builds and is told.

Owns: whether a service with ``spec.resources.allocation: dra`` can be served (the operator's
``--dra`` and a cluster serving ``resource.k8s.io/v1``), its ResourceClaimTemplate (the certified
stacks of its runtime image narrowed to its versions, ``policy.matrix.certified_stacks``), and its
``DevicesAvailable`` condition read from the ResourceSlices of ``xpu.kunlun.dev`` instead of node
labels: which nodes publish enough matching cards (in one link group when the claim asks for
one), and, for pods the scheduler left Pending on their claim, a message naming the claim and the
attribute no card matches ("no device matches driverVersion 5.0.21.26 …"). Pure: slices and pods
come in as facts. The matching here mirrors the claim's CEL (``builders.resource_claim``); a test
evaluates both on the DRA plugin's own slices.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kunlun_device.dra.semver import to_semver
from kunlun_operator import names
from kunlun_operator.builders.resource_claim import (
    LINK_GROUP_ATTRIBUTE,
    VERSION_ATTRIBUTES,
    build_resource_claim_template,
    model_pattern,
    needs_link_group,
)
from kunlun_operator.decide.status import ConditionStatus
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.matrix import CertifiedStack, Matrix, certified_stacks
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

#: How soon a ``dra`` service refused for want of DRA is looked at again (enabling it needs no
#: spec change).
DRA_RECHECK_SECONDS = 60.0
FIELD = "spec.resources.allocation"
#: DevicesAvailable reasons worth a Warning event whenever they are entered, also from another False.
WARNING_REASONS = frozenset({"NoMatchingDevices", "ClaimsUnschedulable"})
_TYPED = ("string", "version", "int", "bool")
#: What kube-scheduler's DynamicResources plugin says when a claim keeps a pod Pending ("cannot
#: allocate all claims", "resourceclaim not available on the node", "resourceclaim in use", "waiting
#: for dynamic resource controller to create the resourceclaim …", "timed out trying to allocate
#: devices"), lower-cased; a bare "claim" would also catch ``persistentvolumeclaim "x" not found``.
_DRA_SCHEDULER_WORDS = ("cannot allocate all claims", "resourceclaim", "allocate devices")


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One card a ResourceSlice of our driver publishes: its node and its attributes (plain values;
    versions as the semver strings published)."""

    node: str
    name: str
    attributes: Mapping[str, str | int | bool]


@dataclass(frozen=True, slots=True)
class PendingClaim:
    """A runtime pod the scheduler could not place because of its claim (``PodScheduled`` False)."""

    pod: str
    claim: str | None  # the pod's ResourceClaim (``status.resourceClaimStatuses``); None: not made yet
    message: str  # the scheduler's


@dataclass(frozen=True, slots=True)
class DeviceReport:
    compatible_node_names: tuple[str, ...]
    status: ConditionStatus  # of DevicesAvailable
    reason: str
    message: str


def require_dra(spec: InferenceSpec, dra_served: bool) -> SpecError | None:
    """The error naming ``spec.resources.allocation`` when a ``dra`` service cannot be served."""
    if not spec.resources.dra or dra_served:
        return None
    return SpecError(
        FIELD,
        f"dra needs Dynamic Resource Allocation: the operator's --dra (chart: a devicePlugin node pool with "
        f"allocation dra or both) on a cluster serving {names.DRA_GROUP_VERSION} (Kubernetes >= 1.34)",
        reason="DRANotEnabled",
    )


def claim_stacks(spec: InferenceSpec, matrix: Matrix, image: str) -> tuple[CertifiedStack, ...]:
    """The version stacks a claim of ``spec`` running ``image`` locks (Strict only; else none)."""
    return certified_stacks(matrix, image, spec.versions) if spec.versions.policy == "Strict" else ()


def claim_template(ref: ServiceRef, spec: InferenceSpec, matrix: Matrix, image: str) -> dict[str, Any] | None:
    """The ResourceClaimTemplate of a ``dra`` service running ``image``; None for the device plugin."""
    if not spec.resources.dra:
        return None
    return build_resource_claim_template(ref, spec, claim_stacks(spec, matrix, image))


def parse_slice_devices(slices: Iterable[Mapping[str, Any]]) -> tuple[SliceDevice, ...]:
    """The devices of the ResourceSlices of our driver in ``slices`` (others are skipped)."""
    out = []
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != names.DRA_DRIVER or not spec.get("nodeName"):
            continue
        for device in spec.get("devices") or []:
            attributes = {}
            for key, typed in (device.get("attributes") or {}).items():
                value = next((typed[t] for t in _TYPED if isinstance(typed, Mapping) and t in typed), None)
                if value is not None:
                    attributes[key.removeprefix(f"{names.DRA_DRIVER}/")] = value
            out.append(SliceDevice(spec["nodeName"], str(device.get("name")), attributes))
    return tuple(out)


def pending_claim(pod: Mapping[str, Any]) -> PendingClaim | None:
    """The pod's claim problem: unscheduled, with the scheduler's ``PodScheduled`` False message
    in the DRA scheduler plugin's words (``_DRA_SCHEDULER_WORDS``); None otherwise."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if spec.get("nodeName") or not spec.get("resourceClaims"):
        return None
    for cond in status.get("conditions") or []:
        message = str(cond.get("message") or "")
        about_claims = any(words in message.lower() for words in _DRA_SCHEDULER_WORDS)
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and about_claims:
            made = [c.get("resourceClaimName") for c in status.get("resourceClaimStatuses") or []]
            claim = next((c for c in made if c), None)
            return PendingClaim(str((pod.get("metadata") or {}).get("name")), claim, message)
    return None


def mismatch(device: SliceDevice, spec: InferenceSpec, stacks: Sequence[CertifiedStack]) -> str | None:
    """Why ``device`` does not match the claim's selectors (the first attribute that differs, as
    ``driverVersion 5.0.21.26``); None when it matches."""
    if spec.versions.policy == "Strict" and stacks:
        misses = [_stack_miss(device, stack) for stack in stacks]
        if all(misses):
            return misses[0]
    product = spec.resources.xpu_product
    if product and not re.fullmatch(model_pattern(product), str(device.attributes.get("model", ""))):
        return f"model {product}"
    return None


def _stack_miss(device: SliceDevice, stack: CertifiedStack) -> str | None:
    for field, attr in VERSION_ATTRIBUTES:
        wanted: tuple[str, ...] = getattr(stack, field)
        if device.attributes.get(attr) not in {to_semver(v) for v in wanted}:
            return f"{attr} {' or '.join(wanted)}"
    return None


def assess_devices(
    devices: Sequence[SliceDevice],
    spec: InferenceSpec,
    stacks: Sequence[CertifiedStack],
    pending: Sequence[PendingClaim] = (),
) -> DeviceReport:
    """Which nodes publish enough matching cards for one pod, and what to tell the user."""
    if not devices:
        return DeviceReport(
            (),
            "False",
            "NoResourceSlices",
            f"no node publishes devices of {names.DRA_DRIVER} (is the DRA kubelet plugin running?)",
        )
    misses = [(d, mismatch(d, spec, stacks)) for d in devices]
    fitting = _fitting_nodes([d for d, miss in misses if miss is None], spec)
    why = _why_none_fit(misses, spec) if not fitting else None
    if pending:
        named = "; ".join(
            f"pod {p.pod}'s claim {p.claim or '(not created yet)'}: {p.message}" for p in pending[:3]
        )
        return DeviceReport(
            fitting, "False", "ClaimsUnschedulable", f"{why or 'cannot be allocated'}: {named}"
        )
    if why is not None:
        return DeviceReport((), "False", "NoMatchingDevices", why)
    shown = ", ".join(fitting[:5]) + (" …" if len(fitting) > 5 else "")
    return DeviceReport(
        fitting,
        "True",
        "MatchingDevicesFound",
        f"{len(fitting)} node(s) publish enough matching devices: {shown}",
    )


def _fitting_nodes(matching: Sequence[SliceDevice], spec: InferenceSpec) -> tuple[str, ...]:
    """Nodes with ``resources.xpus`` matching cards (in one link group when ``needs_link_group``)."""
    split = needs_link_group(spec)
    groups: dict[tuple[str, Any], int] = defaultdict(int)
    for device in matching:
        group = device.attributes.get(LINK_GROUP_ATTRIBUTE) if split else None
        if split and group is None:
            continue  # matchAttribute needs the attribute on every device
        groups[(device.node, group)] += 1
    return tuple(sorted({node for (node, _), count in groups.items() if count >= spec.resources.xpus}))


def _why_none_fit(misses: Sequence[tuple[SliceDevice, str | None]], spec: InferenceSpec) -> str:
    """No device matches: the most common reason and what the devices publish instead; else too
    few match on any one node (or link group)."""
    reasons = Counter(miss for _, miss in misses if miss is not None)
    if reasons and sum(reasons.values()) == len(misses):
        miss, _ = reasons.most_common(1)[0]
        attr = miss.split(" ", 1)[0]
        seen = Counter(str(d.attributes.get(attr, "unset")) for d, _ in misses)
        have = ", ".join(f"{value} ({count})" for value, count in sorted(seen.items()))
        num_nodes = len({d.node for d, _ in misses})
        return f"no device matches {miss}: the {len(misses)} device(s) on {num_nodes} node(s) publish {attr} {have}"
    group = " in one link group" if needs_link_group(spec) else ""
    matching = len(misses) - sum(reasons.values())
    return (
        f"no node publishes {spec.resources.xpus} matching devices{group} "
        f"({matching} of {len(misses)} devices match)"
    )
