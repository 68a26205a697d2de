"""The PodDisruptionBudget: node drains take at most ``spec.disruption.maxUnavailable`` replicas.

``unhealthyPodEvictionPolicy: AlwaysAllow``: a pod that is not Ready (e.g. held NotReady by the
``kunlun.dev/xpu-healthy`` readiness gate because its card failed) serves nothing, so evicting it
costs no availability. Under the default (IfHealthyBudget) the API server evicts a NotReady pod only
while the budget is otherwise satisfied and ``desiredHealthy > 0``: with one replica, or when every
replica's card failed, each eviction would be refused (429) forever.

A multi-node service gets the same single budget over every pod of every group, not one per group:
its selector matches leaders and workers alike (both templates carry the service's labels), and its
``maxUnavailable`` counts pods. Losing any pod takes its whole group down (LeaderWorkerSet recreates
the group), which uses up the budget at once, so with the default of 1 a drain disrupts one group at
a time; a budget per group would let every group lose a pod at the same moment, and would have to
follow the group count as the HPA scales.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec


def build_pdb(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    return {
        **header(names.PDB),
        "metadata": build_metadata(ref, names.PDB),
        "spec": {
            "maxUnavailable": spec.disruption_max_unavailable,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": names.selector_labels(ref.name)},
        },
    }
