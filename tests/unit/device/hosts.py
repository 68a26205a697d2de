"""Test factories for fixture hosts (tests/fixtures/xpu/<name>): sources and mutable copies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kunlun_device.xpu import XpuSource

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "xpu"


def make_source(name: str, base: Path = FIXTURES) -> XpuSource:
    """An `XpuSource` reading the fixture host `name` under `base`."""
    host = base / name
    return XpuSource(
        xpu_smi=str(host / "xpu-smi"), root=host / "root", kml_version_file="/usr/local/xpu/kml/VERSION"
    )


def copy_host(name: str, tmp_path: Path) -> Path:
    """A writable copy of fixture host `name`; tests change its outputs to simulate faults."""
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    (target / "root" / "dev").mkdir(parents=True, exist_ok=True)
    return target


def use_outputs(host: Path, donor: str) -> None:
    """Make `host` print what fixture host `donor` prints (and have its device nodes).

    Each file is replaced atomically, so a concurrent reader sees the old or the new output,
    never half of one; device nodes are only added or removed where the two hosts differ.
    """
    source = FIXTURES / donor
    for item in (source / "outputs").iterdir():
        staged = host / "outputs" / f".{item.name}.new"
        shutil.copyfile(item, staged)
        os.replace(staged, host / "outputs" / item.name)
    wanted = {node.name for node in (source / "root" / "dev").glob("*")}
    for node in (host / "root" / "dev").iterdir():
        if node.name not in wanted:
            node.unlink()
    for name in wanted:
        (host / "root" / "dev" / name).touch()
