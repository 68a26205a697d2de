"""The device plugin's ValidatingAdmissionPolicy, evaluated with `celpy` on the requests it must allow
and deny: its own Node's labels, quarantine and failure-history annotations and taint; the `kunlun.dev/xpu-healthy`
condition of pods on its own node; Events on such pods. (A real API server compiles CEL with types;
here the expressions run on plain JSON, which checks their logic, not their type-checking.)"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest

from tests.chart.tools import render

SA = "system:serviceaccount:kunlun-system:kis-kunlun-inference-device-plugin"
NODE = {
    "metadata": {
        "name": "n1",
        "labels": {"kubernetes.io/hostname": "n1", "kunlun.dev/xpu.count": "8"},
        "annotations": {"team": "ml"},
    },
    "spec": {"podCIDRs": ["10.0.0.0/24"], "taints": [{"key": "gpu", "effect": "NoSchedule"}]},
}
POD = {
    "metadata": {"name": "qwen-0", "namespace": "bank-prod"},
    "spec": {"nodeName": "n1"},
    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
}
OUR_CONDITION = {"type": "kunlun.dev/xpu-healthy", "status": "False", "reason": "XpuUnhealthy"}
OUR_TAINT = {"key": "kunlun.dev/xpu-unhealthy", "value": "true", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    on = render(overrides={"devicePlugin": {"labeler": {"nodeRestrictionPolicy": True}}})
    found: dict[str, Any] = on.one("ValidatingAdmissionPolicy")
    assert found["spec"]["matchConditions"][0]["expression"] == f"request.userInfo.username == '{SA}'"
    return found


def denials(policy: dict[str, Any], resource: str, obj: Any, old: Any, node: str | None = "n1") -> list[str]:
    """The messages of the validations that deny this request (empty: allowed)."""
    env = celpy.Environment()
    extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
    request = {
        "userInfo": {"username": SA, "extra": extra},
        "resource": {"group": "", "version": "v1", "resource": resource},
    }
    activation: dict[str, Any] = {"request": request, "object": obj, "oldObject": old}
    variables = {}
    for variable in policy["spec"]["variables"]:
        program = env.program(env.compile(variable["expression"]))
        variables[variable["name"]] = program.evaluate(celpy.json_to_cel(activation))
    cel = {k: celpy.json_to_cel(v) for k, v in activation.items()} | {
        "variables": celpy.json_to_cel(variables)
    }
    out = []
    for validation in policy["spec"]["validations"]:
        result = env.program(env.compile(validation["expression"])).evaluate(cel)
        if not bool(result):
            out.append(validation["message"])
    return out


def changed(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    new = copy.deepcopy(base)
    target = new
    for key in path[:-1]:
        target = target.setdefault(key, {})
    if value is None:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return new


def test_own_node_labels_quarantine_annotation_and_taint_are_allowed(policy: dict[str, Any]) -> None:
    new = changed(NODE, ("metadata", "labels", "kunlun.dev/xpu.count"), "7")
    new = changed(new, ("metadata", "annotations", "kunlun.dev/xpu-quarantine"), "GPU-5")
    new = changed(new, ("metadata", "annotations", "kunlun.dev/xpu-failures"), '{"failures":{},"version":1}')
    new = changed(new, ("spec", "taints"), [*NODE["spec"]["taints"], OUR_TAINT])
    assert denials(policy, "nodes", new, NODE) == []
    assert denials(policy, "nodes", NODE, new) == []  # and removing them again


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("metadata", "labels", "team"), "x", "the device plugin may only change kunlun.dev/xpu.* labels"),
        (
            ("metadata", "annotations", "team"),
            None,
            "the device plugin may only change the kunlun.dev/xpu-quarantine and kunlun.dev/xpu-failures "
            "annotations",
        ),
        (
            ("spec", "taints"),
            [],
            "the device plugin may only change the kunlun.dev/xpu-unhealthy taint of a node's spec",
        ),
        (
            ("spec", "unschedulable"),
            True,
            "the device plugin may only change the kunlun.dev/xpu-unhealthy taint of a node's spec",
        ),
    ],
)
def test_other_node_changes_are_denied(
    policy: dict[str, Any], path: tuple[str, ...], value: Any, message: str
) -> None:
    assert denials(policy, "nodes", changed(NODE, path, value), NODE) == [message]


def test_another_node_is_denied(policy: dict[str, Any]) -> None:
    new = changed(NODE, ("metadata", "annotations", "kunlun.dev/xpu-quarantine"), "GPU-5")
    assert denials(policy, "nodes", new, NODE, node="n2") == [
        "the device plugin may only change the node its pod runs on"
    ]
    assert denials(policy, "nodes", new, NODE, node=None) == [
        "the device plugin may only change the node its pod runs on"
    ]


def test_our_condition_on_a_pod_of_our_node_is_allowed(policy: dict[str, Any]) -> None:
    new = changed(POD, ("status", "conditions"), [*POD["status"]["conditions"], OUR_CONDITION])
    assert denials(policy, "pods", new, POD) == []


def test_pods_of_other_nodes_and_other_conditions_are_denied(policy: dict[str, Any]) -> None:
    new = changed(POD, ("status", "conditions"), [*POD["status"]["conditions"], OUR_CONDITION])
    assert denials(policy, "pods", new, POD, node="n2") == [
        "the device plugin may only change pods bound to its own node"
    ]
    not_ready = changed(POD, ("status", "conditions"), [{"type": "Ready", "status": "False"}])
    assert denials(policy, "pods", not_ready, POD) == [
        "the device plugin may only change a pod's kunlun.dev/xpu-healthy condition"
    ]


@pytest.mark.parametrize(
    ("kind", "host", "allowed"),
    [("Pod", "n1", True), ("Pod", "n2", False), ("Node", "n1", False), ("Pod", None, False)],
)
def test_events_only_on_pods_naming_our_node(
    policy: dict[str, Any], kind: str, host: str | None, allowed: bool
) -> None:
    event: dict[str, Any] = {"involvedObject": {"kind": kind, "name": "qwen-0"}, "reason": "XpuUnhealthy"}
    if host is not None:
        event["source"] = {"component": "kunlun-device-plugin", "host": host}
    found = denials(policy, "events", event, None)
    assert found == (
        []
        if allowed
        else ["the device plugin may only post Events on pods naming its own node as their source"]
    )
