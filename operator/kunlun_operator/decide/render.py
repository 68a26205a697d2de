"""The dry run as a pure function: a custom resource and the facts of a fresh cluster → its objects.

Owns: what ``kunlun-operator render`` says of one KunlunInferenceService: the admission webhook's
verdict (``admission.review``) and then the objects of the first reconcile (``reconcile.reconcile``)
of a service that is new to the cluster: no status yet, no workload, no pods. No code of its own
builds or checks anything, so what it prints is what the operator creates. Must not read files or
talk to the API (the shell, ``shell/render.py``, does). Invariant: either objects or an error that
names the field, never both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kunlun_operator.decide import admission
from kunlun_operator.decide.reconcile import ClusterFacts, reconcile
from kunlun_operator.decide.status import FAILED
from kunlun_operator.spec.service import parse_service

#: The reconcile's clock: it dates conditions only, which a rendering does not show.
RENDER_TIME = "1970-01-01T00:00:00Z"


@dataclass(frozen=True, slots=True)
class Rendering:
    """The objects the operator would apply for one service, in apply order, or why none."""

    objects: tuple[dict[str, Any], ...] = ()
    #: The admission denial or the reconcile's failure (``field: message``); None when served.
    error: str | None = None
    #: Why, in the words of the status (``InvalidSpec``, ``UnsupportedVersions`` …).
    reason: str | None = None
    warnings: tuple[str, ...] = field(default=())  # the webhook's warnings to the user


def render_service(body: Mapping[str, Any], facts: ClusterFacts, *, admission_webhook: bool) -> Rendering:
    """What the operator does with the custom resource ``body`` on a cluster with ``facts``.

    ``admission_webhook``: the operator's webhook runs (``--webhook-port`` not 0), so a resource it
    denies is never created; without it the reconcile alone decides (and reports a Failed status).
    """
    service = parse_service(body)
    warnings: tuple[str, ...] = ()
    if admission_webhook:
        verdict = admission.review(
            service.spec,
            facts.matrix,
            facts.default_image,
            facts.policy,
            leaderworkerset_served=facts.leaderworkerset_served,
            inference_pool_served=facts.inference_pool_served,
            httproute_served=facts.httproute_served,
            dra_served=facts.dra_served,
            name=service.ref.name,
        )
        if verdict.denial is not None:
            return Rendering(
                error=str(verdict.denial), reason=verdict.denial.reason, warnings=verdict.warnings
            )
        warnings = verdict.warnings
    plan = reconcile(service.ref, service.spec, None, facts, now=RENDER_TIME)
    if plan.status["phase"] == FAILED:
        failure = plan.status["lastFailure"]
        return Rendering(error=failure["message"], reason=failure["reason"], warnings=warnings)
    return Rendering(objects=plan.apply, warnings=warnings)
