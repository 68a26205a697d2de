"""Every `helm install` / `helm upgrade` command in docs/chart.md and the chart README renders:
each is run as the equivalent `helm template` (no cluster here), so a documented value that the
schema rejects or a values file that moved fails this test."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.chart.tools import CHART, REPO, helm

DOCS = [REPO / "docs" / "chart.md", CHART / "README.md"]
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
