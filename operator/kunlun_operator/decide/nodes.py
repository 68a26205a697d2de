"""Which Kunlun nodes can run a service: the version lock seen from the node labels.

Owns: reading the labeler's node labels, deciding compatibility (versions under the policy,
product, XPU count, the user's node selector, schedulability), and the message that explains why no
node fits. Pure: nodes come in as ``NodeFacts``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from kunlun_operator import names
from kunlun_operator.spec.values import InferenceSpec, VersionsSpec

_VERSION_LABELS = (
    ("driver", names.LABEL_DRIVER_VERSION),
    ("firmware", names.LABEL_FIRMWARE_VERSION),
    ("kml", names.LABEL_KML_VERSION),
)


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the operator knows about one node (from the Node watch)."""

    name: str
    labels: Mapping[str, str]
    unschedulable: bool = False

    @property
    def is_kunlun(self) -> bool:
        return self.labels.get(names.LABEL_PRESENT) == "true"

    @property
    def num_xpus(self) -> int:
        try:
            return int(self.labels.get(names.LABEL_COUNT, "0"))
        except ValueError:
            return 0

    def versions_text(self) -> str:
        return " ".join(f"{key}={self.labels.get(label, '?')}" for key, label in _VERSION_LABELS)


@dataclass(frozen=True, slots=True)
class NodeReport:
    compatible_node_names: tuple[str, ...]
    reason: Literal["CompatibleNodesFound", "NoKunlunNodes", "NoCompatibleNodes"]
    message: str


def version_mismatches(node: NodeFacts, versions: VersionsSpec) -> list[str]:
    """``["driver 5.0.20 (want 5.0.21.26)", ...]``: how ``node`` differs from the locked versions."""
    out = []
    for key, label in _VERSION_LABELS:
        wanted = getattr(versions, key)
        have = node.labels.get(label)
        if wanted is not None and have != wanted:
            out.append(f"{key} {have or 'unknown'} (want {wanted})")
    return out


def is_compatible(node: NodeFacts, spec: InferenceSpec) -> bool:
    """Whether a replica of ``spec`` may run on ``node`` (its versions only count under Strict/Warn)."""
    if not node.is_kunlun or node.unschedulable or node.num_xpus < spec.resources.xpus:
        return False
    product = spec.resources.xpu_product
    if product is not None and node.labels.get(names.LABEL_PRODUCT) != product:
        return False
    if any(node.labels.get(k) != v for k, v in spec.scheduling.node_selector.items()):
        return False
    return spec.versions.policy == "Off" or not version_mismatches(node, spec.versions)


def assess_nodes(nodes: Iterable[NodeFacts], spec: InferenceSpec) -> NodeReport:
    """Count the compatible nodes and explain, when there are none, what the Kunlun nodes have."""
    nodes = sorted(nodes, key=lambda n: n.name)
    compatible = tuple(n.name for n in nodes if is_compatible(n, spec))
    if compatible:
        return NodeReport(
            compatible,
            "CompatibleNodesFound",
            f"{len(compatible)} node(s) match: {', '.join(compatible[:5])}"
            + (" …" if len(compatible) > 5 else ""),
        )
    kunlun = [n for n in nodes if n.is_kunlun]
    if not kunlun:
        return NodeReport(
            (),
            "NoKunlunNodes",
            f"no node carries {names.LABEL_PRESENT}=true (is the device plugin's labeler running?)",
        )
    want = _wanted_text(spec)
    seen = Counter(
        f"{n.versions_text()} product={n.labels.get(names.LABEL_PRODUCT, '?')} xpus={n.num_xpus}"
        for n in kunlun
    )
    have = "; ".join(
        f"{text} ({count} node{'s' if count > 1 else ''})" for text, count in sorted(seen.items())
    )
    return NodeReport((), "NoCompatibleNodes", f"no Kunlun node matches {want}; Kunlun nodes have: {have}")


def _wanted_text(spec: InferenceSpec) -> str:
    parts = []
    if spec.versions.policy != "Off":
        v = spec.versions
        parts.append(f"driver={v.driver} firmware={v.firmware} kml={v.kml}")
    if spec.resources.xpu_product:
        parts.append(f"product={spec.resources.xpu_product}")
    parts.append(f"xpus>={spec.resources.xpus}")
    parts.extend(f"{k}={v}" for k, v in sorted(spec.scheduling.node_selector.items()))
    return " ".join(parts)
