"""`kunlun-runtime preflight` against the fixture hosts: exit status, the one-line reason, --json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kunlun_operator.builders.pod_template import build_pod_spec
from kunlun_operator.spec.service import parse_spec
from kunlun_runtime.commands.cli import main
from tests.unit.operator.factories import make_raw_spec, make_ref

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "xpu"
GOOD = {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"}
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("XPU_VISIBLE_DEVICES", "KUNLUN_XPU_SMI", "KUNLUN_DEV_ROOT", "KUNLUN_KML_VERSION_FILE"):
        monkeypatch.delenv(key, raising=False)


def preflight(host: Path | str, *extra: str, **expect: str) -> list[str]:
    root = FIXTURES / host if isinstance(host, str) else host
    args = ["preflight", "--xpu-smi", str(root / "xpu-smi"), "--dev-root", str(root / "root"), *extra]
    for component, version in {**GOOD, **expect}.items():
        if version:  # "": not expected
            args += [f"--expect-{component}", version]
    return args


def run(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, list[str]]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def test_matching_versions_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, preflight("p800-8")) == (
        0,
        "preflight ok: 8 healthy card(s) (P800 OAM); driver 5.0.21.26, firmware 1.0.2.14.1.54, kml 3.2.0\n",
        [],
    )


@pytest.mark.parametrize(
    ("component", "wanted", "reason"),
    [
        ("driver", "5.0.22.1", "driver mismatch: found 5.0.21.26, expected 5.0.22.1"),
        (
            "driver",
            "5.0.21",
            "driver mismatch: found 5.0.21.26, expected 5.0.21 (5.0.21 is this node's XPU-RT version; "
            "--expect-driver takes xpu-smi's Driver Version)",
        ),
        ("firmware", "1.3.8", "firmware mismatch: found 1.0.2.14.1.54, expected 1.3.8"),
        ("kml", "3.3.0", "kml mismatch: found 3.2.0, expected 3.3.0"),
    ],
)
def test_each_mismatch_fails_with_one_line(
    capsys: pytest.CaptureFixture[str], component: str, wanted: str, reason: str
) -> None:
    assert run(capsys, preflight("p800-8", **{component: wanted})) == (1, "", [f"preflight failed: {reason}"])


def test_failing_cards_fail_and_warnings_do_not(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, preflight("p800-failing")) == (
        1,
        "",
        [
            "preflight failed: xpu5 unhealthy: ecc-uncorrectable: 3 uncorrectable ECC errors; "
            "xpu6 unhealthy: device-node-missing: /dev/xpu6 does not exist"
        ],
    )


def test_only_visible_cards_are_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "0,2")  # card 2 is hot (warn only), 5 and 6 are not ours
    assert run(capsys, preflight("p800-failing"))[0] == 0
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "1,9")
    assert run(capsys, preflight("p800-8"))[2] == [
        "preflight failed: XPU_VISIBLE_DEVICES names card(s) [9] that xpu-smi does not list"
    ]
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "a")
    code, out, err = run(capsys, [*preflight("p800-8"), "--json"])
    reason = "XPU_VISIBLE_DEVICES: expected comma-separated card indices, got 'a'"
    assert (code, err) == (1, [f"preflight failed: {reason}"])
    assert json.loads(out)["reason"] == reason


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        (
            "missing-tool",
            "cannot read the driver and firmware versions: xpu-smi not found or not executable: "
            f"{str(FIXTURES / 'missing-tool' / 'xpu-smi')!r} "
            "(install the Kunlun driver tools or pass --xpu-smi / set KUNLUN_XPU_SMI)",
        ),
        ("no-card", "no Kunlun card: xpu-smi lists none"),
    ],
)
def test_no_tool_or_no_card_says_so(capsys: pytest.CaptureFixture[str], host: str, reason: str) -> None:
    assert run(capsys, preflight(host, kml="")) == (1, "", [f"preflight failed: {reason}"])


def test_unreadable_output_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, preflight("garbage"))
    assert code == 1
    assert len(err) == 1
    assert err[0].startswith("preflight failed: cannot read the node: xpu-smi: unexpected cell 'lots of MiB")


def test_cards_with_different_firmware_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    host = tmp_path / "mixed"
    shutil.copytree(FIXTURES / "p800-8", host)
    query = host / "outputs" / "query-3.txt"
    query.write_text(query.read_text().replace("1.0.2.14.1.54", "1.0.2.14.1.60"))
    assert run(capsys, preflight(host))[2] == [
        "preflight failed: firmware mismatch on xpu3: found 1.0.2.14.1.60, expected 1.0.2.14.1.54"
    ]


def test_json_reports_everything_found(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "2,5")
    code, out, err = run(capsys, [*preflight("p800-failing", kml="3.3.0"), "--json"])
    card = {"product": "P800 OAM", "memory_total_bytes": 98304 * MIB, "firmware_version": "1.0.2.14.1.54"}
    reason = (
        "xpu5 unhealthy: ecc-uncorrectable: 3 uncorrectable ECC errors; "
        "kml mismatch: found 3.2.0, expected 3.3.0"
    )
    assert (code, err) == (1, [f"preflight failed: {reason}"])
    assert json.loads(out) == {
        "ok": False,
        "reason": reason,
        "xpu_smi": str(FIXTURES / "p800-failing" / "xpu-smi"),
        "dev_root": str(FIXTURES / "p800-failing" / "root"),
        "visible_devices": [2, 5],
        "expected": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.3.0"},
        "found": {"driver": "5.0.21.26", "runtime": "5.0.21", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
        "cards": [
            {
                "index": 2,
                "uuid": "GPU-7c1f0002-5a2b-5c3d-8e4f-012345678902",
                **card,
                "healthy": True,
                "findings": [{"check": "temperature-high", "severity": "warn", "detail": "88C >= 85C"}],
            },
            {
                "index": 5,
                "uuid": "GPU-7c1f0005-5a2b-5c3d-8e4f-012345678905",
                **card,
                "healthy": False,
                "findings": [
                    {
                        "check": "ecc-uncorrectable",
                        "severity": "unhealthy",
                        "detail": "3 uncorrectable ECC errors",
                    }
                ],
            },
        ],
    }


def copy_host(tmp_path: Path, name: str = "p800-8") -> Path:
    host = tmp_path / name
    shutil.copytree(FIXTURES / name, host, symlinks=True)
    return host


def test_a_missing_kml_version_file_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    host = copy_host(tmp_path)
    (host / "root" / "usr/local/xpu/kml/VERSION").unlink()
    root = host / "root"
    assert run(capsys, preflight(host)) == (
        1,
        "",
        [
            f"preflight failed: cannot read the KML version: {root}/usr/local/xpu/kml/VERSION does not "
            f"exist (--kml-version-file /usr/local/xpu/kml/VERSION under --dev-root {root})"
        ],
    )
    code, _, err = run(capsys, [*preflight(host), "--kml-version-file", ""])
    assert (code, err) == (
        1,
        [
            "preflight failed: cannot read the KML version: no KML version file given "
            "(--kml-version-file is empty)"
        ],
    )
    # not expected, not needed: nothing else depends on it
    assert run(capsys, preflight(host, kml=""))[0] == 0


def test_an_unreadable_kml_version_file_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    host = copy_host(tmp_path)
    version = host / "root" / "usr/local/xpu/kml/VERSION"
    version.unlink()
    version.mkdir()  # a directory where the file should be: unreadable for any user, root included
    code, _, err = run(capsys, preflight(host))
    assert code == 1
    assert err == [
        f"preflight failed: cannot read the KML version: {version}: Is a directory "
        f"(--kml-version-file /usr/local/xpu/kml/VERSION under --dev-root {host / 'root'})"
    ]


def test_a_missing_xpu_smi_is_named_with_its_path(capsys: pytest.CaptureFixture[str]) -> None:
    args = preflight("p800-8")
    args[args.index("--xpu-smi") + 1] = "/run/kunlun-host/bin/xpu-smi"
    assert run(capsys, args)[2] == [
        "preflight failed: cannot read the driver and firmware versions: xpu-smi not found or not "
        "executable: '/run/kunlun-host/bin/xpu-smi' (install the Kunlun driver tools or pass --xpu-smi / "
        "set KUNLUN_XPU_SMI)"
    ]


def test_an_allocated_card_without_its_device_node_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host = copy_host(tmp_path)
    (host / "root" / "dev" / "xpu3").unlink()
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "3")
    assert run(capsys, [*preflight(host), "--require-allocation"])[2] == [
        "preflight failed: xpu3 unhealthy: device-node-missing: /dev/xpu3 does not exist"
    ]


def test_no_allocation_fails_only_when_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, preflight("p800-8"))[0] == 0  # by hand on a node: every card is checked
    code, out, err = run(capsys, [*preflight("p800-8"), "--require-allocation", "--json"])
    reason = (
        "XPU_VISIBLE_DEVICES is not set: the device plugin allocated no card to this container "
        "(it must request kunlunxin.com/xpu on a node running the Kunlun device plugin)"
    )
    assert (code, err) == (1, [f"preflight failed: {reason}"])
    assert json.loads(out)["found"] == dict.fromkeys(("driver", "runtime", "firmware", "kml"))


def test_a_firmware_version_xpu_smi_does_not_print_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    host = copy_host(tmp_path)
    query = host / "outputs" / "query-0.txt"
    query.write_text("\n".join(line for line in query.read_text().splitlines() if "ALL Version" not in line))
    assert run(capsys, preflight(host))[2] == [
        "preflight failed: cannot read the firmware version of xpu0: xpu-smi -q printed none"
    ]


def container_root(tmp_path: Path, host: Path, init: dict, volumes: list[dict], visible: str) -> Path:
    """The preflight container's view of the node: its hostPath mounts and the device nodes kubelet
    hands it for the cards ``visible`` (the device plugin's Allocate: /dev/xpuN and /dev/xpuctrl)."""
    root = tmp_path / "container"
    by_name = {v["name"]: v for v in volumes}
    for mount in init["volumeMounts"]:
        volume = by_name[mount["name"]]
        assert mount["readOnly"] is True and volume["hostPath"]["type"] in ("File", "")
        target = root / mount["mountPath"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        source = host / "root" / volume["hostPath"]["path"].lstrip("/")
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)  # the KML file's directory
    (root / "dev").mkdir()
    for name in [f"xpu{i}" for i in visible.split(",")] + ["xpuctrl"]:
        (root / "dev" / name).touch()
    return root


def test_the_operators_init_container_runs_on_what_the_pod_mounts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = parse_spec(make_raw_spec(versions={**GOOD, "policy": "Strict"}, resources={"xpus": 2}))
    pod = build_pod_spec(make_ref(), spec, "runtime:test", image_volumes=False)
    init = next(c for c in pod["initContainers"] if c["name"] == "preflight")
    assert init["command"] == ["kunlun-runtime"]
    host = FIXTURES / "p800-8"
    root = container_root(tmp_path, host, init, pod["volumes"], visible="4,5")
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("KUNLUN_XPU_SMI", str(host / "xpu-smi"))  # the image's own xpu-smi
    args = [*init["args"], "--dev-root", str(root)]  # the container's / is this directory here
    assert run(capsys, args) == (
        0,
        "preflight ok: 2 healthy card(s) (P800 OAM); driver 5.0.21.26, firmware 1.0.2.14.1.54, kml 3.2.0\n",
        [],
    )
    # the pod on a node where the file is not where the operator mounts it from: named exactly
    (root / "run/kunlun-host/usr/local/xpu/kml/VERSION").unlink()
    assert run(capsys, args)[2] == [
        f"preflight failed: cannot read the KML version: {root}/run/kunlun-host/usr/local/xpu/kml/VERSION "
        f"does not exist (--kml-version-file /run/kunlun-host/usr/local/xpu/kml/VERSION under --dev-root {root})"
    ]
    monkeypatch.delenv("XPU_VISIBLE_DEVICES")  # scheduled without the device plugin's Allocate
    assert run(capsys, args)[2][0].startswith("preflight failed: XPU_VISIBLE_DEVICES is not set")
