"""Every `helm install` / `helm upgrade` command in docs/chart.md, the chart README and the top README renders:
each is run as the equivalent `helm template` (no cluster here), so a documented value that the
schema rejects or a values file that moved fails this test."""

from __future__ import annotations

import re
import shlex

import pytest

from kunlun_operator.policy import matrix
from kunlun_operator.spec.service import parse_spec
from tests.chart.tools import CHART, REPO, helm

DOCS = [REPO / "docs" / "chart.md", CHART / "README.md", REPO / "README.md"]
CLUSTER_ONLY_FLAGS = {"--create-namespace", "--reuse-values", "--wait", "--atomic"}


def documented_helm_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if re.match(r"helm (install|upgrade) ", line):
                found.append((f"{doc.name}: {line}", shlex.split(line)))
    return found


def as_template(argv: list[str]) -> list[str]:
    """`helm install|upgrade NAME CHART flags…` → `template NAME CHART flags…` minus cluster-only flags."""
    args = ["template", *argv[2:]]
    return [a for a in args if a not in CLUSTER_ONLY_FLAGS]


def test_the_docs_show_install_upgrade_and_monitoring_commands() -> None:
    lines = [label for label, _ in documented_helm_commands()]
    assert any("helm install" in line for line in lines)
    assert any("monitoring.prometheusRule.enabled=true" in line for line in lines)


@pytest.mark.parametrize(
    ("label", "argv"), documented_helm_commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_documented_helm_command_renders(label: str, argv: list[str]) -> None:
    proc = helm(*as_template(argv), check=False)
    assert proc.returncode == 0, f"{label}\n{proc.stderr}"
    assert "kind: Deployment" in proc.stdout


def test_documented_inference_services_parse_and_fit_the_matrix() -> None:
    """The KunlunInferenceService shown in docs/chart.md is one the operator accepts."""
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "chart.md").read_text(), re.S)
    services = [
        d for b in blocks for d in yaml.safe_load_all(b) if d and d.get("kind") == "KunlunInferenceService"
    ]
    assert services, "docs/chart.md shows no KunlunInferenceService"
    for service in services:
        spec = parse_spec(service["spec"])
        image = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
        assert matrix.check_versions(matrix.load_default_matrix(), image, spec.versions) == []
