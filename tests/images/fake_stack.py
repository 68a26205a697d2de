"""A fake Kunlun vendor stack (the `kunlun-stack/` build context) and a versions file certifying it.

Layout, as a real stack is expected to be:

    wheels/torch-*.whl               Kunlun's PyTorch build (here: the CPU wheel the host has)
    wheels/kunlun_fake_ops-*.whl     the op wheels: stub modules ``torch_xmlir`` and ``xtorch_ops``,
                                     the names the Kunlun platform probes for, with no kernels
    bin/xpu-smi, bin/outputs/        the fixture xpu-smi of the healthy P800 host and its recordings
    lib/libxpurt.so                  a stand-in for the runtime libraries (never loaded)
    kml/VERSION                      the KML version file

Nothing here is vendor software: the image built from it can detect the platform and run
preflight against fixture hosts, and cannot compute on a card.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import yaml

from tests.images.conftest import REPO

FIXTURE_HOST = REPO / "tests" / "fixtures" / "xpu" / "p800-8"
STUB_VERSION = "0.0.0+fake"
STUB_MODULES = ("torch_xmlir", "xtorch_ops")


def torch_wheel() -> Path:
    """The CPU torch wheel of the lock, from the host's wheel folder (PIP_FIND_LINKS)."""
    folder = Path((os.environ.get("PIP_FIND_LINKS") or "/opt/wheels").split()[0])
    found = sorted(folder.glob("torch-2.13.0+cpu-cp311-*.whl"))
    if not found:
        raise FileNotFoundError(f"no torch-2.13.0+cpu wheel in {folder} (set PIP_FIND_LINKS)")
    return found[0]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_stub_wheel(folder: Path) -> Path:
    """A pure-Python wheel holding empty ``torch_xmlir`` and ``xtorch_ops`` packages."""
    dist = f"kunlun_fake_ops-{STUB_VERSION}"
    files = {
        f"{module}/__init__.py": f'"""Stub of Kunlun\'s {module} for image tests: no kernels."""\n'.encode()
        for module in STUB_MODULES
    }
    files[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: kunlun-fake-ops\nVersion: {STUB_VERSION}\n".encode()
    )
    files[f"{dist}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = [_record_line(name, data) for name, data in files.items()] + [f"{dist}.dist-info/RECORD,,"]
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            # A fixed date: the same bytes every session, so the image build's cache holds.
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return path


def make_stack(root: Path, kml_version: str = "3.2.0") -> Path:
    """Write the fake stack under ``root`` (see the module docstring) and return ``root``."""
    (root / "wheels").mkdir(parents=True)
    wheel = torch_wheel()
    try:  # a hard link: the wheel is 190 MB, and the build copies it once more anyway
        os.link(wheel, root / "wheels" / wheel.name)
    except OSError:
        shutil.copy2(wheel, root / "wheels" / wheel.name)
    write_stub_wheel(root / "wheels")
    (root / "bin").mkdir()
    shutil.copy2(FIXTURE_HOST / "xpu-smi", root / "bin" / "xpu-smi")
    shutil.copytree(FIXTURE_HOST / "outputs", root / "bin" / "outputs")
    (root / "lib").mkdir()
    (root / "lib" / "libxpurt.so").write_bytes(b"not a library: the fake stack is never loaded\n")
    (root / "kml").mkdir()
    (root / "kml" / "VERSION").write_text(f"{kml_version}\n")
    return root


def checksums(stack: Path) -> dict[str, str]:
    """sha256 of every file of ``stack``, by path inside it (what versions.yaml lists)."""
    return {
        path.relative_to(stack).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(stack.rglob("*"))
        if path.is_file()
    }


def write_versions(path: Path, sha256: dict[str, str]) -> Path:
    """The repository's versions.yaml with ``kunlunStack.sha256`` replaced by ``sha256``."""
    versions = yaml.safe_load((REPO / "versions.yaml").read_text())
    versions["kunlunStack"]["sha256"] = sha256
    path.write_text(yaml.safe_dump(versions, sort_keys=False))
    return path
