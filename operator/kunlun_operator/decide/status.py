"""The status the user reads in ``kubectl get kis`` / ``kubectl describe kis``: phase and conditions.

Owns: deciding the phase from what the Deployment reports, the five conditions with their reasons,
and keeping ``lastTransitionTime`` when a condition's status did not change. Pure: the clock comes
in as ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

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
        status = obj.get("status") or {}
        cond: Mapping[str, Any] = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {}
        )
        return cls(
            spec_replicas=(obj.get("spec") or {}).get("replicas"),
            replicas=status.get("replicas") or 0,
            ready_replicas=status.get("readyReplicas") or 0,
            updated_replicas=status.get("updatedReplicas") or 0,
            generation=(obj.get("metadata") or {}).get("generation") or 0,
            observed_generation=status.get("observedGeneration") or 0,
            progressing_status=cond.get("status"),
            progressing_reason=cond.get("reason"),
            progressing_message=cond.get("message"),
        )

    @classmethod
    def from_leaderworkerset(cls, obj: Mapping[str, Any]) -> DeploymentFacts:
        """A LeaderWorkerSet's report: the same counts, in groups (a group is ready when all its pods
        are). LWS has no progress deadline, so its conditions never make the phase Degraded."""
        status = obj.get("status") or {}
        return cls(
            spec_replicas=(obj.get("spec") or {}).get("replicas"),
            replicas=status.get("replicas") or 0,
            ready_replicas=status.get("readyReplicas") or 0,
            updated_replicas=status.get("updatedReplicas") or 0,
            generation=(obj.get("metadata") or {}).get("generation") or 0,
            observed_generation=status.get("observedGeneration") or 0,
        )


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
