"""The layering of all three packages holds (import-linter contracts in pyproject.toml), and the
folders show it: the runtime root holds only the package face, and each layer contract names every
folder of its package once."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports, "import-linter is part of the dev extra"
    result = subprocess.run([lint_imports], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "BROKEN" not in result.stdout and result.stdout.count("KEPT") >= 5


def _contract(name_prefix: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith(name_prefix)]
    return contract


def _package_parts(folder: Path, package: str) -> tuple[set[str], set[str]]:
    """The subpackages and the modules (``__init__``/``__main__`` aside) directly in ``folder``."""
    subpackages = {f"{package}.{p.name}" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    modules = {f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem not in {"__init__", "__main__"}}
    return subpackages, modules


def test_the_runtime_root_holds_only_the_package_face() -> None:
    root = ROOT / "runtime" / "kunlun_runtime"
    face = {"__init__.py", "__main__.py", "llm.py", "version.py", "errors.py", "config.py"}
    assert {p.name for p in root.glob("*.py")} == face


@pytest.mark.parametrize(
    ("contract", "folder", "package"),
    [
        ("runtime layers", "runtime/kunlun_runtime", "kunlun_runtime"),
        ("operator layers", "operator/kunlun_operator", "kunlun_operator"),
    ],
)
def test_the_layer_contract_names_every_folder_once_and_alone(
    contract: str, folder: str, package: str
) -> None:
    layers = [set(layer.split(" | ")) for layer in _contract(contract)["layers"]]
    subpackages, modules = _package_parts(ROOT / folder, package)
    named = [name for layer in layers for name in layer]
    assert sorted(named) == sorted(subpackages | modules)  # each part of the package exactly once
    if package == "kunlun_operator":  # one folder, one layer: a folder shares its layer with none
        assert all({subpackage} in layers for subpackage in subpackages)
