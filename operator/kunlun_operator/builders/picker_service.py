"""The Endpoint Picker's Service: the address the InferencePool names for the Gateway.

Owns: the ``<name>-epp`` ClusterIP Service in front of the picker's pods: the ext-proc port the
InferencePool's ``endpointPickerRef`` names (HTTP/2, ``appProtocol: kubernetes.io/h2c``, so a
Gateway speaks gRPC to it in cleartext) and the picker's metrics.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import PICKER_LABELS, build_metadata, header
from kunlun_operator.spec.service import ServiceRef


def build_picker_service(ref: ServiceRef) -> dict[str, Any]:
    return {
        **header(names.PICKER_SERVICE),
        "metadata": build_metadata(ref, names.PICKER_SERVICE, labels=PICKER_LABELS),
        "spec": {
            "type": "ClusterIP",
            "selector": names.picker_selector_labels(ref.name),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": names.PICKER_EXT_PROC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {
                    "name": "http-metrics",
                    "port": names.PICKER_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
