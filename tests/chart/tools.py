"""Locate and drive the real command-line tools the chart tests use (helm, promtool).

Owns: finding the binaries (`.tools/bin` first, then PATH), rendering the chart with
`helm template` into parsed documents, and the skip reason when a tool is absent (a failure
under ``KUNLUN_REQUIRE_TOOLS=1``).
Invariant: nothing here downloads anything; `make tools` (scripts/fetch-tools.sh) does that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.prerequisites import skip_for_missing_tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kunlun-inference"
TOOLS_BIN = REPO / ".tools" / "bin"
RELEASE = "kis"
NAMESPACE = "kunlun-system"


def find_tool(name: str) -> Path | None:
    """Return the path of `name` from .tools/bin, else from PATH, else None."""
    local = TOOLS_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return local
    found = shutil.which(name)
    return Path(found) if found else None


def require_tool(name: str) -> Path:
    """Return the tool's path or skip the calling test with the reason and the fix (fail it
    under ``KUNLUN_REQUIRE_TOOLS=1``, as in CI)."""
    path = find_tool(name)
    if path is None:
        skip_for_missing_tool(
            f"{name} not found in {TOOLS_BIN} or on PATH: run `make tools` "
            "(bash scripts/fetch-tools.sh) with access to PyPI and the Debian archive"
        )
    return path


@dataclass(frozen=True, slots=True)
class Rendered:
    """The output of one `helm template` run."""

    text: str  # the raw multi-document YAML
    docs: tuple[dict, ...]  # parsed, non-empty documents

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def one(self, kind: str, name_suffix: str = "") -> dict:
        """The single document of `kind` whose name ends with `name_suffix`."""
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
        names = [d["metadata"]["name"] for d in found]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {names}"
        return found[0]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm with `args`; skips the test when helm is absent."""
    binary = require_tool("helm")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(REPO / ".tools" / "helm-cache"),
        "HELM_CONFIG_HOME": str(REPO / ".tools" / "helm-config"),
        "HELM_DATA_HOME": str(REPO / ".tools" / "helm-data"),
    }
    proc = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def render(
    *values_files: Path, sets: tuple[str, ...] = (), overrides: dict | None = None, include_crds: bool = False
) -> Rendered:
    """`helm template` the chart with the given values files, --set expressions and, last, the
    `overrides` mapping (passed as a values file, so that floats stay floats)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values_files:
        args += ["--values", str(path)]
    for expr in sets:
        args += ["--set", expr]
    if include_crds:
        args.append("--include-crds")
    with tempfile.TemporaryDirectory() as tmp:
        if overrides is not None:
            path = Path(tmp) / "overrides.yaml"
            path.write_text(yaml.safe_dump(overrides))
            args += ["--values", str(path)]
        text = helm(*args).stdout
    docs = tuple(d for d in yaml.safe_load_all(text) if d)
    return Rendered(text=text, docs=docs)


def ci_values_files() -> list[Path]:
    """The chart's ci/*-values.yaml sets, sorted."""
    return sorted((CHART / "ci").glob("*-values.yaml"))
