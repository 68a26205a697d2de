"""The LeaderWorkerSet of a multi-node service: one group of pods per replica.

Owns: the ``leaderworkerset.x-k8s.io/v1`` object that replaces the Deployment when
``spec.runtime.pipelineParallelSize`` P > 1, and the check that the cluster serves it. Each replica
is a group of P pods, one pipeline stage each: the leader (``LWS_WORKER_INDEX`` 0) serves HTTP and
hosts the rendezvous; the workers run the same ``serve`` command headless. Both pod templates come
from ``pod_template.build_pod_template`` (the Deployment's: the same version lock, preflight,
resources per pod, security context, env and volumes), then differ only in the runtime container's
ports, probes and stop.
Invariant: a group starts and restarts as a unit (``RecreateGroupOnPodRestart``): a stage cannot
rejoin a running pipeline, so one failed pod recreates its whole group.
"""

from __future__ import annotations

import re
from typing import Any, Unpack

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.builders.kv_events import without_kv_events
from kunlun_operator.builders.pod_template import TERMINATION_GRACE_SECONDS, TemplateArgs, build_pod_template
from kunlun_operator.errors import SpecError
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

#: The rendezvous port on the leader (``--master-port``); workers connect to it.
RENDEZVOUS_PORT = {
    "name": names.RENDEZVOUS_PORT_NAME,
    "containerPort": names.RENDEZVOUS_PORT,
    "protocol": "TCP",
}
#: A worker's stop waits this long before SIGTERM: its stage must keep serving while the leader
#: drains in-flight generations (the worker exits by itself once the leader shuts down cleanly).
WORKER_STOP_SECONDS = TERMINATION_GRACE_SECONDS - 5
#: How often a service waiting for LeaderWorkerSet to be installed is checked again.
LEADERWORKERSET_RECHECK_SECONDS = 60.0
_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def require_leaderworkerset(spec: InferenceSpec, served: bool) -> SpecError | None:
    """The error a multi-node ``spec`` gets where the cluster does not serve LeaderWorkerSet
    (admission denies it; reconcile reports it in the conditions); None when it can be served."""
    if not spec.multi_node or served:
        return None
    return SpecError(
        "spec.runtime.pipelineParallelSize",
        f"{spec.runtime.pipeline_parallel_size} nodes per replica need LeaderWorkerSet "
        f"({names.LWS_GROUP_VERSION}), which this cluster does not serve: install LeaderWorkerSet "
        "(https://lws.sigs.k8s.io; with the kunlun-inference chart also set "
        "leaderWorkerSet.installed=true), or set pipelineParallelSize to 1",
        reason="LeaderWorkerSetNotInstalled",
    )


def leaderworkerset_name_error(instance: str) -> SpecError | None:
    """The error of a multi-node service whose LeaderWorkerSet name would be refused: LWS names its
    headless Service after itself, so the name must be a DNS-1035 label (LWS's own webhook checks it).
    """
    lws_name = names.owned_name(instance, names.LEADER_WORKER_SET)
    if _DNS_1035_LABEL.match(lws_name):
        return None
    return SpecError(
        "metadata.name",
        f"a multi-node service's LeaderWorkerSet {lws_name!r} must be a DNS-1035 label (at most 63 "
        "lower-case letters, digits and '-', starting with a letter): rename the service",
    )


def _runtime_container(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = next(c for c in pod["containers"] if c["name"] == "runtime")
    return container


def build_leader_pod_spec(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` (from ``pod_template.build_pod_spec``) as the group's leader: HTTP, probes, and the rendezvous port.

    Its startup probe already covers the group (``feasibility.startup_budget_seconds``): the
    leader's /health answers 200 only once every stage has loaded and passed the collective
    preflight.
    """
    runtime = _runtime_container(pod)
    runtime["ports"] = [*runtime["ports"], dict(RENDEZVOUS_PORT)]
    return pod


def build_worker_pod_spec(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` (from ``pod_template.build_pod_spec``) as a worker: headless, no HTTP port, no HTTP probes (a
    worker that loses its group exits, and LeaderWorkerSet recreates the group), no KV events port."""
    runtime = _runtime_container(pod)
    del runtime["ports"]
    runtime["args"] = without_kv_events(runtime["args"])  # the leader's engine publishes them
    for probe in _PROBES:
        del runtime[probe]
    runtime["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(WORKER_STOP_SECONDS)]}}}
    return pod


def build_leaderworkerset(
    ref: ServiceRef, spec: InferenceSpec, *, replicas: int, **template: Unpack[TemplateArgs]
) -> dict[str, Any]:
    """The LeaderWorkerSet with ``replicas`` groups of ``spec.runtime.pipelineParallelSize`` pods, each
    the pod ``template`` describes (``pod_template.build_pod_template``'s arguments) in its role."""
    leader = build_pod_template(ref, spec, **template)
    build_leader_pod_spec(leader["spec"])
    worker = build_pod_template(ref, spec, **template)
    build_worker_pod_spec(worker["spec"])
    return {
        **header(names.LEADER_WORKER_SET),
        "metadata": build_metadata(ref, names.LEADER_WORKER_SET),
        "spec": {
            "replicas": replicas,
            # Workers start with the leader, not after it is Ready: the leader is Ready only once
            # the whole group has loaded (LeaderReady would wait forever).
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxUnavailable": spec.max_unavailable,
                    "maxSurge": spec.max_surge,
                },
            },
            "leaderWorkerTemplate": {
                "size": spec.runtime.pipeline_parallel_size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
