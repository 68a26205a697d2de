"""``spec.resources.allocation: dra``: the claim template, the pods that claim it, admission, the
reconcile's plan and the ``DevicesAvailable`` condition read from ResourceSlices."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import kubernetes_validate
import pytest

from kunlun_operator import names
from kunlun_operator.builders.leaderworkerset import build_leaderworkerset
from kunlun_operator.decide import admission
from kunlun_operator.decide.allocation import PendingClaim, pending_claim
from kunlun_operator.decide.reconcile import PodFacts, desired_objects, reconcile
from kunlun_operator.decide.status import desired_replicas
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.matrix import load_default_matrix
from kunlun_operator.spec.service import parse_spec, parse_spec_or_error
from tests.unit.operator.crd_schema import load_lws_crd, validate_cr
from tests.unit.operator.factories import (
    NOW,
    OWNER,
    load_example,
    make_cr,
    make_facts,
    make_raw_spec,
    make_ref,
)
from tests.unit.operator.test_dra_cel import node_slice

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun"
SEMVER_LOCK = (
    'has(device.attributes["xpu.kunlun.dev"].driverVersion) && '
    'device.attributes["xpu.kunlun.dev"].driverVersion.compareTo(semver("5.0.21-26")) == 0 && '
    'has(device.attributes["xpu.kunlun.dev"].firmwareVersion) && '
    'device.attributes["xpu.kunlun.dev"].firmwareVersion.compareTo(semver("1.0.2-14.1.54")) == 0 && '
    'has(device.attributes["xpu.kunlun.dev"].kmlVersion) && '
    'device.attributes["xpu.kunlun.dev"].kmlVersion.compareTo(semver("3.2.0")) == 0'
)
LABELS = names.common_labels("qwen")


def dra_raw(**resources: Any) -> dict[str, Any]:
    return make_raw_spec(
        resources={"allocation": "dra", "xpus": 2, **resources}, runtime={"tensorParallelSize": 2}
    )


def plan_objects(raw: dict[str, Any], **facts: Any) -> dict[str, dict[str, Any]]:
    spec = parse_spec(raw)
    objects, _ = desired_objects(
        make_ref(), spec, make_facts(dra_served=True, **facts), IMAGE, replicas=desired_replicas(spec, None)
    )
    return {o["kind"]: o for o in objects}


def test_the_claim_template_is_exactly_this() -> None:
    template = plan_objects(dra_raw(xpus=2, xpuProduct="P800-OAM"))["ResourceClaimTemplate"]
    claim_spec = {
        "devices": {
            "requests": [
                {
                    "name": "xpus",
                    "exactly": {
                        "deviceClassName": "xpu.kunlun.dev",
                        "allocationMode": "ExactCount",
                        "count": 2,
                        "selectors": [
                            {"cel": {"expression": SEMVER_LOCK}},
                            {
                                "cel": {
                                    "expression": 'has(device.attributes["xpu.kunlun.dev"].model) && '
                                    'device.attributes["xpu.kunlun.dev"].model.matches('
                                    '"^[^A-Za-z0-9]*P800(?:-|[^A-Za-z0-9._-]+)OAM[^A-Za-z0-9]*$")'
                                }
                            },
                        ],
                    },
                }
            ],
            "constraints": [{"requests": ["xpus"], "matchAttribute": "xpu.kunlun.dev/linkGroup"}],
        }
    }
    assert template == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": template["metadata"]["name"],
            "namespace": "ml",
            "labels": LABELS,
            "ownerReferences": OWNER,
        },
        "spec": {"metadata": {"labels": LABELS}, "spec": claim_spec},
    }
    assert template["metadata"]["name"].startswith("qwen-xpus-") and len(template["metadata"]["name"]) == 20


def test_a_new_claim_spec_is_a_new_template_name_and_the_pods_follow_it() -> None:
    one, two = plan_objects(dra_raw(xpus=2)), plan_objects(dra_raw(xpus=4))
    first, second = (o["ResourceClaimTemplate"]["metadata"]["name"] for o in (one, two))
    assert first != second
    assert plan_objects(dra_raw(xpus=2))["ResourceClaimTemplate"]["metadata"]["name"] == first
    for objects, name in ((one, first), (two, second)):
        claims = objects["Deployment"]["spec"]["template"]["spec"]["resourceClaims"]
        assert claims == [{"name": "xpus", "resourceClaimTemplateName": name}]


def test_policy_warn_locks_no_versions_in_the_claim() -> None:
    raw = dra_raw()
    raw["versions"]["policy"] = "Warn"
    exactly = plan_objects(raw)["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert "selectors" not in exactly


@pytest.mark.parametrize("multi_node", [False, True])
def test_dra_pods_claim_their_cards_and_never_name_the_extended_resource(multi_node: bool) -> None:
    raw = dra_raw(xpus=2)
    if multi_node:
        raw["runtime"]["pipelineParallelSize"] = 2
        raw["model"]["architecture"] = {"numLayers": 28, "numKVHeads": 4, "headDim": 128}
    objects = plan_objects(raw, leaderworkerset_served=True)
    template = objects["ResourceClaimTemplate"]["metadata"]["name"]
    if multi_node:
        lws = objects["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
        pods = [lws["leaderTemplate"]["spec"], lws["workerTemplate"]["spec"]]
    else:
        pods = [objects["Deployment"]["spec"]["template"]["spec"]]
    for pod in pods:
        text = json.dumps(pod)
        assert names.RESOURCE_NAME not in text.replace('"key": "kunlunxin.com/xpu"', "")  # toleration only
        assert names.LABEL_PRESENT not in text and names.LABEL_DRIVER_VERSION not in text
        assert pod["resourceClaims"] == [{"name": "xpus", "resourceClaimTemplateName": template}]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            if container["name"] in ("preflight", "runtime"):
                assert container["resources"]["claims"] == [{"name": "xpus"}]
        assert [c["name"] for c in pod["initContainers"]] == ["preflight"]
        # no node agent sets the gate's condition on a dra node: health comes as allocatedResourcesStatus
        assert "readinessGates" not in pod


def test_the_classic_pod_has_no_claim() -> None:
    spec = parse_spec(make_raw_spec())
    objects, _ = desired_objects(make_ref(), spec, make_facts(dra_served=True), IMAGE, replicas=1)
    assert "ResourceClaimTemplate" not in {o["kind"] for o in objects}
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "resourceClaims" not in pod
    assert pod["containers"][0]["resources"]["limits"] == {names.RESOURCE_NAME: "1"}
    assert pod["readinessGates"] == [{"conditionType": names.XPU_HEALTHY_CONDITION}]


@pytest.mark.parametrize("k8s_version", ["1.34.0", "1.37.0"])
def test_the_dra_example_and_a_multi_node_dra_service_are_valid_kubernetes(k8s_version: str) -> None:
    multi = dra_raw(xpus=2)
    multi["runtime"]["pipelineParallelSize"] = 2
    for raw in (load_example("kis-dra.yaml")["spec"], multi):
        for obj in plan_objects(raw, leaderworkerset_served=True).values():
            if obj["kind"] == "LeaderWorkerSet":
                assert validate_cr(obj, load_lws_crd())[1] == []
                for role in ("leaderTemplate", "workerTemplate"):
                    template = obj["spec"]["leaderWorkerTemplate"][role]
                    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
                    kubernetes_validate.validate(
                        {**pod_template, "template": template}, k8s_version, strict=True
                    )
            else:
                kubernetes_validate.validate(obj, k8s_version, strict=True)


def test_the_crd_and_the_parser_refuse_an_unknown_allocation_naming_the_field() -> None:
    raw = make_raw_spec(resources={"allocation": "hostDevices"})
    _, problems = validate_cr(make_cr(raw))
    assert [p.path for p in problems] == ["spec.resources.allocation"]
    error = parse_spec_or_error(raw)
    assert isinstance(error, SpecError) and error.field == "spec.resources.allocation"
    defaulted, problems = validate_cr(make_cr(make_raw_spec()))
    assert problems == [] and defaulted["spec"]["resources"]["allocation"] == "devicePlugin"


def test_admission_refuses_dra_where_it_is_not_enabled_naming_the_field() -> None:
    spec = parse_spec_or_error(dra_raw())
    matrix = load_default_matrix()
    denied = admission.review(spec, matrix, IMAGE, dra_served=False).denial
    assert denied is not None and denied.field == "spec.resources.allocation"
    assert "--dra" in denied.message and "resource.k8s.io/v1" in denied.message
    assert admission.review(spec, matrix, IMAGE, dra_served=True).allowed
    assert admission.review(parse_spec_or_error(make_raw_spec()), matrix, IMAGE, dra_served=False).allowed


def test_reconcile_without_dra_fails_the_service_and_looks_again() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(dra_raw()), None, make_facts(), now=NOW)
    assert plan.status["phase"] == "Failed" and plan.apply == ()
    assert plan.status["lastFailure"]["reason"] == "DRANotEnabled"
    assert plan.requeue_after_seconds == 60


def test_the_template_is_applied_before_the_pods_that_name_it_and_others_are_pruned() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(dra_raw()), None, make_facts(dra_served=True), now=NOW)
    kinds = [o["kind"] for o in plan.apply]
    assert kinds.index("ResourceClaimTemplate") < kinds.index("Deployment")
    assert plan.prune == (names.RESOURCE_CLAIM_TEMPLATE,)
    # a classic service prunes them too (switched back from dra), unless the operator has no rights
    classic = parse_spec_or_error(make_raw_spec())
    assert reconcile(make_ref(), classic, None, make_facts(dra_served=True), now=NOW).prune == (
        names.RESOURCE_CLAIM_TEMPLATE,
    )
    assert reconcile(make_ref(), classic, None, make_facts(), now=NOW).prune == ()


def devices_condition(raw: dict[str, Any], slices: list[dict[str, Any]], **facts: Any) -> dict[str, Any]:
    from kunlun_operator.decide.allocation import parse_slice_devices

    plan = reconcile(
        make_ref(),
        parse_spec_or_error(raw),
        None,
        make_facts(dra_served=True, devices=parse_slice_devices(slices), **facts),
        now=NOW,
    )
    found = {c["type"]: c for c in plan.status["conditions"]}["DevicesAvailable"]
    return {**found, "compatibleNodes": plan.status["compatibleNodes"], "events": plan.events}


def test_devices_available_counts_the_nodes_publishing_enough_matching_cards() -> None:
    found = devices_condition(dra_raw(xpus=2), [node_slice()])
    assert (found["status"], found["reason"], found["compatibleNodes"]) == ("True", "MatchingDevicesFound", 1)
    assert found["message"] == "1 node(s) publish enough matching devices: node-a"


def test_a_pod_of_all_eight_cards_with_tp_8_fits_the_fixture_node() -> None:
    raw = dra_raw(xpus=8)
    raw["runtime"]["tensorParallelSize"] = 8
    found = devices_condition(raw, [node_slice()])
    assert (found["status"], found["reason"], found["compatibleNodes"]) == ("True", "MatchingDevicesFound", 1)
    template = plan_objects(raw)["ResourceClaimTemplate"]
    assert "constraints" not in template["spec"]["spec"]["devices"]


def test_no_slices_at_all_asks_whether_the_dra_plugin_runs() -> None:
    found = devices_condition(dra_raw(), [])
    assert (found["status"], found["reason"]) == ("False", "NoResourceSlices")
    assert "is the DRA kubelet plugin running?" in found["message"]


def test_no_matching_device_names_the_attribute_and_what_the_cards_publish() -> None:
    mixed = node_slice(firmware={i: "1.0.2.14.1.50" for i in range(8)})
    found = devices_condition(dra_raw(), [mixed])
    assert (found["status"], found["reason"], found["compatibleNodes"]) == ("False", "NoMatchingDevices", 0)
    assert found["message"] == (
        "no device matches firmwareVersion 1.0.2.14.1.54: the 8 device(s) on 1 node(s) publish "
        "firmwareVersion 1.0.2-14.1.50 (8)"
    )
    assert [(e.type, e.reason) for e in found["events"]] == [("Warning", "NoMatchingDevices")]


def test_a_tp_claim_on_split_link_groups_says_so() -> None:
    found = devices_condition(dra_raw(xpus=2), [node_slice(unhealthy={1, 2, 3, 5, 6, 7})])
    assert found["reason"] == "NoMatchingDevices"
    assert found["message"] == "no node publishes 2 matching devices in one link group (2 of 2 devices match)"


def pending_pod(claim: str | None = "qwen-abc-xpus-x1y2") -> dict[str, Any]:
    return {
        "metadata": {"name": "qwen-abc"},
        "spec": {"resourceClaims": [{"name": "xpus", "resourceClaimTemplateName": "qwen-xpus-1"}]},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 cannot allocate all claims.",
                }
            ],
            **({"resourceClaimStatuses": [{"name": "xpus", "resourceClaimName": claim}]} if claim else {}),
        },
    }


def test_a_pod_pending_on_its_claim_is_read_from_the_scheduler_condition() -> None:
    assert pending_claim(pending_pod()) == PendingClaim(
        "qwen-abc", "qwen-abc-xpus-x1y2", "0/3 nodes are available: 3 cannot allocate all claims."
    )
    assert pending_claim(pending_pod(claim=None)) == dataclasses.replace(
        pending_claim(pending_pod()), claim=None
    )  # type: ignore[arg-type]
    scheduled = pending_pod()
    scheduled["spec"]["nodeName"] = "node-a"
    assert pending_claim(scheduled) is None
    classic = pending_pod()
    del classic["spec"]["resourceClaims"]
    assert pending_claim(classic) is None
    cpu = pending_pod()
    cpu["status"]["conditions"][0]["message"] = "0/3 nodes are available: 3 Insufficient cpu."
    assert pending_claim(cpu) is None


@pytest.mark.parametrize(
    ("message", "about_the_claim"),
    [
        ("0/3 nodes are available: 3 cannot allocate all claims.", True),
        ("0/3 nodes are available: 1 resourceclaim not available on the node, 2 Insufficient cpu.", True),
        (
            '0/3 nodes are available: 3 waiting for dynamic resource controller to create the resourceclaim "x".',
            True,
        ),
        ("0/1 nodes are available: 1 resourceclaim in use.", True),
        ('0/3 nodes are available: persistentvolumeclaim "models" not found.', False),
        ("0/3 nodes are available: 3 node(s) had unbound immediate PersistentVolumeClaims.", False),
    ],
)
def test_only_the_dra_schedulers_words_make_a_pending_claim(message: str, about_the_claim: bool) -> None:
    pod = pending_pod()
    pod["status"]["conditions"][0]["message"] = message
    assert (pending_claim(pod) is not None) is about_the_claim


def test_an_unschedulable_claim_is_named_with_why_no_card_matches() -> None:
    wrong_driver = node_slice()
    for device in wrong_driver["spec"]["devices"]:
        device["attributes"]["driverVersion"] = {"version": "5.0.20-3"}
    pod = PodFacts("qwen-abc", None, pending_claim=pending_claim(pending_pod()))
    found = devices_condition(dra_raw(), [wrong_driver], pods=(pod,))
    assert (found["status"], found["reason"]) == ("False", "ClaimsUnschedulable")
    assert found["message"] == (
        "no device matches driverVersion 5.0.21.26: the 8 device(s) on 1 node(s) publish driverVersion "
        "5.0.20-3 (8): pod qwen-abc's claim qwen-abc-xpus-x1y2: 0/3 nodes are available: 3 cannot "
        "allocate all claims."
    )
    assert [(e.type, e.reason) for e in found["events"]] == [("Warning", "ClaimsUnschedulable")]


def test_the_multi_node_builder_passes_the_claim_to_both_roles() -> None:
    raw = dra_raw(xpus=2)
    raw["runtime"]["pipelineParallelSize"] = 2
    lws = build_leaderworkerset(
        make_ref(),
        parse_spec(raw),
        image=IMAGE,
        config_hash="h",
        image_volumes=False,
        replicas=1,
        claim_template="t",
    )
    for role in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        assert spec["resourceClaims"] == [{"name": "xpus", "resourceClaimTemplateName": "t"}]
