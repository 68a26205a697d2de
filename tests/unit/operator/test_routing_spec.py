"""``spec.routing``: the CRD's schema and CEL rules and the operator's parser agree, field by field."""

from __future__ import annotations

from typing import Any

import pytest

from kunlun_operator.spec.routing import hash_seed
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import GatewayRef, PickerSpec, RoutingSpec
from tests.unit.operator.crd_schema import validate_cr
from tests.unit.operator.factories import make_cr, make_raw_spec
from tests.unit.operator.test_crd import (
    test_invalid_cr_is_rejected_by_the_crd_and_the_operator_naming_the_field as check_invalid,
)


def test_without_routing_a_service_is_routed_by_its_service_as_before() -> None:
    defaulted, problems = validate_cr(make_cr(make_raw_spec()))
    assert problems == []
    assert defaulted["spec"]["routing"] == {"type": "Service", "precise": False}
    assert parse_spec(make_raw_spec()).routing == RoutingSpec()
    assert parse_spec(defaulted["spec"]).routing == RoutingSpec()


def test_every_routing_field_parses_as_the_crd_defaults_it() -> None:
    routing = {
        "type": "InferencePool",
        "precise": True,
        "hashSeed": "4242",
        "gateway": {"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"},
        "picker": {"replicas": 2, "image": "mirror.local/epp:v1", "resources": {"requests": {"cpu": "1"}}},
    }
    defaulted, problems = validate_cr(make_cr(make_raw_spec(routing=routing)))
    assert problems == []
    assert defaulted["spec"]["routing"]["picker"]["failureMode"] == "FailOpen"
    expected = RoutingSpec(
        type="InferencePool",
        precise=True,
        gateway=GatewayRef("inference-gateway", "gateways", "http"),
        picker=PickerSpec(replicas=2, image="mirror.local/epp:v1", resources={"requests": {"cpu": "1"}}),
        hash_seed="4242",
    )
    assert parse_spec(make_raw_spec(routing=routing)).routing == expected
    assert parse_spec(defaulted["spec"]).routing == expected


def test_a_picker_block_without_fields_gets_the_crds_defaults() -> None:
    raw = make_raw_spec(routing={"type": "InferencePool", "picker": {}})
    defaulted, problems = validate_cr(make_cr(raw))
    assert problems == []
    assert defaulted["spec"]["routing"]["picker"] == {"replicas": 1, "failureMode": "FailOpen"}
    assert parse_spec(defaulted["spec"]) == parse_spec(raw)


INVALID = [
    ("precise with Service", {"routing": {"precise": True}}, "spec.routing.precise"),
    ("gateway with Service", {"routing": {"gateway": {"name": "gw"}}}, "spec.routing.gateway"),
    ("picker with Service", {"routing": {"picker": {"failureMode": "FailClose"}}}, "spec.routing.picker"),
    (
        "hashSeed without precise",
        {"routing": {"type": "InferencePool", "hashSeed": "1"}},
        "spec.routing.hashSeed",
    ),
    (
        "hashSeed beyond PYTHONHASHSEED",
        {"routing": {"type": "InferencePool", "precise": True, "hashSeed": "4294967296"}},
        "spec.routing.hashSeed",
    ),
    (
        "hashSeed not a number",
        {"routing": {"type": "InferencePool", "precise": True, "hashSeed": "-1"}},
        "spec.routing.hashSeed",
    ),
    ("unknown routing type", {"routing": {"type": "Mesh"}}, "spec.routing.type"),
    ("gateway without a name", {"routing": {"type": "InferencePool", "gateway": {}}}, "spec.routing.gateway"),
    (
        "gateway name not a DNS name",
        {"routing": {"type": "InferencePool", "gateway": {"name": "Gateway_1"}}},
        "spec.routing.gateway.name",
    ),
    (
        "listener name not a DNS label",
        {"routing": {"type": "InferencePool", "gateway": {"name": "gw", "sectionName": "HTTP"}}},
        "spec.routing.gateway.sectionName",
    ),
    (
        "no picker replicas",
        {"routing": {"type": "InferencePool", "picker": {"replicas": 0}}},
        "spec.routing.picker.replicas",
    ),
    (
        "too many picker replicas",
        {"routing": {"type": "InferencePool", "picker": {"replicas": 11}}},
        "spec.routing.picker.replicas",
    ),
    (  # no leader election: each approximate picker would learn a share of the conversations
        "several approximate pickers",
        {"routing": {"type": "InferencePool", "picker": {"replicas": 2}}},
        "spec.routing.picker.replicas",
    ),
    (
        "unknown failure mode",
        {"routing": {"type": "InferencePool", "picker": {"failureMode": "Retry"}}},
        "spec.routing.picker.failureMode",
    ),
    (
        "a metrics token the picker cannot send",
        {"routing": {"type": "InferencePool"}, "metricsTokenSecretRef": {"name": "s", "key": "k"}},
        "spec.metricsTokenSecretRef",
    ),
    (
        "precise without the prefix cache",
        {"routing": {"type": "InferencePool", "precise": True}, "runtime": {"enablePrefixCaching": False}},
        "spec.runtime.enablePrefixCaching",
    ),
]


@pytest.mark.parametrize(("what", "overrides", "field"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_routing_is_rejected_by_the_crd_and_the_operator_naming_the_field(
    what: str, overrides: dict[str, Any], field: str
) -> None:
    check_invalid(what, overrides, field)


def test_a_metrics_token_is_still_fine_without_an_inference_pool() -> None:
    raw = make_raw_spec(metricsTokenSecretRef={"name": "s", "key": "k"})
    assert validate_cr(make_cr(raw))[1] == []
    assert parse_spec(raw).metrics_token_secret is not None


def test_the_derived_hash_seed_is_stable_per_service_and_within_pythons_range() -> None:
    routing = RoutingSpec(type="InferencePool", precise=True)
    seeds = {hash_seed(routing, ns, name) for ns, name in (("ml", "qwen"), ("ml", "llama"), ("prod", "qwen"))}
    assert len(seeds) == 3
    assert hash_seed(routing, "ml", "qwen") == hash_seed(routing, "ml", "qwen")
    assert all(0 <= int(seed) <= 4_294_967_295 for seed in seeds)
    assert hash_seed(RoutingSpec(type="InferencePool", precise=True, hash_seed="7"), "ml", "qwen") == "7"
