"""The Deployment of a single-node service: its replicas, selector, rollout and the pod template.

Owns: the ``apps/v1`` Deployment that runs the runtime pods when ``spec.runtime.pipelineParallelSize``
is 1 (``leaderworkerset`` builds the multi-node workload). The pod itself, with its version lock,
preflight, probes and draining, is ``pod_template``'s, shared with the LeaderWorkerSet. The rollout
follows ``spec.rollout``; its progress deadline covers the model's startup budget, so a slow load is
not reported as a failed rollout.
"""

from __future__ import annotations

from typing import Any, Unpack

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.builders.pod_template import TemplateArgs, build_pod_template
from kunlun_operator.policy.feasibility import startup_budget_seconds
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

#: Old ReplicaSets kept for ``kubectl rollout undo``.
REVISION_HISTORY_LIMIT = 3
#: How long past the startup budget a rollout may take before the Deployment reports no progress.
PROGRESS_MARGIN_SECONDS = 300


def build_deployment(
    ref: ServiceRef, spec: InferenceSpec, *, replicas: int, **template: Unpack[TemplateArgs]
) -> dict[str, Any]:
    """The runtime Deployment with ``replicas`` replicas of the pod ``template`` describes
    (``pod_template.build_pod_template``'s arguments)."""
    deploy_spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": names.selector_labels(ref.name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": spec.max_surge, "maxUnavailable": spec.max_unavailable},
        },
        "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
        "progressDeadlineSeconds": startup_budget_seconds(spec) + PROGRESS_MARGIN_SECONDS,
        "template": build_pod_template(ref, spec, **template),
    }
    return {
        **header(names.DEPLOYMENT),
        "metadata": build_metadata(ref, names.DEPLOYMENT),
        "spec": deploy_spec,
    }
