"""The Endpoint Picker's Service: the address the InferencePool names for the Gateway.

Owns: the ``<name>-epp`` ClusterIP Service in front of the picker's pods: the ext-proc port the
InferencePool's ``endpointPickerRef`` names and the picker's metrics. The picker serves ext-proc
over TLS (its ``--secure-serving`` default: a self-signed certificate), so the port declares no
``appProtocol`` (as the extension's own chart): ``kubernetes.io/h2c`` would tell the Gateway to
speak cleartext HTTP/2 to a TLS server. Gateways that check the certificate must be told to skip
it (Istio: a DestinationRule ``tls: {mode: SIMPLE, insecureSkipVerify: true}``; docs/operator.md).
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
