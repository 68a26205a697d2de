"""The custom resource read once (``parse_service``): identity, spec or its error, last status."""

from __future__ import annotations

from typing import Any

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.service import (
    ParsedService,
    ServiceRef,
    parse_service,
    parse_service_ref,
    parse_spec,
    parse_spec_or_error,
)
from kunlun_operator.spec.values import InferenceSpec
from tests.unit.operator.factories import make_raw_spec

META: dict[str, Any] = {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 3}


def test_a_valid_service_is_parsed_once_into_its_ref_spec_and_status() -> None:
    status = {"phase": "Ready", "observedGeneration": 3}
    body = {"metadata": META, "spec": make_raw_spec(), "status": status}
    assert parse_service(body) == ParsedService(
        ref=ServiceRef(name="qwen", namespace="ml", uid="uid-1", generation=3),
        spec=parse_spec(make_raw_spec()),
        status=status,
    )


def test_an_invalid_spec_is_held_as_the_error_naming_the_field_not_raised() -> None:
    service = parse_service({"metadata": META, "spec": make_raw_spec(resources={"xpus": 0})})
    assert isinstance(service.spec, SpecError)
    assert (service.spec.field, service.status) == ("spec.resources.xpus", {})
    # No spec at all reads as an empty one: the first missing field is named.
    missing = parse_service({"metadata": META}).spec
    assert isinstance(missing, SpecError) and missing.field == "spec.model"


def test_parse_spec_or_error_returns_what_parse_spec_returns_or_raises() -> None:
    assert isinstance(parse_spec_or_error(make_raw_spec()), InferenceSpec)
    error = parse_spec_or_error(None)
    assert isinstance(error, SpecError) and str(error) == "spec: is required"


def test_the_ref_says_whether_the_service_is_being_deleted_and_defaults_its_namespace() -> None:
    deleting = parse_service_ref({"metadata": {**META, "deletionTimestamp": "2026-01-01T00:00:00Z"}})
    assert deleting.deleting is True
    assert parse_service_ref({"metadata": {"name": "qwen"}}) == ServiceRef(
        name="qwen", namespace="default", uid="", generation=0, deleting=False
    )
