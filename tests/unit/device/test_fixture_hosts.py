"""The committed fixture hosts are exactly what tests/fixtures/xpu/make_hosts.py writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.unit.device.hosts import FIXTURES


def tree(root: Path) -> dict[str, tuple[bytes, bool]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), bool(p.stat().st_mode & 0o100))
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "make_hosts.py" and "__pycache__" not in p.parts
    }


def test_fixture_hosts_are_current(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_hosts", FIXTURES / "make_hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    assert tree(tmp_path) == tree(FIXTURES), "run: python tests/fixtures/xpu/make_hosts.py"
