"""`kunlun-runtime preflight` against the fixture hosts: exit status, the one-line reason, --json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kunlun_operator.builders.deployment import build_pod_spec
from kunlun_operator.spec import parse_spec
from kunlun_runtime.cli import main
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
            f"xpu-smi not found or not executable: {str(FIXTURES / 'missing-tool' / 'xpu-smi')!r} "
            "(install the Kunlun driver tools or pass --xpu-smi / set KUNLUN_XPU_SMI)",
        ),
        ("no-card", "no Kunlun card: xpu-smi lists none"),
    ],
)
def test_no_tool_or_no_card_says_so(capsys: pytest.CaptureFixture[str], host: str, reason: str) -> None:
    assert run(capsys, preflight(host)) == (1, "", [f"preflight failed: {reason}"])


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


def test_the_operators_init_container_args_are_accepted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_spec(make_raw_spec(versions={**GOOD, "policy": "Strict"}))
    pod = build_pod_spec(make_ref(), spec, "runtime:test", image_volumes=False)
    init = next(c for c in pod["initContainers"] if c["name"] == "preflight")
    assert init["command"] == ["kunlun-runtime"]
    # the container finds xpu-smi and the host files through the environment, as an image would set them
    monkeypatch.setenv("KUNLUN_XPU_SMI", str(FIXTURES / "p800-8" / "xpu-smi"))
    monkeypatch.setenv("KUNLUN_DEV_ROOT", str(FIXTURES / "p800-8" / "root"))
    assert run(capsys, init["args"])[0] == 0
