"""A Strict pod on a node without the KML version file reaches preflight, whose error names the file.

The pod specs are the operator's own (the Deployment's and both LeaderWorkerSet templates). The
node is a copy of a fixture host; ``set_up_volumes`` plays kubelet and the container runtime for
the preflight's hostPath volumes, by their rules: a ``File`` or ``Directory`` type that does not
match stops the pod at the mount (kubelet's event, the pod stays ContainerCreating), no type
(``""``) is not checked and a missing path is created as an empty directory. Then
``kunlun-runtime preflight`` runs with exactly the init container's arguments against what it sees.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.builders.leaderworkerset import build_leaderworkerset
from kunlun_operator.spec.service import parse_spec
from kunlun_runtime.commands.cli import main
from tests.unit.operator.factories import make_raw_spec, make_ref

FIXTURE_HOST = Path(__file__).resolve().parents[2] / "fixtures" / "xpu" / "p800-8"
KML_FILE = "usr/local/xpu/kml/VERSION"  # the operator's default --preflight-kml-version-file
MISSING = (
    "preflight failed: cannot read the KML version: {root}/run/kunlun-host/usr/local/xpu/kml/VERSION "
    "does not exist (--kml-version-file /run/kunlun-host/usr/local/xpu/kml/VERSION under --dev-root {root})"
)


def pod_specs() -> dict[str, dict[str, Any]]:
    """The Strict runtime pod of each workload the operator builds, by role."""
    kwargs: dict[str, Any] = {
        "image": "runtime:test",
        "config_hash": "h",
        "image_volumes": False,
        "replicas": 1,
    }
    single = parse_spec(make_raw_spec(resources={"xpus": 2}))
    multi = parse_spec(make_raw_spec(resources={"xpus": 2}, runtime={"pipelineParallelSize": 2}))
    deployment = build_deployment(make_ref(), single, **kwargs)
    templates = build_leaderworkerset(make_ref(), multi, **kwargs)["spec"]["leaderWorkerTemplate"]
    return {
        "deployment": deployment["spec"]["template"]["spec"],
        "leader": templates["leaderTemplate"]["spec"],
        "worker": templates["workerTemplate"]["spec"],
    }


def set_up_volumes(node: Path, container: Path, pod: dict[str, Any]) -> str | None:
    """Mount the preflight's hostPath volumes of ``pod`` from ``node`` into ``container`` as kubelet
    and the container runtime would; kubelet's error when one fails its type check, else None."""
    [init] = [c for c in pod["initContainers"] if c["name"] == "preflight"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in init.get("volumeMounts", []):
        host_path = volumes[mount["name"]]["hostPath"]
        source = node / host_path["path"].lstrip("/")
        kind = host_path.get("type", "")
        if (kind == "File" and not source.is_file()) or (kind == "Directory" and not source.is_dir()):
            what = "a file" if kind == "File" else "a directory"
            return (
                f'MountVolume.SetUp failed for volume "{mount["name"]}" : hostPath type check failed: '
                f"{host_path['path']} is not {what}"
            )
        assert kind in ("", "File", "Directory"), f"an unexpected hostPath type {kind!r}"
        assert mount["readOnly"] is True
        if not source.exists():
            source.mkdir(parents=True)  # no type: the container runtime creates an empty directory
        target = container / mount["mountPath"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
    for device in ("xpu0", "xpu1", "xpuctrl"):  # what kubelet hands the container for XPU_VISIBLE_DEVICES=0,1
        (container / "dev").mkdir(exist_ok=True)
        (container / "dev" / device).touch()
    return None


def run_preflight(
    capsys: pytest.CaptureFixture[str], pod: dict[str, Any], container: Path
) -> tuple[int, list[str]]:
    [init] = [c for c in pod["initContainers"] if c["name"] == "preflight"]
    assert init["command"] == ["kunlun-runtime"]
    code = main([*init["args"], "--dev-root", str(container)])  # the container's / is this directory
    return code, capsys.readouterr().err.splitlines()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A writable copy of the fixture host's filesystem; the image's own xpu-smi reads its cards."""
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("KUNLUN_XPU_SMI", str(FIXTURE_HOST / "xpu-smi"))
    for key in ("KUNLUN_DEV_ROOT", "KUNLUN_KML_VERSION_FILE"):
        monkeypatch.delenv(key, raising=False)
    return Path(shutil.copytree(FIXTURE_HOST / "root", tmp_path / "node"))


@pytest.mark.parametrize("role", ["deployment", "leader", "worker"])
def test_a_node_with_the_kml_file_passes_preflight(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, node: Path, role: str
) -> None:
    pod = pod_specs()[role]
    assert set_up_volumes(node, tmp_path / role, pod) is None
    assert run_preflight(capsys, pod, tmp_path / role) == (0, [])


@pytest.mark.parametrize("role", ["deployment", "leader", "worker"])
@pytest.mark.parametrize("missing", ["file", "directory"])
def test_a_node_without_the_kml_file_fails_in_preflight_naming_the_file_not_at_the_mount(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, node: Path, role: str, missing: str
) -> None:
    (node / KML_FILE).unlink()
    if missing == "directory":
        (node / KML_FILE).parent.rmdir()
    pod = pod_specs()[role]
    container = tmp_path / role
    assert set_up_volumes(node, container, pod) is None  # kubelet starts the pod
    assert run_preflight(capsys, pod, container) == (1, [MISSING.format(root=container)])
    assert (node / KML_FILE).parent.is_dir() and not (node / KML_FILE).exists()
