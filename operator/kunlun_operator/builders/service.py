"""The Service in front of the runtime pods (OpenAI API and /metrics on port ``http``).

A multi-node service's Service selects the groups' leaders only (LeaderWorkerSet's
``leaderworkerset.sigs.k8s.io/worker-index: "0"``): workers serve no HTTP.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec


def build_service(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    return {
        **header(names.SERVICE),
        "metadata": build_metadata(ref, names.SERVICE, annotations=spec.service.annotations),
        "spec": {
            "type": spec.service.type,
            "selector": (
                names.leader_selector_labels(ref.name) if spec.multi_node else names.selector_labels(ref.name)
            ),
            "ports": [
                {
                    "name": names.RUNTIME_PORT_NAME,
                    "port": spec.service.port,
                    "targetPort": names.RUNTIME_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def endpoint_url(ref: ServiceRef, spec: InferenceSpec) -> str:
    """The in-cluster base URL of the OpenAI-compatible API."""
    return f"http://{ref.name}.{ref.namespace}.svc:{spec.service.port}/v1"
