"""Session fixtures for the chart tests: one `helm template` per ci values set, shared."""

from __future__ import annotations

import pytest

from tests.chart.tools import Rendered, ci_values_files, render


@pytest.fixture(scope="session")
def rendered_sets() -> dict[str, Rendered]:
    """Every ci/*-values.yaml set rendered once (with CRDs), keyed by file stem."""
    return {path.stem: render(path, include_crds=True) for path in ci_values_files()}


@pytest.fixture(scope="session")
def default_render(rendered_sets: dict[str, Rendered]) -> Rendered:
    return rendered_sets["default-values"]


@pytest.fixture(scope="session")
def monitoring_render(rendered_sets: dict[str, Rendered]) -> Rendered:
    return rendered_sets["monitoring-values"]
