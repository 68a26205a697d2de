"""The compatibility matrix, the memory feasibility estimate and the startup budget."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import yaml

from kunlun_operator.decide.admission import card_memory_of, review
from kunlun_operator.policy.feasibility import GiB, estimate_memory, startup_budget_seconds
from kunlun_operator.policy.matrix import (
    as_dict,
    check_versions,
    load_default_matrix,
    parse_matrix,
    resolve_image,
    runtime_version,
    select_image,
)
from kunlun_operator.spec.service import parse_spec, parse_spec_or_error
from kunlun_operator.spec.values import VersionsSpec
from tests.unit.operator.factories import make_raw_spec

VERSIONS_YAML = Path(__file__).resolve().parents[3] / "versions.yaml"


@pytest.mark.skipif(not VERSIONS_YAML.exists(), reason="versions.yaml not in this checkout")
def test_the_packaged_matrix_equals_the_release_versions() -> None:
    with VERSIONS_YAML.open() as f:
        versions = yaml.safe_load(f)
    registry = versions["images"]["registry"]
    assert as_dict(load_default_matrix())["entries"] == [
        {
            "runtime": str(e["runtime"]),
            **{k: sorted(map(str, e[k])) for k in ("driver", "firmware", "kml")},
            "image": f"{registry}/{e['image']}",
        }
        for e in versions["compatibility"]
    ]


@pytest.mark.skipif(not VERSIONS_YAML.exists(), reason="versions.yaml not in this checkout")
def test_every_release_entry_names_the_kunlun_variant_of_its_runtime() -> None:
    versions = yaml.safe_load(VERSIONS_YAML.read_text())
    repository = versions["images"]["runtime"]["repository"]
    for entry in versions["compatibility"]:
        assert entry["image"] == f"{repository}:{entry['runtime']}-kunlun"
    packaged = yaml.safe_load(
        resources.files("kunlun_operator.policy").joinpath("default_matrix.yaml").read_text()
    )
    assert packaged["registry"] == versions["images"]["registry"]
    assert packaged["entries"] == versions["compatibility"]


def test_the_image_comes_from_the_entry_certifying_the_versions() -> None:
    matrix = parse_matrix(
        "registry: reg.io/team\n"
        "entries:\n"
        "- {runtime: 0.2.0, image: 'rt:0.2.0-kunlun', driver: [d2], firmware: [f], kml: [k]}\n"
        "- {runtime: 0.1.0, image: 'rt:0.1.0-kunlun', driver: [d1, d2], firmware: [f], kml: [k]}\n"
        "- {runtime: 0.0.9, image: 'other.io/x/rt:0.0.9', driver: [d0], firmware: [f], kml: [k]}\n"
        "- {runtime: 0.0.8, driver: [d8], firmware: [f], kml: [k]}\n",
        source="t",
    )
    fallback = "fallback.io/rt:0.0.1"
    # the first entry in matrix order that certifies all three versions
    assert select_image(matrix, VersionsSpec("d2", "f", "k"), fallback) == "reg.io/team/rt:0.2.0-kunlun"
    assert select_image(matrix, VersionsSpec("d1", "f", "k"), fallback) == "reg.io/team/rt:0.1.0-kunlun"
    assert select_image(matrix, VersionsSpec("d0", "f", "k"), fallback) == "other.io/x/rt:0.0.9"
    # an entry without an image, or no certifying entry: the operator's --default-runtime-image
    assert select_image(matrix, VersionsSpec("d8", "f", "k"), fallback) == fallback
    assert select_image(matrix, VersionsSpec("d9", "f", "k"), fallback) == fallback
    # policy Off leaves versions unset: they match any entry
    assert (
        select_image(matrix, VersionsSpec(None, None, None, "Off"), fallback) == "reg.io/team/rt:0.2.0-kunlun"
    )
    # the chosen image is checked against its own entry, and so is the variant's tag
    assert check_versions(matrix, "reg.io/team/rt:0.1.0-kunlun", VersionsSpec("d1", "f", "k")) == []
    assert check_versions(matrix, "reg.io/elsewhere/rt:0.1.0-kunlun", VersionsSpec("d1", "f", "k")) == []
    # the cpu and cuda variants are certified on no Kunlun stack
    for variant in ("cpu", "cuda"):
        [problem] = check_versions(matrix, f"reg.io/team/rt:0.1.0-{variant}", VersionsSpec("d1", "f", "k"))
        assert problem.field == "spec.runtime.image"
    assert runtime_version("reg.io/team/rt:0.1.0-kunlun") == "0.1.0"
    [problem] = check_versions(matrix, "reg.io/team/rt:0.2.0-kunlun", VersionsSpec("d1", "f", "k"))
    assert (problem.field, problem.message) == (
        "spec.versions.driver",
        "driver d1 is not supported by runtime 0.2.0 (supported: d2)",
    )


def test_an_image_is_checked_against_every_entry_of_its_runtime_version() -> None:
    # An admin's extra entry for a newly certified driver, without an image of its own, certifies
    # the same runtime as the first: the fallback image is not denied for the newer driver.
    matrix = parse_matrix(
        "registry: reg.io/team\nentries:\n"
        "- {runtime: 0.1.0, image: 'rt:0.1.0-kunlun', driver: [d1], firmware: [f], kml: [k]}\n"
        "- {runtime: 0.1.0, driver: [d2], firmware: [f], kml: [k]}\n",
        source="t",
    )
    image = select_image(matrix, VersionsSpec("d2", "f", "k"), "mirror.io/team/rt:0.1.0")
    assert image == "mirror.io/team/rt:0.1.0"
    assert check_versions(matrix, image, VersionsSpec("d2", "f", "k")) == []
    assert [p.field for p in check_versions(matrix, image, VersionsSpec("d3", "f", "k"))] == [
        "spec.versions.driver"
    ]


def test_a_repository_with_a_path_still_goes_under_the_registry() -> None:
    assert resolve_image("team/rt:1", "reg.io") == "reg.io/team/rt:1"  # docker.io would be wrong
    assert resolve_image("rt:1", "reg.io/") == "reg.io/rt:1"
    assert resolve_image("other.io/team/rt:1", "reg.io") == "other.io/team/rt:1"
    assert resolve_image("localhost:5000/rt:1", "reg.io") == "localhost:5000/rt:1"
    assert resolve_image("localhost/rt:1", "reg.io") == "localhost/rt:1"


def test_the_packaged_matrix_follows_the_default_images_registry() -> None:
    # Without the chart's ConfigMap a mirrored cluster keeps pulling from its own mirror.
    packaged = load_default_matrix()
    assert all(entry.image and entry.image.startswith("ghcr.io/") for entry in packaged.entries)
    moved = packaged.under_registry_of("mirror.bank.cn/ai/kunlun-runtime:0.1.0")
    assert [entry.image for entry in moved.entries] == [
        f"mirror.bank.cn/ai/{entry.image.rsplit('/', 1)[-1]}" for entry in packaged.entries if entry.image
    ]
    assert [e.driver for e in moved.entries] == [e.driver for e in packaged.entries]


def test_an_entry_image_without_a_tag_is_refused() -> None:
    with pytest.raises(ValueError, match=r"t: entries\[0\].image must be 'repository:tag', got 'rt'"):
        parse_matrix(
            "entries:\n- {runtime: x, image: rt, driver: [a], firmware: [b], kml: [c]}\n", source="t"
        )


def test_versions_are_checked_per_component_against_the_image_tag() -> None:
    matrix = parse_matrix(
        "entries:\n- {runtime: '0.1.*', driver: [a, b], firmware: [f], kml: [k]}\n", source="t"
    )
    assert check_versions(matrix, "reg:5000/x/rt:0.1.7", VersionsSpec("b", "f", "k")) == []
    problems = check_versions(matrix, "rt:0.1.0", VersionsSpec("c", "f", "z"))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.versions.driver", "UnsupportedVersions"),
        ("spec.versions.kml", "UnsupportedVersions"),
    ]
    assert [p.field for p in check_versions(matrix, "rt:0.2.0", VersionsSpec("a", "f", "k"))] == [
        "spec.runtime.image"
    ]
    assert [p.field for p in check_versions(matrix, "rt@sha256:00", VersionsSpec("a", "f", "k"))] == [
        "spec.runtime.image"
    ]
    assert runtime_version("localhost:5000/rt") is None


def test_malformed_matrix_names_the_entry() -> None:
    with pytest.raises(ValueError, match=r"cm/matrix.yaml: entries\[0\].kml must be a non-empty list"):
        parse_matrix("entries:\n- {runtime: x, driver: [a], firmware: [b]}\n", source="cm/matrix.yaml")


def test_memory_estimate_of_a_7b_model_with_its_kv_cache() -> None:
    spec = parse_spec(
        make_raw_spec(
            model={
                "name": "m",
                "source": {"hostPath": {"path": "/m"}},
                "parameters": "7B",
                "architecture": {"numLayers": 32, "numKVHeads": 32, "headDim": 128},
            },
            runtime={"maxModelLen": 32768},
        )
    )
    estimate = estimate_memory(spec, 32 * GiB)
    assert estimate.weights_bytes == 14_000_000_000
    assert estimate.kv_cache_bytes == 2 * 32 * 32 * 128 * 2 * 32768  # 16 GiB
    assert estimate.available_bytes == int(32 * GiB * 0.9)
    assert not estimate.fits
    assert estimate.describe() == (
        "weights 13.0 GiB + KV cache 16.0 GiB = 29.0 GiB; available 28.8 GiB (90% of 1 × 32 GiB)"
    )
    assert estimate_memory(parse_spec(make_raw_spec()), 32 * GiB) is None


def test_startup_budget_grows_with_model_size() -> None:
    def budget(**model: str) -> int:
        return startup_budget_seconds(
            parse_spec(make_raw_spec(model={"name": "m", "source": {"hostPath": {"path": "/m"}}, **model}))
        )

    assert budget() == 900
    assert budget(parameters="135M") == 305  # 0.25 GiB of bf16 weights
    assert budget(parameters="7B") == 561
    assert budget(parameters="405B") == 3600


def test_admission_finds_a_card_by_label_value_or_family_and_reports_the_numbers() -> None:
    matrix = load_default_matrix()
    assert card_memory_of(matrix.card_memory_bytes, "P800-OAM") == 96 * GiB
    assert card_memory_of(matrix.card_memory_bytes, "X9") is None
    big = make_raw_spec(
        model={"name": "m", "source": {"pvc": {"claimName": "models"}}, "parameters": "70B"},
        resources={"xpuProduct": "P800-OAM"},
    )
    verdict = review(parse_spec_or_error(big), matrix, "rt:0.1.0")
    assert (verdict.denial.field, verdict.denial.reason) == ("spec.resources.xpus", "InsufficientMemory")
    assert review(
        parse_spec_or_error({**big, "resources": {"xpus": 2, "xpuProduct": "P800-OAM"}}), matrix, "rt:0.1.0"
    ).allowed
    unknown = review(parse_spec_or_error({**big, "resources": {"xpuProduct": "X9"}}), matrix, "rt:0.1.0")
    assert unknown.allowed and unknown.warnings[0].startswith("spec.resources.xpuProduct: card X9")


def test_the_webhook_checks_the_image_the_matrix_gives_a_service_without_one() -> None:
    matrix = load_default_matrix()
    # the fallback names a runtime outside the matrix: it would be denied, were it used
    assert review(parse_spec_or_error(make_raw_spec()), matrix, "rt:9.9.9").allowed
    denied = review(
        parse_spec_or_error(make_raw_spec(versions={"driver": "9.9", "firmware": "f", "kml": "k"})),
        matrix,
        "rt:9.9.9",
    )
    assert denied.denial is not None and denied.denial.field == "spec.runtime.image"
