"""The HorizontalPodAutoscaler (autoscaling/v2) on a vLLM serving metric, per pod.

The metric reaches the HPA through the custom metrics API (a Prometheus adapter rule exposing the
runtime's ``vllm:*`` series under the same names; docs/operator.md). The HPA scales the
Deployment, or for a multi-node service the LeaderWorkerSet (its scale subresource counts groups,
and its pod selector, ``status.hpaPodSelector``, selects the leaders: the pods that serve and export
the metric); the operator then leaves the workload's replicas alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec, Metric

#: spec.autoscaling.metric -> the runtime's Prometheus metric name.
METRIC_NAMES: Mapping[Metric, str] = {
    "requestsWaiting": "vllm:num_requests_waiting",
    "requestsRunning": "vllm:num_requests_running",
    "kvCacheUsage": "vllm:kv_cache_usage_perc",
}
#: Scale down slowly: a replica costs minutes of model loading to bring back.
SCALE_DOWN_STABILIZATION_SECONDS = 300


def quantity(value: float) -> str:
    """A target as a Kubernetes quantity: 4 → "4", 0.8 → "800m"."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def build_hpa(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    auto = spec.autoscaling
    target = names.LEADER_WORKER_SET if spec.multi_node else names.DEPLOYMENT
    return {
        **header(names.HPA),
        "metadata": build_metadata(ref, names.HPA),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": target.api_version,
                "kind": target.kind,
                "name": names.owned_name(ref.name, target),
            },
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": METRIC_NAMES[auto.metric]},
                        "target": {"type": "AverageValue", "averageValue": quantity(auto.effective_target)},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_STABILIZATION_SECONDS}},
        },
    }
