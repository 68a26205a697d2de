"""The chart's switch for prefix-aware routing (routing.enabled): the operator's flags, its rights on
InferencePools, HTTPRoutes and the pickers' RBAC only when on, the picker images (published, pinned,
mirrorable, inside the admission policy), and the runtime NetworkPolicy letting the pickers in."""

from __future__ import annotations

from typing import Any

import pytest

from kunlun_operator import names
from kunlun_operator.decide.admission import Review, review
from kunlun_operator.policy.admission_policy import AdmissionPolicy, parse_policy
from kunlun_operator.policy.matrix import load_default_matrix
from kunlun_operator.shell import cli as operator_cli
from kunlun_operator.spec.service import parse_spec_or_error
from tests.chart.test_rbac import _names, grants_of_rules, operator_calls, table_after
from tests.chart.tools import REPO, Rendered, render
from tests.unit.operator.factories import make_raw_spec


def _operator_args(rendered: Rendered) -> list[str]:
    return rendered.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_routing_rights_only_where_it_is_stated_enabled() -> None:
    """routing.enabled grants exactly the routing calls and the rights the pickers' Roles get;
    by default the operator runs with --no-inference-pool and never calls those APIs."""
    routing_calls = operator_calls(routing=True) - operator_calls()
    owned = {"get", "create", "patch", "delete"}
    assert routing_calls == {
        *(("inference.networking.k8s.io", "inferencepools", v) for v in owned | {"list", "watch"}),
        *(("gateway.networking.k8s.io", "httproutes", v) for v in owned),
        *(("", "serviceaccounts", v) for v in owned),
        *(("rbac.authorization.k8s.io", r, v) for r in ("roles", "rolebindings") for v in owned),
        ("", "pods", "get"),  # with list and watch, which the operator holds anyway: the picker's pods rule
        *(
            ("inference.networking.x-k8s.io", r, v)
            for r in ("inferenceobjectives", "inferencemodelrewrites")
            for v in ("get", "list", "watch")
        ),
    }
    for enabled in (False, True):
        rendered = render(overrides={"routing": {"enabled": enabled}})
        role = rendered.one("ClusterRole", "-operator")
        assert grants_of_rules(role["rules"]) == operator_calls(routing=enabled)
        parsed = operator_cli.build_parser().parse_args(_operator_args(rendered))
        assert parsed.inference_pool is enabled


def test_the_pickers_role_is_inside_what_the_operator_holds() -> None:
    """Kubernetes lets the operator create a Role only with rights it holds itself."""
    from kunlun_operator.builders.picker_rbac import PICKER_RULES

    held = grants_of_rules(
        render(overrides={"routing": {"enabled": True}}).one("ClusterRole", "-operator")["rules"]
    )
    assert grants_of_rules([dict(r) for r in PICKER_RULES]) <= held


def test_the_default_picker_images_are_the_operators_published_ones_and_pass_the_policy() -> None:
    """The chart's picker images are the operator's defaults (pinned releases); a routed service
    naming no image gets them under the chart's default policy, which lets no service name its own
    until admissionPolicy.pickerImages lists the registry."""
    defaults = (
        names.DEFAULT_ENDPOINT_PICKER_IMAGE,
        names.DEFAULT_PRECISE_ENDPOINT_PICKER_IMAGE,
        names.DEFAULT_PRECISE_TOKENIZER_IMAGE,
    )
    for image in defaults:
        assert not image.endswith(":latest") and ":" in image.rsplit("/", 1)[1]  # pinned
    rendered = render(overrides={"routing": {"enabled": True}})
    args = operator_cli.build_parser().parse_args(_operator_args(rendered))
    assert (args.endpoint_picker_image, args.precise_endpoint_picker_image, args.precise_tokenizer_image) == (
        defaults
    )
    policy = _policy(rendered)
    for precise in (False, True):
        assert _review(make_raw_spec(routing={"type": "InferencePool", "precise": precise}), policy).allowed
    own = make_raw_spec(
        routing={"type": "InferencePool", "picker": {"image": names.DEFAULT_ENDPOINT_PICKER_IMAGE}}
    )
    assert _review(own, policy).denial.field == "spec.routing.picker.image"
    prefix = "registry.k8s.io/gateway-api-inference-extension/"
    allowing = _policy(render(overrides={"admissionPolicy": {"pickerImages": [prefix]}}))
    assert allowing.picker_images == (prefix,)
    assert _review(own, allowing).allowed


def _policy(rendered: Rendered) -> AdmissionPolicy:
    return parse_policy(rendered.one("ConfigMap", "-admission-policy")["data"]["policy.yaml"], source="chart")


def _review(raw: dict[str, Any], policy: AdmissionPolicy) -> Review:
    spec = parse_spec_or_error(raw)
    served = {"inference_pool_served": True, "httproute_served": True}
    return review(spec, load_default_matrix(), names.DEFAULT_RUNTIME_IMAGE, policy, **served)


def test_a_mirror_replaces_the_picker_images() -> None:
    mirror = {"registry": "mirror.local:5000", "repository": "gaie/epp", "tag": "v1.5.0"}
    precise = {"registry": "mirror.local:5000", "repository": "llm-d/scheduler", "tag": "v0.8.0"}
    tokenizer = {"registry": "mirror.local:5000", "repository": "llm-d/uds-tokenizer", "tag": "v0.7.1"}
    rendered = render(
        overrides={
            "routing": {
                "enabled": True,
                "picker": {"image": mirror},
                "precisePicker": {"image": precise, "tokenizerImage": tokenizer},
            }
        }
    )
    args = _operator_args(rendered)
    assert "--endpoint-picker-image=mirror.local:5000/gaie/epp:v1.5.0" in args
    assert "--precise-endpoint-picker-image=mirror.local:5000/llm-d/scheduler:v0.8.0" in args
    assert "--precise-tokenizer-image=mirror.local:5000/llm-d/uds-tokenizer:v0.7.1" in args


@pytest.mark.parametrize("enabled", [False, True])
def test_the_runtime_network_policy_admits_the_pickers_only_with_routing(enabled: bool) -> None:
    rendered = render(
        overrides={
            "routing": {"enabled": enabled},
            "networkPolicy": {"enabled": True, "namespaces": ["chat"]},
        }
    )
    ingress = rendered.one("NetworkPolicy", "-runtime")["spec"]["ingress"]
    pickers = [
        rule
        for rule in ingress
        if {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "kunlun-endpoint-picker",
                    "app.kubernetes.io/managed-by": "kunlun-operator",
                }
            }
        }
        in rule["from"]
    ]
    if enabled:
        assert [p["ports"] for p in pickers] == [
            [{"port": 8000, "protocol": "TCP"}, {"port": 5557, "protocol": "TCP"}]
        ]
    else:
        assert pickers == []


def test_the_routing_rbac_table_in_docs_chart_md_lists_the_rendered_rules() -> None:
    doc = (REPO / "docs" / "chart.md").read_text()
    documented = {
        (g, r, v)
        for row in table_after(doc, "With routing.enabled")
        for g in _names(row["api group"])
        for r in _names(row["resource"])
        for v in _names(row["verbs"])
    }
    on = render(overrides={"routing": {"enabled": True}}).one("ClusterRole", "-operator")
    off = render().one("ClusterRole", "-operator")
    assert documented == grants_of_rules(on["rules"]) - grants_of_rules(off["rules"])
