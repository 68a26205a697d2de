"""The chart's copies of the repository's sources of truth are byte-identical to them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart.tools import CHART, REPO, Rendered

FIX = "run `bash scripts/sync-crd.sh` and commit the result"
SOURCE_CRDS = sorted((REPO / "crds").glob("*.yaml"))
# CRDs that only the chart ships (kopf's peering resource, which the operator's HA needs).
CHART_ONLY_CRDS = {"kopf.dev_clusterkopfpeerings.yaml", "kopf.dev_kopfpeerings.yaml"}


def test_the_crd_source_exists() -> None:
    assert [p.name for p in SOURCE_CRDS] == ["serving.kunlun.dev_kunluninferenceservices.yaml"]


@pytest.mark.parametrize("source", SOURCE_CRDS, ids=lambda p: p.name)
def test_chart_crd_is_a_byte_identical_copy(source: Path) -> None:
    copy = CHART / "crds" / source.name
    assert copy.is_file(), f"{copy} missing: {FIX}"
    assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}: {FIX}"


def test_chart_has_no_stale_crd_the_source_dropped() -> None:
    chart_crds = {p.name for p in (CHART / "crds").glob("*.yaml")}
    assert chart_crds - CHART_ONLY_CRDS == {p.name for p in SOURCE_CRDS}, FIX


def test_chart_versions_file_is_a_byte_identical_copy() -> None:
    assert (CHART / "files" / "versions.yaml").read_bytes() == (REPO / "versions.yaml").read_bytes(), FIX


def test_rendered_crds_are_the_files_helm_installs(default_render: Rendered) -> None:
    names = {d["metadata"]["name"] for d in default_render.all("CustomResourceDefinition")}
    assert names == {
        "kunluninferenceservices.serving.kunlun.dev",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
