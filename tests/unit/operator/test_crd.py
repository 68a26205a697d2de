"""The CRD itself, every example, and invalid CRs against the CRD's schema and CEL rules."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.service import parse_spec
from tests.unit.operator.crd_schema import load_crd, openapi_schema, validate_cr
from tests.unit.operator.factories import example_names, load_example, make_raw_spec

K8S_VERSIONS = ("1.28.0", "1.31.0")


def _cr(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.kunlun.dev/v1alpha1",
        "kind": "KunlunInferenceService",
        "metadata": {"name": "qwen"},
        "spec": spec,
    }


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_crd_is_a_valid_customresourcedefinition(k8s_version: str) -> None:
    kubernetes_validate.validate(load_crd(), k8s_version, strict=True)


def test_crd_names_subresources_and_printer_columns() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "kunluninferenceservices.serving.kunlun.dev"
    assert crd["spec"]["names"]["shortNames"] == ["kis"]
    assert crd["spec"]["names"]["categories"] == ["kunlun"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [
        ("Model", ".spec.model.name"),
        ("Ready", ".status.ready"),
        ("Phase", ".status.phase"),
        ("Endpoint", ".status.endpoint"),
        ("Nodes", ".status.compatibleNodes"),
        ("Age", ".metadata.creationTimestamp"),
    ]


def _walk(schema: dict[str, Any], path: str):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_every_field_has_a_description_for_kubectl_explain() -> None:
    undocumented = [
        path
        for path, node in _walk(openapi_schema(load_crd()), "")
        if "description" not in node and path not in (".metadata",) and not path.endswith("{}")
    ]
    assert undocumented == []


@pytest.mark.parametrize("example", example_names())
def test_every_example_is_valid_and_parses_the_same_with_and_without_crd_defaults(example: str) -> None:
    obj = load_example(example)
    defaulted, problems = validate_cr(obj)
    assert problems == []
    # The operator's defaults are the CRD's: an object the API server defaulted parses identically.
    assert parse_spec(defaulted["spec"]) == parse_spec(obj["spec"])


INVALID = [
    # (what, spec overrides, the field both the CRD and the operator must name)
    (
        "two model sources",
        {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}, "hostPath": {"path": "/m"}}}},
        "spec.model.source",
    ),
    ("no model source", {"model": {"name": "m", "source": {}}}, "spec.model.source"),
    (
        "xpus not a multiple of TP",
        {"resources": {"xpus": 3}, "runtime": {"tensorParallelSize": 2}},
        "spec.resources.xpus",
    ),
    (
        "min above max",
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
        "spec.autoscaling.minReplicas",
    ),
    ("autoscaling without max", {"autoscaling": {"enabled": True}}, "spec.autoscaling.maxReplicas"),
    (
        "kv cache target above 1",
        {"autoscaling": {"metric": "kvCacheUsage", "target": 1.5}},
        "spec.autoscaling.target",
    ),
    (
        "missing driver under Strict",
        {"versions": {"firmware": "1.0.2.14.1.54", "kml": "3.2.0"}},
        "spec.versions",
    ),
    (
        "unknown policy",
        {"versions": {"driver": "1", "firmware": "1", "kml": "1", "policy": "Maybe"}},
        "spec.versions.policy",
    ),
    ("unknown dtype", {"runtime": {"dtype": "int4"}}, "spec.runtime.dtype"),
    ("zero xpus", {"resources": {"xpus": 0}}, "spec.resources.xpus"),
    ("odd block size", {"runtime": {"blockSize": 48}}, "spec.runtime.blockSize"),
    (
        "relative host path",
        {"model": {"name": "m", "source": {"hostPath": {"path": "models"}}}},
        "spec.model.source.hostPath.path",
    ),
    (
        "escaping PVC path",
        {"model": {"name": "m", "source": {"pvc": {"claimName": "c", "path": "../etc"}}}},
        "spec.model.source.pvc.path",
    ),
    (
        "bad parameter count",
        {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}, "parameters": "7 billion"}},
        "spec.model.parameters",
    ),
    ("bad scrape interval", {"monitoring": {"interval": "soon"}}, "spec.monitoring.interval"),
    (
        "replaceAfter not a duration",
        {"faultTolerance": {"replaceAfter": "soon"}},
        "spec.faultTolerance.replaceAfter",
    ),
    ("replaceAfter in days", {"faultTolerance": {"replaceAfter": "1d"}}, "spec.faultTolerance.replaceAfter"),
    (
        "replaceAfter units out of order",
        {"faultTolerance": {"replaceAfter": "30s2m"}},
        "spec.faultTolerance.replaceAfter",
    ),
]


@pytest.mark.parametrize(("what", "overrides", "field"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_cr_is_rejected_by_the_crd_and_the_operator_naming_the_field(
    what: str, overrides: dict[str, Any], field: str
) -> None:
    _, problems = validate_cr(_cr(make_raw_spec(**overrides)))
    assert problems, what
    assert {p.path for p in problems} == {field}
    with pytest.raises(SpecError) as raised:
        parse_spec(make_raw_spec(**overrides))
    assert raised.value.field.startswith(field)


def test_unknown_fields_are_rejected() -> None:
    _, problems = validate_cr(_cr(make_raw_spec(replica=3)))
    assert [p.path for p in problems] == ["spec"]
    assert "replica" in problems[0].message
