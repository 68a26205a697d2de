"""The scripts of benchmarks/ as modules in tests (they are scripts, not a package)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` run as the module ``name`` and registered in ``sys.modules``
    (dataclasses look their module up there). A script that imports its neighbours needs
    ``BENCHMARKS`` on ``sys.path`` first."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
