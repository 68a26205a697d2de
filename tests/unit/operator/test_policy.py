"""The admission policy and the Secret references: webhook verdict, reconcile re-check, manifests."""

from __future__ import annotations

from typing import Any

import pytest

from kunlun_operator import names
from kunlun_operator.builders.configmap import build_configmap, runtime_args
from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.builders.pod_template import model_path
from kunlun_operator.builders.servicemonitor import build_servicemonitor
from kunlun_operator.decide.admission import review
from kunlun_operator.decide.reconcile import reconcile
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.admission_policy import (
    STRICTEST,
    AdmissionPolicy,
    host_path_allowed,
    image_allowed,
    parse_policy,
    reserved_flag,
)
from kunlun_operator.policy.matrix import load_default_matrix
from kunlun_operator.spec.service import parse_spec, parse_spec_or_error
from kunlun_operator.spec.values import SecretKeyRef
from tests.unit.operator.factories import NOW, make_facts, make_raw_spec, make_ref

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
POLICY = AdmissionPolicy(
    runtime_images=("ghcr.io/kunlun-inference/",),
    model_images=("registry.example.com/models",),
    host_paths=("/data/models",),
)
HOST_SPEC = make_raw_spec(model={"name": "m", "source": {"hostPath": {"path": "/etc"}}})
SECRETS = {
    "apiKeySecretRef": {"name": "qwen-keys", "key": "api-key"},
    "metricsTokenSecretRef": {"name": "qwen-keys", "key": "metrics-token"},
}


def _field(raw: dict[str, Any], policy: AdmissionPolicy = POLICY) -> str | None:
    denial = review(parse_spec_or_error(raw), load_default_matrix(), IMAGE, policy).denial
    return None if denial is None else denial.field


def test_policy_file_parses_and_rejects_what_it_does_not_know() -> None:
    text = "runtimeImages: [ghcr.io/kunlun-inference/]\nhostPaths: [/data/models]\nallowFlagOverrides: true\n"
    assert parse_policy(text, source="p.yaml") == AdmissionPolicy(
        runtime_images=("ghcr.io/kunlun-inference/",), host_paths=("/data/models",), allow_flag_overrides=True
    )
    assert parse_policy("", source="p.yaml") == STRICTEST
    for bad in ("hostPath: [/data]", "hostPaths: [/]", "hostPaths: [data]", "hostPaths: [/a/../b]", "[1]"):
        with pytest.raises(ValueError, match=r"p\.yaml"):
            parse_policy(bad, source="p.yaml")


def test_prefixes_match_on_boundaries_only() -> None:
    assert image_allowed("ghcr.io/kunlun-inference/rt:1", ("ghcr.io/kunlun-inference",))
    assert image_allowed("ghcr.io/kunlun-inference:1", ("ghcr.io/kunlun-inference",))
    assert not image_allowed("ghcr.io/kunlun-inference-evil/rt:1", ("ghcr.io/kunlun-inference",))
    assert not image_allowed("evil.io/ghcr.io/kunlun-inference/rt", ("ghcr.io/kunlun-inference/",))
    assert host_path_allowed("/data/models/qwen", ("/data/models",))
    assert host_path_allowed("/data/models", ("/data/models/",))
    assert not host_path_allowed("/data/models-other", ("/data/models",))
    assert not host_path_allowed("/data/models/../../etc", ("/data/models",))
    assert not host_path_allowed("/etc", ())
    assert reserved_flag("--api-key=x") == "--api-key"
    assert reserved_flag("--api") == "--api-key"  # argparse would accept the abbreviation
    assert reserved_flag("--seed=1") is None and reserved_flag("value") is None


def test_webhook_denies_what_the_policy_forbids_naming_the_field() -> None:
    assert _field(HOST_SPEC) == "spec.model.source.hostPath.path"
    assert _field(HOST_SPEC, STRICTEST) == "spec.model.source.hostPath.path"
    allowed_host = make_raw_spec(model={"name": "m", "source": {"hostPath": {"path": "/data/models/q"}}})
    assert _field(allowed_host) is None
    assert _field(make_raw_spec(runtime={"image": "docker.io/evil/rt:0.1.0"})) == "spec.runtime.image"
    fetch = {"name": "m", "source": {"image": {"reference": "docker.io/evil/m:1"}}}
    assert _field(make_raw_spec(model=fetch)) == "spec.model.source.image.reference"
    assert _field(make_raw_spec(runtime={"extraArgs": ["--seed=1", "--api-key=s3cret"]})) == (
        "spec.runtime.extraArgs[1]"
    )
    assert _field(make_raw_spec(runtime={"env": [{"name": "LD_PRELOAD", "value": "/models/x.so"}]})) == (
        "spec.runtime.env[0].name"
    )
    overrides = AdmissionPolicy(allow_flag_overrides=True)
    assert _field(make_raw_spec(runtime={"extraArgs": ["--port=1"]}), overrides) is None
    denial = review(parse_spec_or_error(HOST_SPEC), load_default_matrix(), IMAGE, POLICY).denial
    assert denial is not None and (str(denial), denial.reason) == (
        "spec.model.source.hostPath.path: '/etc' is not allowed by the admission policy "
        "(hostPaths: /data/models)",
        "PolicyViolation",
    )


def test_reconcile_builds_nothing_for_a_service_outside_the_policy_and_says_why() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(HOST_SPEC), None, make_facts(policy=POLICY), now=NOW)
    assert plan.apply == ()
    assert plan.delete == (names.DEPLOYMENT, names.HPA)  # admitted earlier: its pods go
    assert plan.status["phase"] == "Failed"
    assert plan.status["lastFailure"]["reason"] == "PolicyViolation"
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PolicyViolation")
    assert ready["message"].startswith("spec.model.source.hostPath.path: '/etc' is not allowed")
    assert [e.reason for e in plan.events] == ["PolicyViolation"]
    allowed = make_raw_spec(model={"name": "m", "source": {"hostPath": {"path": "/data/models/q"}}})
    kinds = [
        o["kind"]
        for o in reconcile(
            make_ref(), parse_spec_or_error(allowed), None, make_facts(policy=POLICY), now=NOW
        ).apply
    ]
    assert "Deployment" in kinds


def test_secret_refs_parse_and_errors_name_the_field() -> None:
    spec = parse_spec(make_raw_spec(**SECRETS))
    assert spec.api_key_secret == SecretKeyRef("qwen-keys", "api-key")
    assert spec.metrics_token_secret == SecretKeyRef("qwen-keys", "metrics-token")
    assert parse_spec(make_raw_spec()).api_key_secret is None
    with pytest.raises(SpecError) as missing:
        parse_spec(make_raw_spec(apiKeySecretRef={"name": "k"}))
    assert missing.value.field == "spec.apiKeySecretRef.key"
    with pytest.raises(SpecError) as bad:
        parse_spec(make_raw_spec(metricsTokenSecretRef={"name": "Bad_Name", "key": "k"}))
    assert bad.value.field == "spec.metricsTokenSecretRef.name"


def test_secrets_reach_the_runtime_as_env_from_the_secret_never_as_args_or_config() -> None:
    spec = parse_spec(make_raw_spec(runtime={"env": [{"name": "TZ", "value": "UTC"}]}, **SECRETS))
    deployment = build_deployment(
        make_ref(), spec, image=IMAGE, config_hash="h", image_volumes=False, replicas=1
    )
    runtime = deployment["spec"]["template"]["spec"]["containers"][0]
    assert runtime["env"] == [
        {"name": "HOME", "value": "/tmp"},
        {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "qwen-keys", "key": "api-key"}}},
        {
            "name": "KUNLUN_METRICS_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "qwen-keys", "key": "metrics-token"}},
        },
        {"name": "TZ", "value": "UTC"},
    ]
    path = model_path(spec, image_volumes=False)
    assert runtime["args"] == runtime_args(spec, path)
    assert not any("key" in a or "token" in a for a in runtime["args"])
    assert "qwen-keys" not in str(build_configmap(make_ref(), spec, path))


def test_servicemonitor_sends_the_metrics_token_from_the_same_secret() -> None:
    spec = parse_spec(make_raw_spec(**SECRETS))
    assert build_servicemonitor(make_ref(), spec)["spec"]["endpoints"] == [
        {
            "port": "http",
            "path": "/metrics",
            "interval": "30s",
            "authorization": {"type": "Bearer", "credentials": {"name": "qwen-keys", "key": "metrics-token"}},
        }
    ]
    plain = build_servicemonitor(make_ref(), parse_spec(make_raw_spec()))
    assert plain["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
