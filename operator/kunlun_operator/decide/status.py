"""The status the user reads in ``kubectl get kis`` / ``kubectl describe kis``: phase and conditions.

Owns: what the runtime workload reports (read once), the replica count the service wants, the
phase decided from both, the conditions as status dicts, keeping ``lastTransitionTime`` when a
condition's status did not change. Pure: the clock comes in as ``now``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from kunlun_operator.spec.values import InferenceSpec

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]

PENDING: Final = "Pending"
PROGRESSING: Final = "Progressing"
READY: Final = "Ready"
DEGRADED: Final = "Degraded"
FAILED: Final = "Failed"
PHASES: tuple[Phase, ...] = get_args(Phase)


@dataclass(frozen=True, slots=True)
class DeploymentFacts:
    """What the runtime workload reports (its spec replicas and status): the Deployment, or for a
    multi-node service the LeaderWorkerSet, whose replicas are groups."""

    spec_replicas: int | None
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    generation: int = 0
    observed_generation: int = 0
    progressing_status: str | None = None  # the Deployment's own Progressing condition
    progressing_reason: str | None = None
    progressing_message: str | None = None

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> DeploymentFacts:
        """A Deployment's report: its counts and its own Progressing condition."""
        conditions = (obj.get("status") or {}).get("conditions") or []
        cond: Mapping[str, Any] = next((c for c in conditions if c.get("type") == "Progressing"), {})
        return dataclasses.replace(
            _read_counts(obj),
            progressing_status=cond.get("status"),
            progressing_reason=cond.get("reason"),
            progressing_message=cond.get("message"),
        )

    @classmethod
    def from_leaderworkerset(cls, obj: Mapping[str, Any]) -> DeploymentFacts:
        """A LeaderWorkerSet's report: the same counts, in groups (a group is ready when all its pods
        are). LWS has no progress deadline, so its conditions never make the phase Degraded."""
        return _read_counts(obj)


def _read_counts(obj: Mapping[str, Any]) -> DeploymentFacts:
    """What a Deployment and a LeaderWorkerSet report alike, read in one place: the replicas asked
    for (``spec.replicas``), those that exist, are ready and are updated, and which generation the
    workload's controller has seen."""
    status = obj.get("status") or {}
    return DeploymentFacts(
        spec_replicas=(obj.get("spec") or {}).get("replicas"),
        replicas=status.get("replicas") or 0,
        ready_replicas=status.get("readyReplicas") or 0,
        updated_replicas=status.get("updatedReplicas") or 0,
        generation=(obj.get("metadata") or {}).get("generation") or 0,
        observed_generation=status.get("observedGeneration") or 0,
    )


def desired_replicas(spec: InferenceSpec, workload: DeploymentFacts | None) -> int:
    """How many replicas the service wants, decided once per pass: the workload is built with it
    and the status reports readiness against it. ``spec.replicas``; with autoscaling the HPA owns
    the count, so what the workload has now (never reset), else ``autoscaling.minReplicas`` for a
    workload not created yet."""
    if not spec.autoscaling.enabled:
        return spec.replicas
    if workload is not None and workload.spec_replicas is not None:
        return workload.spec_replicas
    return spec.autoscaling.min_replicas


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: ConditionStatus
    reason: str
    message: str


def bool_status(flag: bool) -> ConditionStatus:
    """``"True"`` or ``"False"``: a condition that is known either way."""
    return "True" if flag else "False"


def decide_phase(
    deployment: DeploymentFacts | None,
    desired: int,
    *,
    num_compatible_nodes: int,
    locked: bool,
    workload: str = "Deployment",
) -> tuple[Phase, str, str]:
    """``(phase, reason, message)`` from the workload's report and the desired replica count;
    ``workload``: its kind (``Deployment``, ``LeaderWorkerSet``)."""
    if deployment is None:
        return PENDING, f"{workload}NotCreated", f"the runtime {workload} does not exist yet"
    ready, updated = deployment.ready_replicas, deployment.updated_replicas
    if deployment.progressing_reason == "ProgressDeadlineExceeded":
        return DEGRADED, "ProgressDeadlineExceeded", deployment.progressing_message or "rollout is stuck"
    rolled_out = deployment.observed_generation >= deployment.generation and updated >= desired
    if ready >= desired and rolled_out:
        return READY, "AllReplicasReady", f"{ready}/{desired} replicas ready"
    if ready == 0 and locked and num_compatible_nodes == 0:
        return (
            PENDING,
            "NoCompatibleNodes",
            "no node matches the locked versions; replicas cannot be scheduled",
        )
    if deployment.progressing_reason == "NewReplicaSetAvailable" and rolled_out:
        return (
            DEGRADED,
            "ReplicasUnavailable",
            f"{ready}/{desired} replicas ready after the rollout completed",
        )
    return PROGRESSING, "RollingOut", f"{ready}/{desired} replicas ready, {updated} updated"


def merge_conditions(
    new: Sequence[Condition], previous: Sequence[Mapping[str, Any]], *, now: str, generation: int
) -> list[dict[str, Any]]:
    """Conditions as status dicts; ``lastTransitionTime`` kept where the status did not change."""
    old = {c.get("type"): c for c in previous or []}
    out = []
    for cond in new:
        before = old.get(cond.type) or {}
        same = before.get("status") == cond.status
        out.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": before.get("lastTransitionTime", now) if same else now,
                "observedGeneration": generation,
            }
        )
    return out


def condition_status(conditions: Sequence[Mapping[str, Any]], type_: str) -> str | None:
    return next((c.get("status") for c in conditions or [] if c.get("type") == type_), None)
