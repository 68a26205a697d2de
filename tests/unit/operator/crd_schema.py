"""Validate custom-resource instances against a CRD offline, the way the API server would.

What the API server does on create, emulated: apply the schema's ``default``s, reject unknown fields
(kubectl's strict field validation), check the OpenAPI value validations (via ``jsonschema``), then
evaluate every ``x-kubernetes-validations`` CEL rule (via ``cel-python``) with ``self`` bound to the
node it sits on. Each problem is reported with the path of the field it is about.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[3]
CRD_PATH = REPO / "crds" / "serving.kunlun.dev_kunluninferenceservices.yaml"
#: The real LeaderWorkerSet CRD (kubernetes-sigs/lws; source and license in the folder's README).
EXTERNAL = REPO / "tests" / "fixtures" / "external"
LWS_CRD_PATH = EXTERNAL / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
#: The Gateway API Inference Extension's InferencePool and Gateway API's HTTPRoute (standard channel).
INFERENCEPOOL_CRD_PATH = EXTERNAL / "inference.networking.k8s.io_inferencepools.yaml"
HTTPROUTE_CRD_PATH = EXTERNAL / "gateway.networking.k8s.io_httproutes.yaml"


@dataclass(frozen=True)
class Problem:
    path: str  # like "spec.autoscaling.minReplicas"
    message: str


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    with path.open() as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def load_lws_crd() -> dict[str, Any]:
    """The LeaderWorkerSet CRD (1.3 MB: parsed once per test run, shared: do not change it)."""
    return load_crd(LWS_CRD_PATH)


@functools.cache
def load_inferencepool_crd() -> dict[str, Any]:
    """The InferencePool CRD (parsed once per test run, shared: do not change it)."""
    return load_crd(INFERENCEPOOL_CRD_PATH)


@functools.cache
def load_httproute_crd() -> dict[str, Any]:
    """The HTTPRoute CRD (430 kB: parsed once per test run, shared: do not change it); its first
    version is v1."""
    return load_crd(HTTPROUTE_CRD_PATH)


def openapi_schema(crd: Mapping[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in, recursively (a new object)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in set(value) - set(schema.get("properties") or {}):
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def to_json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A Kubernetes structural schema as a JSON Schema that forbids unknown fields."""
    out: dict[str, Any] = {}
    for key in ("type", "enum", "minimum", "maximum", "pattern", "minLength", "maxLength", "required"):
        if key in schema:
            out[key] = schema[key]
    if schema.get("exclusiveMinimum") is True:  # OpenAPI 3.0 boolean → JSON Schema number
        out["exclusiveMinimum"] = out.pop("minimum")
    if "anyOf" in schema:
        out["anyOf"] = [to_json_schema(s) for s in schema["anyOf"]]
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), Mapping):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = to_json_schema(schema["items"])
    if "pattern" in out and "type" not in out:  # int-or-string: the pattern applies to strings only
        pattern = out.pop("pattern")
        out["if"] = {"type": "string"}
        out["then"] = {"pattern": pattern}
    return out


def _cel_value(schema: Mapping[str, Any], value: Any) -> Any:
    """Convert to CEL the way the API server types it (``number`` fields are doubles)."""
    if schema.get("type") == "number" and isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        return {k: _cel_value(props.get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_value(schema.get("items", {}), v) for v in value]
    return value


def _cel_problems(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[Problem]:
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(_cel_value(schema, value))})
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            where = path + rule.get("fieldPath", "")
            yield Problem(where, rule.get("message", rule["rule"]))
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _cel_problems(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _cel_problems(schema["items"], item, f"{path}[{i}]")


def validate_cr(
    obj: Mapping[str, Any], crd: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[Problem]]:
    """Default ``obj`` and validate it; returns the defaulted object and every problem found."""
    schema = openapi_schema(crd or load_crd())
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    problems = [
        Problem(".".join(str(p) for p in err.absolute_path), err.message)
        for err in validator.iter_errors(defaulted)
    ]
    if not problems:
        problems = list(_cel_problems(schema, defaulted, ""))
    return defaulted, problems
