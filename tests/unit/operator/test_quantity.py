"""Quantities parsed once in ``spec``: bytes, parameter counts, durations; errors name the field."""

from __future__ import annotations

import pytest

from kunlun_operator.builders.configmap import build_config_data, runtime_args
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.matrix import parse_matrix
from kunlun_operator.spec.quantity import parse_bytes, parse_duration_seconds, parse_parameters
from kunlun_operator.spec.service import parse_spec
from tests.unit.operator.factories import make_raw_spec

FIELD = "spec.runtime.kvCacheMemory"


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("1024", 1024),
        ("20Gi", 20 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("4Ki", 4096),
        ("3Mi", 3 * 2**20),
        ("1Ti", 2**40),
        ("500M", 500_000_000),
        ("2K", 2000),
        ("7G", 7_000_000_000),
        ("1T", 10**12),
        ("1.5K", 1500),
        ("9007199254740993", 2**53 + 1),  # exact beyond a float's 53 bits
    ],
)
def test_a_memory_quantity_is_parsed_into_bytes(text: str, num_bytes: int) -> None:
    assert parse_bytes(text, FIELD) == num_bytes


@pytest.mark.parametrize("value", ["20GB", "20 Gi", "-1Gi", "1e3", "", "Gi", ".5Gi", 20, None])
def test_what_is_not_a_memory_quantity_is_an_error_naming_the_field(value: object) -> None:
    with pytest.raises(SpecError) as caught:
        parse_bytes(value, FIELD)
    assert caught.value.field == FIELD
    assert str(caught.value) == f"{FIELD}: must be a quantity like '20Gi', got {value!r}"


def test_the_parsed_spec_carries_kv_cache_memory_in_bytes_and_the_builders_pass_them_on() -> None:
    spec = parse_spec(make_raw_spec(runtime={"kvCacheMemory": "1.5Gi"}))
    assert spec.runtime.kv_cache_memory_bytes == 1_610_612_736
    args = runtime_args(spec, "/models/m")
    assert args[args.index("--kv-cache-memory") + 1] == "1610612736"
    assert "kv-cache-memory: 1610612736\n" in build_config_data(spec, "/models/m")["config.yaml"]
    assert parse_spec(make_raw_spec()).runtime.kv_cache_memory_bytes is None


@pytest.mark.parametrize("value", ["1.5", "0", "0Gi", "0.0001Ki"])
def test_what_is_not_a_positive_whole_number_of_bytes_fails_the_spec_naming_the_field(value: str) -> None:
    # The CRD's pattern admits these; the spec refuses them, so no builder or runtime meets them.
    with pytest.raises(SpecError) as caught:
        parse_spec(make_raw_spec(runtime={"kvCacheMemory": value}))
    assert str(caught.value) == f"{FIELD}: must be a positive whole number of bytes, got {value!r}"


@pytest.mark.parametrize("value", ["20 GiB", 20])
def test_an_invalid_kv_cache_memory_fails_the_spec_naming_the_field(value: object) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(make_raw_spec(runtime={"kvCacheMemory": value}))
    assert str(caught.value) == f"{FIELD}: must be a quantity like '20Gi', got {value!r}"


def test_the_matrix_card_memory_uses_the_same_parser_and_names_its_source_and_key() -> None:
    text = "entries: []\ncards:\n  P800: {memory: 96Gi}\n  X1: {memory: 64G}\n"
    assert parse_matrix(text, source="t").card_memory_bytes == {"P800": 96 * 2**30, "X1": 64 * 10**9}
    with pytest.raises(ValueError) as caught:
        parse_matrix("entries: []\ncards:\n  P800: {memory: lots}\n", source="ConfigMap ks/m")
    assert not isinstance(caught.value, SpecError)  # the admin's matrix, not the service's spec
    assert (
        str(caught.value) == "ConfigMap ks/m: cards.P800.memory: must be a quantity like '20Gi', got 'lots'"
    )


@pytest.mark.parametrize(
    ("text", "count"), [("7B", 7_000_000_000), ("135M", 135_000_000), ("1.5B", 1_500_000_000)]
)
def test_a_parameter_count_is_parsed(text: str, count: int) -> None:
    assert parse_parameters(text, "spec.model.parameters") == count


@pytest.mark.parametrize(("text", "seconds"), [("45s", 45), ("2m", 120), ("2m30s", 150), ("1h", 3600)])
def test_a_duration_is_parsed_into_seconds(text: str, seconds: int) -> None:
    assert parse_duration_seconds(text, "spec.faultTolerance.replaceAfter") == seconds


def test_bad_counts_and_durations_name_their_field() -> None:
    with pytest.raises(SpecError) as caught:
        parse_parameters("7 billion", "spec.model.parameters")
    assert str(caught.value) == "spec.model.parameters: '7 billion' must look like '7B' or '135M'"
    with pytest.raises(SpecError) as caught:
        parse_duration_seconds("30s2m", "spec.faultTolerance.replaceAfter")
    assert caught.value.field == "spec.faultTolerance.replaceAfter"
