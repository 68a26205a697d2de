"""The pure reconcile: which objects, which status, which events, for which facts."""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.decide.reconcile import PodFacts, reconcile
from kunlun_operator.decide.status import DeploymentFacts
from kunlun_operator.policy.admission_policy import AdmissionPolicy
from kunlun_operator.policy.matrix import parse_matrix
from kunlun_operator.spec.service import parse_spec_or_error
from tests.unit.operator.factories import NOW, make_facts, make_node, make_raw_spec, make_ref

LATER = "2026-01-01T00:05:00Z"


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def _deployment(ready: int, *, desired: int = 1, reason: str = "ReplicaSetUpdated") -> DeploymentFacts:
    return DeploymentFacts(
        spec_replicas=desired,
        replicas=desired,
        ready_replicas=ready,
        updated_replicas=desired,
        generation=2,
        observed_generation=2,
        progressing_status="True",
        progressing_reason=reason,
    )


def test_new_service_plans_its_objects_and_is_pending() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(), now=NOW)
    assert [o["kind"] for o in plan.apply] == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget"]
    assert plan.delete == (names.HPA,)
    assert plan.status["phase"] == "Pending"
    assert plan.status["ready"] == "0/1"
    assert plan.status["endpoint"] == "http://qwen.ml.svc:8000/v1"
    assert plan.status["selector"] == "app.kubernetes.io/instance=qwen,app.kubernetes.io/name=kunlun-runtime"
    assert plan.status["compatibleNodes"] == 1
    assert _conditions(plan.status) == {
        "Ready": ("False", "DeploymentNotCreated"),
        "Progressing": ("False", "DeploymentNotCreated"),
        "VersionsCompatible": ("True", "VersionsLocked"),
        "DevicesAvailable": ("True", "CompatibleNodesFound"),
        "ModelAvailable": ("Unknown", "NotLoadedYet"),
        "ReplicasHealthy": ("True", "AllCardsHealthy"),
        "CardHealthReported": ("True", "HealthReported"),
        "RuntimeImageAvailable": ("Unknown", "NotPulledYet"),
    }
    assert plan.status["replicaReplacements"] == 0
    assert plan.events == ()


def test_phase_follows_the_deployment() -> None:
    def phase(deployment: DeploymentFacts) -> str:
        return reconcile(
            make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(deployment=deployment), now=NOW
        ).status["phase"]

    assert phase(_deployment(0)) == "Progressing"
    assert phase(_deployment(1)) == "Ready"
    assert phase(_deployment(0, reason="NewReplicaSetAvailable")) == "Degraded"
    assert phase(_deployment(0, reason="ProgressDeadlineExceeded")) == "Degraded"


def test_ready_transition_emits_one_event_and_keeps_transition_times() -> None:
    first = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(deployment=_deployment(0)), now=NOW
    )
    ready = reconcile(
        make_ref(),
        parse_spec_or_error(make_raw_spec()),
        first.status,
        make_facts(deployment=_deployment(1)),
        now=LATER,
    )
    again = reconcile(
        make_ref(),
        parse_spec_or_error(make_raw_spec()),
        ready.status,
        make_facts(deployment=_deployment(1)),
        now=LATER,
    )
    assert [(e.type, e.reason) for e in ready.events] == [("Normal", "Ready")]
    assert again.events == ()
    times = {c["type"]: c["lastTransitionTime"] for c in ready.status["conditions"]}
    assert times == {
        "Ready": LATER,
        "Progressing": LATER,
        "VersionsCompatible": NOW,
        "DevicesAvailable": NOW,
        "ModelAvailable": LATER,
        "ReplicasHealthy": NOW,
        "CardHealthReported": NOW,
        "RuntimeImageAvailable": NOW,
    }
    assert ready.status["ready"] == "1/1"


def test_no_compatible_nodes_lists_what_the_kunlun_nodes_have() -> None:
    nodes = (make_node("a", driver="5.0.20"), make_node("b", driver="5.0.20"), make_node("c", kunlun=False))
    plan = reconcile(
        make_ref(),
        parse_spec_or_error(make_raw_spec()),
        None,
        make_facts(nodes=nodes, deployment=_deployment(0)),
        now=NOW,
    )
    devices = next(c for c in plan.status["conditions"] if c["type"] == "DevicesAvailable")
    assert devices["status"] == "False" and devices["reason"] == "NoCompatibleNodes"
    assert devices["message"] == (
        "no Kunlun node matches driver=5.0.21.26 firmware=1.0.2.14.1.54 kml=3.2.0 xpus>=1; Kunlun nodes have: "
        "driver=5.0.20 firmware=1.0.2.14.1.54 kml=3.2.0 product=P800 xpus=8 (2 nodes)"
    )
    assert plan.status["phase"] == "Pending" and plan.status["compatibleNodes"] == 0
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "NoCompatibleNodes")]


def test_no_kunlun_nodes_at_all() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(nodes=()), now=NOW)
    assert _conditions(plan.status)["DevicesAvailable"] == ("False", "NoKunlunNodes")


def test_warn_policy_reports_pods_on_mismatching_nodes() -> None:
    raw = make_raw_spec(
        versions={"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0", "policy": "Warn"}
    )
    nodes = (make_node("good"), make_node("old", kml="3.1.0"))
    pods = (PodFacts("qwen-1", "good"), PodFacts("qwen-2", "old"), PodFacts("qwen-3", None))
    plan = reconcile(make_ref(), parse_spec_or_error(raw), None, make_facts(nodes=nodes, pods=pods), now=NOW)
    versions = next(c for c in plan.status["conditions"] if c["type"] == "VersionsCompatible")
    assert (versions["status"], versions["reason"]) == ("False", "PodsOnMismatchedNodes")
    assert versions["message"] == "qwen-2 on old: kml 3.1.0 (want 3.2.0)"
    assert [(e.type, e.reason, e.message) for e in plan.events] == [
        ("Warning", "PodsOnMismatchedNodes", "qwen-2 on old: kml 3.1.0 (want 3.2.0)")
    ]
    assert "affinity" not in plan.apply[2]["spec"]["template"]["spec"]


def test_unsupported_versions_fail_under_strict_and_only_warn_under_warn() -> None:
    strict = make_raw_spec(versions={"driver": "9.9.9", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"})
    plan = reconcile(make_ref(), parse_spec_or_error(strict), None, make_facts(), now=NOW)
    assert plan.apply == () and plan.delete == ()
    assert plan.status["phase"] == "Failed"
    assert plan.status["lastFailure"] == {
        "reason": "UnsupportedVersions",
        "time": NOW,
        "message": "spec.versions.driver: driver 9.9.9 is not supported by runtime 0.1.0 (supported: 5.0.21.26)",
    }
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "UnsupportedVersions")]
    again = reconcile(make_ref(), parse_spec_or_error(strict), plan.status, make_facts(), now=LATER)
    assert again.events == () and again.status["lastFailure"]["time"] == NOW

    warn = make_raw_spec(
        versions={"driver": "9.9.9", "firmware": "1.0.2.14.1.54", "kml": "3.2.0", "policy": "Warn"}
    )
    plan = reconcile(make_ref(), parse_spec_or_error(warn), None, make_facts(), now=NOW)
    assert len(plan.apply) == 4
    assert _conditions(plan.status)["VersionsCompatible"] == ("False", "UnsupportedVersions")


def test_invalid_spec_is_a_failed_plan_naming_the_field() -> None:
    plan = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec(resources={"xpus": 0})), None, make_facts(), now=NOW
    )
    assert plan.apply == ()
    assert plan.status["phase"] == "Failed"
    assert plan.status["lastFailure"]["message"] == "spec.resources.xpus: must be ≥ 1, got 0"


def test_autoscaling_leaves_existing_replicas_to_the_hpa() -> None:
    raw = make_raw_spec(autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 5})
    fresh = reconcile(make_ref(), parse_spec_or_error(raw), None, make_facts(), now=NOW)
    assert fresh.apply[2]["spec"]["replicas"] == 2
    assert [o["kind"] for o in fresh.apply][-1] == "HorizontalPodAutoscaler" and fresh.delete == ()
    running = reconcile(
        make_ref(), parse_spec_or_error(raw), None, make_facts(deployment=_deployment(3, desired=4)), now=NOW
    )
    assert running.apply[2]["spec"]["replicas"] == 4  # whatever the HPA chose, never reset
    assert running.live_fields == {"Deployment": (("spec", "replicas"),)}  # even if it changes meanwhile
    assert (
        reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(), now=NOW).live_fields
        == {}
    )
    assert running.status["ready"] == "3/4"


def test_monitoring_objects_only_when_the_prometheus_operator_is_served() -> None:
    served = frozenset({"servicemonitors", "prometheusrules"})
    with_crds = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(monitoring_plurals=served), now=NOW
    )
    assert [o["kind"] for o in with_crds.apply][-2:] == ["ServiceMonitor", "PrometheusRule"]
    disabled = reconcile(
        make_ref(),
        parse_spec_or_error(make_raw_spec(monitoring={"prometheusRule": False})),
        None,
        make_facts(monitoring_plurals=served),
        now=NOW,
    )
    assert disabled.delete == (names.HPA, names.PROMETHEUS_RULE)
    assert [o["kind"] for o in disabled.apply][-1] == "ServiceMonitor"


def test_missing_pvc_is_reported() -> None:
    plan = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(pvc_exists=False), now=NOW
    )
    assert _conditions(plan.status)["ModelAvailable"] == ("False", "PVCNotFound")


def _image(plan: Any) -> str:
    deployment = next(o for o in plan.apply if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    images = {c["image"] for c in [*pod.get("initContainers", []), *pod["containers"]]}
    assert len(images) == 1  # the preflight runs in the runtime's image
    return images.pop()


MATRIX_WITH_IMAGES = """
registry: reg.io/kl
entries:
- {runtime: 0.2.0, image: 'kunlun-runtime:0.2.0-kunlun', driver: ['6.0'], firmware: ['1.0.2.14.1.54'], kml: ['3.2.0']}
- {runtime: 0.1.0, image: 'kunlun-runtime:0.1.0-kunlun', driver: ['5.0.21.26'], firmware: ['1.0.2.14.1.54'],
   kml: ['3.2.0']}
"""


def test_without_an_image_the_service_runs_the_matrix_entrys_image() -> None:
    matrix = parse_matrix(MATRIX_WITH_IMAGES, source="t")
    facts = make_facts(matrix=matrix, default_image="fallback.io/rt:0.0.1")
    plan = reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, facts, now=NOW)
    assert _image(plan) == "reg.io/kl/kunlun-runtime:0.1.0-kunlun"
    assert plan.status["phase"] == "Pending"
    newer = make_raw_spec(versions={"driver": "6.0", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"})
    assert (
        _image(reconcile(make_ref(), parse_spec_or_error(newer), None, facts, now=NOW))
        == "reg.io/kl/kunlun-runtime:0.2.0-kunlun"
    )
    # the packaged matrix: the release's kunlun variant
    assert _image(
        reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(), now=NOW)
    ) == ("ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun")


def test_the_default_runtime_image_is_only_the_fallback() -> None:
    matrix = parse_matrix(
        "entries:\n- {runtime: 0.1.0, driver: ['5.0.21.26'], firmware: ['1.0.2.14.1.54'], kml: ['3.2.0']}\n",
        source="t",
    )
    facts = make_facts(matrix=matrix, default_image="fallback.io/rt:0.1.0")
    assert (
        _image(reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, facts, now=NOW))
        == "fallback.io/rt:0.1.0"
    )


def test_a_services_own_image_overrides_the_matrix_under_the_admission_policy() -> None:
    facts = make_facts(
        matrix=parse_matrix(MATRIX_WITH_IMAGES, source="t"),
        policy=AdmissionPolicy(runtime_images=("reg.io/kl/",)),
    )
    own = make_raw_spec(runtime={"image": "reg.io/kl/kunlun-runtime:0.1.0-kunlun-debug"})
    plan = reconcile(make_ref(), parse_spec_or_error(own), None, facts, now=NOW)
    assert plan.status["phase"] == "Failed"  # its tag names no runtime version in the matrix
    own = make_raw_spec(runtime={"image": "reg.io/kl/kunlun-runtime:0.1.0"})
    assert (
        _image(reconcile(make_ref(), parse_spec_or_error(own), None, facts, now=NOW))
        == "reg.io/kl/kunlun-runtime:0.1.0"
    )
    outside = make_raw_spec(runtime={"image": "evil.io/kunlun-runtime:0.1.0-kunlun"})
    plan = reconcile(make_ref(), parse_spec_or_error(outside), None, facts, now=NOW)
    assert plan.apply == ()
    assert plan.status["lastFailure"]["reason"] == "PolicyViolation"
    assert "spec.runtime.image" in plan.status["lastFailure"]["message"]
