"""The ServiceMonitor (Prometheus Operator) scraping the runtime's ``/metrics``.

With ``spec.metricsTokenSecretRef`` the runtime wants ``Authorization: Bearer <token>`` on
``/metrics``: the endpoint's ``authorization`` (Prometheus Operator ≥ 0.48; ``bearerTokenSecret``
is its deprecated predecessor) makes Prometheus read the token from the same Secret. It selects the
service's Service, so Prometheus scrapes that Service's endpoints: for a multi-node service the
leaders only (the workers serve no /metrics).
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec


def build_servicemonitor(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    endpoint: dict[str, Any] = {
        "port": names.RUNTIME_PORT_NAME,
        "path": names.METRICS_PATH,
        "interval": spec.monitoring.interval,
    }
    token = spec.metrics_token_secret
    if token is not None:
        endpoint["authorization"] = {"type": "Bearer", "credentials": {"name": token.name, "key": token.key}}
    return {
        **header(names.SERVICE_MONITOR),
        "metadata": build_metadata(ref, names.SERVICE_MONITOR, labels=spec.monitoring.labels),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(ref.name)},
            "endpoints": [endpoint],
        },
    }
