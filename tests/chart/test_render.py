"""The chart lints strictly and renders valid Kubernetes objects for every ci values set.

`helm lint --strict` per values set; every rendered built-in object (CRDs included) validated with
`kubernetes-validate --strict` for Kubernetes 1.28, 1.31, 1.34 and 1.37, batched into one call per
version; a set with Dynamic Resource Allocation (resource.k8s.io/v1) only for 1.34 and 1.37, and
the chart refuses it for older clusters.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chart.tools import CHART, Rendered, ci_values_files, helm

KUBERNETES_VERSIONS = ("1.28.0", "1.31.0", "1.34.0", "1.37.0")
#: Values sets that hand out cards through DRA: resource.k8s.io/v1 is Kubernetes >= 1.34.
DRA_SETS = {"dra-values"}
DRA_VERSIONS = ("1.34.0", "1.37.0")
# Kinds whose schemas ship with their operators, not with Kubernetes: checked elsewhere
# (PrometheusRule by promtool, the rest by the assertions in test_templates.py).
NON_CORE_KINDS = {"ClusterKopfPeering", "KopfPeering", "PrometheusRule", "ServiceMonitor"}


@pytest.mark.parametrize("values_file", ci_values_files(), ids=lambda p: p.stem)
@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
def test_helm_lint_strict_passes(values_file: Path, kube_version: str) -> None:
    if values_file.stem in DRA_SETS and kube_version not in DRA_VERSIONS:
        proc = helm(
            "template", "kis", str(CHART), "--kube-version", kube_version, "-f", str(values_file), check=False
        )
        assert proc.returncode != 0 and "needs Kubernetes >= 1.34" in proc.stderr
        return
    proc = helm(
        "lint",
        "--strict",
        "--kube-version",
        kube_version,
        str(CHART),
        "--values",
        str(values_file),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_ci_values_sets_cover_monitoring_ha_and_node_selectors() -> None:
    assert {p.stem for p in ci_values_files()} >= {
        "default-values",
        "monitoring-values",
        "ha-values",
        "nodeselector-values",
        "dra-values",
    }


@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
def test_rendered_objects_pass_kubernetes_validate_strict(
    rendered_sets: dict[str, Rendered], kube_version: str, tmp_path: Path
) -> None:
    files, expected = [], 0
    for stem, rendered in rendered_sets.items():
        if stem in DRA_SETS and kube_version not in DRA_VERSIONS:
            continue  # refused by the chart (test_helm_lint_strict_passes)
        path = tmp_path / f"{stem}.yaml"
        path.write_text(rendered.text)
        files.append(str(path))
        expected += sum(1 for d in rendered.docs if d["kind"] not in NON_CORE_KINDS)
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", kube_version, *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    # The failing lines first: CI logs keep only the ends of a long message.
    failures = [line for line in out.splitlines() if line.startswith(("ERROR", "FATAL"))]
    assert proc.returncode == 0 and not failures, "\n".join(failures) or out
    unknown = {m.group(1) for m in re.finditer(r"Couldn't find schema for kind (\w+)", out)}
    assert unknown <= NON_CORE_KINDS, f"kinds with no Kubernetes schema: {unknown - NON_CORE_KINDS}"
    assert len(re.findall(r"^INFO .* passed for resource", out, re.M)) == expected, out


def test_chart_refuses_kubernetes_older_than_its_oldest_validated_version() -> None:
    proc = helm("template", "kis", str(CHART), "--kube-version", "1.27.0", check=False)
    assert proc.returncode != 0
    assert "chart requires kubeVersion: >=1.28.0-0" in proc.stderr
