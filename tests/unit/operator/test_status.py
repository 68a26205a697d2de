"""The workload's report read once, and the replica count decided once per pass."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kunlun_operator.decide.reconcile import reconcile
from kunlun_operator.decide.status import DeploymentFacts, desired_replicas
from kunlun_operator.spec.service import parse_spec, parse_spec_or_error
from tests.unit.operator.factories import NOW, make_facts, make_raw_spec, make_ref

WORKLOAD: dict[str, Any] = {
    "metadata": {"generation": 4},
    "spec": {"replicas": 3},
    "status": {
        "replicas": 3,
        "readyReplicas": 2,
        "updatedReplicas": 1,
        "observedGeneration": 3,
        "conditions": [
            {"type": "Available", "status": "True"},
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "stuck",
            },
        ],
    },
}
COUNTS = DeploymentFacts(
    spec_replicas=3, replicas=3, ready_replicas=2, updated_replicas=1, generation=4, observed_generation=3
)


def test_a_deployment_and_a_leaderworkerset_report_the_same_counts_and_only_a_deployment_progress() -> None:
    assert DeploymentFacts.from_leaderworkerset(WORKLOAD) == COUNTS
    assert DeploymentFacts.from_object(WORKLOAD) == dataclasses.replace(
        COUNTS,
        progressing_status="False",
        progressing_reason="ProgressDeadlineExceeded",
        progressing_message="stuck",
    )


def test_a_workload_that_reports_nothing_yet_counts_zero() -> None:
    empty = DeploymentFacts(spec_replicas=None)
    assert DeploymentFacts.from_object({}) == DeploymentFacts.from_leaderworkerset({"status": None}) == empty


AUTOSCALED = {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}}


@pytest.mark.parametrize(
    ("overrides", "workload", "desired"),
    [
        ({"replicas": 3}, None, 3),
        ({"replicas": 3}, DeploymentFacts(spec_replicas=5), 3),  # without autoscaling the spec wins
        (AUTOSCALED, None, 2),  # not created yet: minReplicas
        (AUTOSCALED, DeploymentFacts(spec_replicas=None), 2),
        (AUTOSCALED, DeploymentFacts(spec_replicas=5), 5),  # the HPA's choice is never reset
    ],
    ids=["spec", "spec-over-workload", "hpa-no-workload", "hpa-no-count", "hpa-count"],
)
def test_desired_replicas(overrides: dict[str, Any], workload: DeploymentFacts | None, desired: int) -> None:
    assert desired_replicas(parse_spec(make_raw_spec(**overrides)), workload) == desired


def test_the_workload_is_built_with_the_count_the_status_reports() -> None:
    workload = DeploymentFacts(spec_replicas=5, replicas=5, ready_replicas=4, updated_replicas=5)
    plan = reconcile(
        make_ref(),
        parse_spec_or_error(make_raw_spec(**AUTOSCALED)),
        None,
        make_facts(deployment=workload),
        now=NOW,
    )
    [deployment] = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert (deployment["spec"]["replicas"], plan.status["ready"]) == (5, "4/5")
