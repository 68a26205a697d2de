"""The field readers: typed results, defaults for absent or null fields, errors naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.fields import read_bool, read_choice, read_int, read_str
from kunlun_operator.spec.values import POLICIES, VersionsSpec


@pytest.mark.parametrize(
    ("data", "expected"),
    [({}, "Strict"), ({"policy": None}, "Strict"), ({"policy": "Warn"}, "Warn"), ({"policy": "Off"}, "Off")],
)
def test_read_choice_returns_the_choice_or_the_default(data: dict[str, Any], expected: str) -> None:
    assert read_choice(data, "policy", "spec.versions", POLICIES, default="Strict") == expected


def test_read_choice_without_default_returns_none_when_absent() -> None:
    assert read_choice({}, "policy", "spec.versions", POLICIES) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("strict", "spec.versions.policy: must be one of Strict, Warn, Off; got 'strict'"),
        ("", "spec.versions.policy: must be one of Strict, Warn, Off; got ''"),
        (3, "spec.versions.policy: must be a non-empty string, got 3"),
    ],
)
def test_read_choice_rejects_what_is_not_a_choice(value: object, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        read_choice({"policy": value}, "policy", "spec.versions", POLICIES, default="Strict")
    assert str(caught.value) == message
    assert caught.value.field == "spec.versions.policy"


def test_null_fields_read_as_their_defaults() -> None:
    data = {"s": None, "i": None, "b": None}
    assert read_str(data, "s", "spec", default="30s") == "30s"
    assert read_int(data, "i", "spec", default=1) == 1
    assert read_bool(data, "b", "spec", True) is True
    assert read_str(data, "s", "spec") is None
    assert read_int(data, "i", "spec") is None
    assert read_bool(data, "b", "spec", None) is None


@pytest.mark.parametrize(
    ("data", "message"),
    [({}, "spec.x: is required"), ({"x": ""}, "spec.x: must be a non-empty string, got ''")],
)
def test_required_strings_must_be_present_and_non_empty(data: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as caught:
        read_str(data, "x", "spec", required=True)
    assert str(caught.value) == message


def test_locked_versions_are_the_three_versions_or_an_error_naming_the_field() -> None:
    assert VersionsSpec("5.0.21.26", "1.0.2.14.1.54", "3.2.0").locked_versions() == (
        "5.0.21.26",
        "1.0.2.14.1.54",
        "3.2.0",
    )
    with pytest.raises(SpecError) as caught:
        VersionsSpec(None, None, None, policy="Off").locked_versions()
    assert caught.value.field == "spec.versions"
