"""Factories for operator unit tests: specs, service refs, nodes, facts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kunlun_operator import names
from kunlun_operator.decide.nodes import NodeFacts
from kunlun_operator.decide.reconcile import ClusterFacts
from kunlun_operator.policy.matrix import load_default_matrix
from kunlun_operator.spec.service import ServiceRef

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
VERSIONS = {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"}
NOW = "2026-01-01T00:00:00Z"
#: The owner references of every object the service ``make_ref()`` owns.
OWNER = [
    {
        "apiVersion": "serving.kunlun.dev/v1alpha1",
        "kind": "KunlunInferenceService",
        "name": "qwen",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
]


def make_raw_spec(**overrides: Any) -> dict[str, Any]:
    """A minimal valid spec (PVC source, Strict), with top-level keys replaced by ``overrides``."""
    spec: dict[str, Any] = {
        "model": {"name": "qwen", "source": {"pvc": {"claimName": "models", "path": "Qwen2-7B"}}},
        "versions": dict(VERSIONS),
    }
    spec.update(copy.deepcopy(overrides))
    return spec


def make_cr(spec: dict[str, Any], name: str = "qwen") -> dict[str, Any]:
    """A KunlunInferenceService custom resource with ``spec`` (for the CRD's own validation)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def make_ref(name: str = "qwen", namespace: str = "ml", generation: int = 1) -> ServiceRef:
    return ServiceRef(name=name, namespace=namespace, uid="uid-1", generation=generation)


def make_node(
    name: str,
    *,
    driver: str = "5.0.21.26",
    firmware: str = "1.0.2.14.1.54",
    kml: str = "3.2.0",
    count: int = 8,
    product: str = "P800",
    kunlun: bool = True,
) -> NodeFacts:
    if not kunlun:
        return NodeFacts(name, {"kubernetes.io/hostname": name})
    return NodeFacts(
        name,
        {
            names.LABEL_PRESENT: "true",
            names.LABEL_PRODUCT: product,
            names.LABEL_COUNT: str(count),
            names.LABEL_DRIVER_VERSION: driver,
            names.LABEL_FIRMWARE_VERSION: firmware,
            names.LABEL_KML_VERSION: kml,
        },
    )


def make_facts(**overrides: Any) -> ClusterFacts:
    values: dict[str, Any] = {"nodes": (make_node("xpu-1"),), "matrix": load_default_matrix()}
    values.update(overrides)
    return ClusterFacts(**values)


def load_example(name: str) -> dict[str, Any]:
    with (EXAMPLES / name).open() as f:
        return yaml.safe_load(f)


def example_names() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.yaml"))
