"""The ServiceMonitor (Prometheus Operator) scraping the runtime's ``/metrics``."""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec import InferenceSpec, ServiceRef


def build_servicemonitor(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    return {
        **header(names.SERVICE_MONITOR),
        "metadata": build_metadata(ref, names.SERVICE_MONITOR, labels=spec.monitoring.labels),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(ref.name)},
            "endpoints": [
                {
                    "port": names.RUNTIME_PORT_NAME,
                    "path": names.METRICS_PATH,
                    "interval": spec.monitoring.interval,
                }
            ],
        },
    }
