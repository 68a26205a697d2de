"""The InferencePool of a routed service: its serving pods, and the Endpoint Picker that picks one.

Owns: the Gateway API Inference Extension's ``inference.networking.k8s.io/v1`` InferencePool that
``spec.routing.type: InferencePool`` adds. It selects exactly this service's serving pods (the
Service's selector: a multi-node service's group leaders only, the pods that serve HTTP), targets
the runtime's HTTP port, and names the picker's Service and its ext-proc port. A Gateway sends a
request for the pool to the picker, which answers with the pod to use; the picker's
``failureMode`` says what the Gateway does when the picker cannot be reached.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec


def serving_pod_labels(ref: ServiceRef, spec: InferenceSpec) -> dict[str, str]:
    """The labels of the pods that serve the OpenAI API: every runtime pod, or for a multi-node
    service each group's leader (LeaderWorkerSet's worker index 0)."""
    return names.leader_selector_labels(ref.name) if spec.multi_node else names.selector_labels(ref.name)


def build_inferencepool(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    return {
        **header(names.INFERENCE_POOL),
        "metadata": build_metadata(ref, names.INFERENCE_POOL),
        "spec": {
            "selector": {"matchLabels": serving_pod_labels(ref, spec)},
            "targetPorts": [{"number": names.RUNTIME_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": names.owned_name(ref.name, names.PICKER_SERVICE),
                "port": {"number": names.PICKER_EXT_PROC_PORT},
                "failureMode": spec.routing.picker.failure_mode,
            },
        },
    }
