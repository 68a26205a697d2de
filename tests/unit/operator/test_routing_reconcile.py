"""Routed services in the pure reconcile and the admission review: what is built, what is refused
on a cluster without the APIs (naming the missing API), the ``Routed`` condition, the policy."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kunlun_operator import names
from kunlun_operator.decide.admission import review
from kunlun_operator.decide.reconcile import reconcile
from kunlun_operator.decide.status import DeploymentFacts
from kunlun_operator.policy.admission_policy import STRICTEST, AdmissionPolicy, parse_policy
from kunlun_operator.policy.matrix import load_default_matrix
from kunlun_operator.spec.operator_config import PickerImages
from kunlun_operator.spec.service import parse_spec_or_error
from tests.unit.operator.factories import NOW, OWNER, make_facts, make_raw_spec, make_ref

IMAGE = names.DEFAULT_RUNTIME_IMAGE
SERVED = {"inference_pool_served": True, "httproute_served": True}
GATEWAY = {"name": "inference-gateway", "namespace": "gateways"}


def _raw(**routing: Any) -> dict[str, Any]:
    return make_raw_spec(routing={"type": "InferencePool", **routing})


def _routed(status: dict[str, Any]) -> tuple[str, str, str] | None:
    found = [c for c in status["conditions"] if c["type"] == "Routed"]
    return (found[0]["status"], found[0]["reason"], found[0]["message"]) if found else None


def _picker(ready: int) -> DeploymentFacts:
    return DeploymentFacts(spec_replicas=1, replicas=1, ready_replicas=ready, updated_replicas=1)


def test_a_routed_service_gets_its_picker_pool_and_route_with_owner_references() -> None:
    plan = reconcile(
        make_ref(), parse_spec_or_error(_raw(gateway=GATEWAY)), None, make_facts(**SERVED), now=NOW
    )
    assert [(o["kind"], o["metadata"]["name"]) for o in plan.apply] == [
        ("ConfigMap", "qwen-config"),
        ("Service", "qwen"),
        ("Deployment", "qwen"),
        ("PodDisruptionBudget", "qwen"),
        ("ServiceAccount", "qwen-epp"),
        ("Role", "qwen-epp"),
        ("RoleBinding", "qwen-epp"),
        ("ConfigMap", "qwen-epp"),
        ("Deployment", "qwen-epp"),
        ("Service", "qwen-epp"),
        ("InferencePool", "qwen"),
        ("HTTPRoute", "qwen"),
    ]
    assert all(o["metadata"]["ownerReferences"] == OWNER for o in plan.apply)
    assert plan.delete == (names.HPA,)
    assert plan.status["phase"] == "Pending"  # the phase is the replicas'; routing has its condition
    assert _routed(plan.status) == ("False", "PoolNotCreated", "InferencePool qwen does not exist yet")


def test_a_service_routed_by_its_service_has_no_routed_condition() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(**SERVED), now=NOW)
    assert _routed(plan.status) is None
    assert plan.delete == (names.HPA, *names.ROUTING_KINDS)


def test_routed_says_what_is_missing_until_the_gateway_accepts_the_pool() -> None:
    spec = parse_spec_or_error(_raw(gateway=GATEWAY))
    pool: dict[str, Any] = {"metadata": {"name": "qwen"}}

    def routed(**facts: Any) -> tuple[str, str, str] | None:
        return _routed(reconcile(make_ref(), spec, None, make_facts(**SERVED, **facts), now=NOW).status)

    assert routed(pool=pool)[:2] == ("False", "PickerNotCreated")
    not_ready = routed(pool=pool, picker=_picker(0))
    assert not_ready[:2] == ("False", "PickerNotReady")
    assert "endpoint picker qwen-epp: 0/1 replicas ready" in not_ready[2]
    assert routed(pool=pool, picker=_picker(1))[:2] == ("Unknown", "AwaitingGateway")

    def parent(gateway: str, namespace: str | None, *conditions: tuple[str, str]) -> dict[str, Any]:
        ref = {"name": gateway, **({"namespace": namespace} if namespace else {})}
        return {
            "parentRef": ref,
            "conditions": [
                {"type": t, "status": s, "reason": "R", "message": f"{t} is {s}"} for t, s in conditions
            ],
        }

    other = parent("inference-gateway", None, ("Accepted", "False"))  # same name, the pool's namespace
    accepted = parent("inference-gateway", "gateways", ("Accepted", "True"), ("ResolvedRefs", "True"))
    assert routed(pool={**pool, "status": {"parents": [other]}}, picker=_picker(1))[:2] == (
        "Unknown",
        "AwaitingGateway",
    )
    assert routed(pool={**pool, "status": {"parents": [other, accepted]}}, picker=_picker(1)) == (
        "True",
        "GatewayAccepted",
        "InferencePool qwen and its endpoint picker qwen-epp (1/1 ready) serve Gateway gateways/inference-gateway",
    )
    unresolved = parent("inference-gateway", "gateways", ("Accepted", "True"), ("ResolvedRefs", "False"))
    assert routed(pool={**pool, "status": {"parents": [unresolved]}}, picker=_picker(1)) == (
        "False",
        "GatewayRejectedPool",
        "Gateway gateways/inference-gateway: ResolvedRefs False: R: ResolvedRefs is False",
    )


def test_a_route_the_gateway_rejects_makes_routed_false_with_the_gateways_words() -> None:
    """A Gateway refuses a route (its listener does not allow the namespace, no such sectionName)
    in the route's status.parents only: Routed says so instead of awaiting the gateway forever."""
    spec = parse_spec_or_error(_raw(gateway=GATEWAY))
    refused = {
        "parentRef": {"name": "inference-gateway", "namespace": "gateways"},
        "conditions": [
            {"type": "Accepted", "status": "False", "reason": "NotAllowedByListeners", "message": "ns ml"},
            {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs", "message": ""},
        ],
    }
    route = {"metadata": {"name": "qwen"}, "status": {"parents": [refused]}}
    facts = make_facts(**SERVED, pool={"metadata": {"name": "qwen"}}, picker=_picker(1), route=route)
    assert _routed(reconcile(make_ref(), spec, None, facts, now=NOW).status) == (
        "False",
        "GatewayRejectedRoute",
        "Gateway gateways/inference-gateway on HTTPRoute qwen: Accepted False: NotAllowedByListeners: ns ml",
    )
    accepted = {**refused, "conditions": [{**refused["conditions"][0], "status": "True"}]}
    facts = make_facts(
        **SERVED,
        pool={"metadata": {"name": "qwen"}},
        picker=_picker(1),
        route={**route, "status": {"parents": [accepted]}},
    )
    assert _routed(reconcile(make_ref(), spec, None, facts, now=NOW).status)[:2] == (
        "Unknown",
        "AwaitingGateway",
    )


def test_routed_is_true_without_a_gateway_once_the_picker_is_ready_and_says_so_once() -> None:
    spec = parse_spec_or_error(_raw())
    facts = make_facts(**SERVED, pool={"metadata": {"name": "qwen"}}, picker=_picker(1))
    first = reconcile(make_ref(), spec, None, facts, now=NOW)
    assert _routed(first.status)[:2] == ("True", "PickerReady")
    assert [(e.type, e.reason) for e in first.events] == [("Normal", "PickerReady")]
    again = reconcile(make_ref(), spec, first.status, facts, now=NOW)
    assert again.events == ()


@pytest.mark.parametrize(
    ("served", "raw", "field", "reason", "api"),
    [
        ({}, _raw(), "spec.routing.type", "InferencePoolNotInstalled", "inference.networking.k8s.io/v1"),
        (
            {"inference_pool_served": True},
            _raw(gateway=GATEWAY),
            "spec.routing.gateway",
            "HTTPRouteNotInstalled",
            "gateway.networking.k8s.io/v1",
        ),
    ],
    ids=["no InferencePool", "no HTTPRoute"],
)
def test_without_the_api_a_routed_service_is_refused_naming_it(
    served: dict[str, bool], raw: dict[str, Any], field: str, reason: str, api: str
) -> None:
    spec = parse_spec_or_error(raw)
    denial = review(spec, load_default_matrix(), IMAGE, **served).denial
    assert denial is not None and (denial.field, denial.reason) == (field, reason)
    assert f"({api}), which this cluster does not serve" in denial.message
    plan = reconcile(make_ref(), spec, None, make_facts(**served), now=NOW)
    assert plan.apply == () and plan.status["phase"] == "Failed"
    assert plan.status["lastFailure"]["reason"] == reason
    assert plan.requeue_after_seconds == 60.0  # installing the CRDs needs no spec change
    assert review(spec, load_default_matrix(), IMAGE, **SERVED).allowed


def test_a_service_routed_by_its_service_needs_neither_api() -> None:
    assert review(parse_spec_or_error(make_raw_spec()), load_default_matrix(), IMAGE).allowed


def test_the_picker_image_is_the_operators_unless_the_policy_allows_the_services() -> None:
    facts = make_facts(**SERVED, picker_images=PickerImages("mirror/epp:1", "mirror/llm-d:1"))

    def image(raw: dict[str, Any], policy: AdmissionPolicy = STRICTEST) -> str | None:
        plan = reconcile(
            make_ref(), parse_spec_or_error(raw), None, dataclasses.replace(facts, policy=policy), now=NOW
        )
        pickers = [o for o in plan.apply if o["metadata"]["name"] == "qwen-epp" and o["kind"] == "Deployment"]
        return pickers[0]["spec"]["template"]["spec"]["containers"][0]["image"] if pickers else None

    assert image(_raw()) == "mirror/epp:1"
    assert image(_raw(precise=True)) == "mirror/llm-d:1"
    own = _raw(picker={"image": "reg.local/epp:2"})
    assert image(own) is None  # not allowed by the strictest policy: Failed, nothing applied
    denial = review(parse_spec_or_error(own), load_default_matrix(), IMAGE, **SERVED).denial
    assert denial is not None and denial.field == "spec.routing.picker.image"
    assert denial.reason == "PolicyViolation"
    allowed = AdmissionPolicy(picker_images=("reg.local/",))
    assert image(own, policy=allowed) == "reg.local/epp:2"


def test_precise_routing_reserves_its_flags_and_environment() -> None:
    policy = parse_policy("pickerImages: [reg.local/]\n", source="policy.yaml")
    assert policy.picker_images == ("reg.local/",)
    for raw, field in (
        (
            _raw(precise=True) | {"runtime": {"env": [{"name": "PYTHONHASHSEED", "value": "0"}]}},
            "spec.runtime.env[0].name",
        ),
        (
            _raw(precise=True) | {"runtime": {"extraArgs": ["--kv-events-config={}"]}},
            "spec.runtime.extraArgs[0]",
        ),
        (
            _raw(precise=True) | {"runtime": {"extraArgs": ["--prefix-caching-hash"]}},
            "spec.runtime.extraArgs[0]",
        ),
        (  # the indexer decodes the runtime's default encoding only
            _raw(precise=True) | {"runtime": {"extraArgs": ["--seed=1", "--kv-events-encoding=map"]}},
            "spec.runtime.extraArgs[1]",
        ),
    ):
        denial = review(parse_spec_or_error(raw), load_default_matrix(), IMAGE, policy, **SERVED).denial
        assert denial is not None and denial.field == field
    # not reserved where the operator sets neither
    plain = make_raw_spec(
        runtime={"extraArgs": ["--kv-events-config={}"], "env": [{"name": "PYTHONHASHSEED", "value": "0"}]}
    )
    assert review(parse_spec_or_error(plain), load_default_matrix(), IMAGE, policy).allowed
