"""The PodDisruptionBudget: node drains take at most ``spec.disruption.maxUnavailable`` replicas."""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec import InferenceSpec, ServiceRef


def build_pdb(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    return {
        **header(names.PDB),
        "metadata": build_metadata(ref, names.PDB),
        "spec": {
            "maxUnavailable": spec.disruption_max_unavailable,
            "selector": {"matchLabels": names.selector_labels(ref.name)},
        },
    }
