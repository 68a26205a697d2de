"""The runtime's `kunlun` image, built on a fake vendor stack (tests/images/fake_stack.py).

Inside the image: the platform probe picks Kunlun, `preflight` passes against a fixture host and
fails in each case a real node can present, `--version` answers. A stack that differs from the
checksums in the versions file never becomes an image, and the message says why.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.images import fake_stack
from tests.images.conftest import REPO, Podman

pytestmark = pytest.mark.slow
IMAGE = "localhost/kunlun-runtime:kunlun-fake-stack"
FIXTURES = REPO / "tests" / "fixtures" / "xpu"
EXPECT = ["--expect-driver", "5.0.21.26", "--expect-firmware", "1.0.2.14.1.54", "--expect-kml", "3.2.0"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = fake_stack.make_stack(tmp_path_factory.mktemp("stack") / "kunlun-stack")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def kunlun_image(podman: Podman, stack: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    versions = fake_stack.write_versions(
        tmp_path_factory.mktemp("versions") / "versions.yaml", fake_stack.checksums(stack)
    )
    result = podman.build_script(
        "--only", "kunlun", "--kunlun-stack", str(stack), "--versions", str(versions), "--kunlun-tag", IMAGE
    )
    if result.returncode != 0:
        pytest.fail(f"the kunlun image did not build:\n{result.stdout[-4000:]}{result.stderr}")
    return IMAGE


def run(podman: Podman, image: str, *args: str, host: str = "p800-8", env: dict[str, str] | None = None):
    """``kunlun-runtime ARGS`` in a throw-away container, the fixture host's root at /host."""
    options = ["--rm", "--network", "none", "--read-only"]
    options += ["--volume", f"{FIXTURES / host}:/fixture:ro", "--env", "KUNLUN_DEV_ROOT=/fixture/root"]
    for name, value in (env or {}).items():
        options += ["--env", f"{name}={value}"]
    return podman("run", *options, image, *args, check=False, timeout=120)


def test_the_platform_probe_finds_the_kunlun_stack(podman: Podman, kunlun_image: str) -> None:
    probe = "from kunlun_runtime.platforms import detect; p = detect(); print(p.name, p.num_cards())"
    result = podman("run", "--rm", "--network", "none", "--entrypoint", "python3", kunlun_image, "-c", probe)
    assert result.stdout.strip() == "kunlun 8"  # the image's xpu-smi: the healthy 8-card fixture


def test_version_answers(podman: Podman, kunlun_image: str) -> None:
    result = run(podman, kunlun_image, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kunlun-runtime 0.1.0\n")


def test_the_image_records_its_stack(podman: Podman, kunlun_image: str) -> None:
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", kunlun_image).stdout)
    assert {
        k: v for k, v in labels.items() if k.startswith("dev.kunlun.") and k != "dev.kunlun.python-image"
    } == {
        "dev.kunlun.variant": "kunlun",
        "dev.kunlun.xre-version": "5.0.21",
        "dev.kunlun.kml-version": "3.2.0",
        "dev.kunlun.driver-version": "5.0.21.26",
    }
    result = podman(
        "run",
        "--rm",
        "--entrypoint",
        "cat",
        kunlun_image,
        "/opt/kunlun/VERSIONS",
        "/usr/local/xpu/kml/VERSION",
    )
    assert result.stdout == "xre=5.0.21\nkml=3.2.0\ndriver=5.0.21.26\nruntime=0.1.0\n3.2.0\n"


def test_preflight_passes_on_a_matching_healthy_host(podman: Podman, kunlun_image: str) -> None:
    result = run(podman, kunlun_image, "preflight", *EXPECT, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["found"]["driver"] == "5.0.21.26" and report["found"]["kml"] == "3.2.0"
    assert len(report["cards"]) == 8


@pytest.mark.parametrize(
    ("case", "args", "host", "env", "reason"),
    [
        (
            "driver",
            ["--expect-driver", "5.0.22.1"],
            "p800-8",
            {},
            "driver mismatch: found 5.0.21.26, expected 5.0.22.1",
        ),
        ("firmware", ["--expect-firmware", "1.0.3.0.0.1"], "p800-8", {}, "firmware mismatch"),
        ("kml", ["--expect-kml", "3.3.0"], "p800-8", {}, "kml mismatch: found 3.2.0, expected 3.3.0"),
        (
            "failing card",
            [],
            "p800-failing",
            {"KUNLUN_XPU_SMI": "/fixture/xpu-smi"},
            "xpu5 unhealthy: ecc-uncorrectable",
        ),
        ("no xpu-smi", [], "p800-8", {"KUNLUN_XPU_SMI": "/nonexistent/xpu-smi"}, "xpu-smi not found"),
        ("no card", [], "no-card", {"KUNLUN_XPU_SMI": "/fixture/xpu-smi"}, "no Kunlun card"),
    ],
)
def test_preflight_fails_and_says_why(
    podman: Podman, kunlun_image: str, case: str, args: list[str], host: str, env: dict[str, str], reason: str
) -> None:
    overrides = dict(zip(args[::2], args[1::2], strict=True))
    merged: list[str] = []
    for flag, value in zip(EXPECT[::2], EXPECT[1::2], strict=True):
        merged += [flag, overrides.get(flag, value)]
    result = run(podman, kunlun_image, "preflight", *merged, host=host, env=env)
    assert result.returncode == 1, (case, result.stdout, result.stderr)
    assert reason in result.stderr, (case, result.stderr)


def test_a_stack_that_differs_from_its_checksums_is_not_built(
    podman: Podman, stack: Path, tmp_path: Path
) -> None:
    sums = fake_stack.checksums(stack)
    sums["kml/VERSION"] = "0" * 64
    versions = fake_stack.write_versions(tmp_path / "versions.yaml", sums)
    result = podman.build_script(
        "--only", "kunlun", "--kunlun-stack", str(stack), "--versions", str(versions)
    )
    assert result.returncode != 0
    assert (
        f"kml/VERSION: sha256 {fake_stack.checksums(stack)['kml/VERSION']}, {versions} lists {'0' * 64}"
        in result.stderr
    )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no folder", "no such folder"),
        ("no checksums", "lists no sha256 under kunlunStack.sha256"),
        ("listed file missing", "extra.bin: listed but missing"),
        ("file not listed", "lib/libxpurt.so: not listed in"),
    ],
)
def test_a_missing_or_uncertified_stack_is_refused_before_building(
    podman: Podman, stack: Path, tmp_path: Path, case: str, message: str
) -> None:
    sums = fake_stack.checksums(stack)
    if case == "no checksums":
        sums = {}
    elif case == "listed file missing":
        sums["extra.bin"] = "0" * 64
    elif case == "file not listed":
        del sums["lib/libxpurt.so"]
    versions = fake_stack.write_versions(tmp_path / "versions.yaml", sums)
    where = tmp_path / "missing" if case == "no folder" else stack
    result = podman.build_script(
        "--only", "kunlun", "--kunlun-stack", str(where), "--versions", str(versions)
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_the_repository_versions_file_certifies_no_stack_yet(podman: Podman, stack: Path) -> None:
    result = podman.build_script("--only", "kunlun", "--kunlun-stack", str(stack))
    assert result.returncode != 0
    assert "versions.yaml lists no sha256 under kunlunStack.sha256" in result.stderr


def test_the_dockerfile_checks_the_stack_itself(
    podman: Podman, tmp_path: Path, runtime_cpu_image: str
) -> None:
    # A build by hand (without the script's check) must stop at the stack check too. A tiny
    # stack: the check runs before anything is installed, so no torch wheel is needed. The
    # runtime_cpu_image fixture has built the shared deps stage, so this build is short.
    small = tmp_path / "kunlun-stack"
    (small / "kml").mkdir(parents=True)
    (small / "kml" / "VERSION").write_text("3.2.0\n")
    (tmp_path / "sums").mkdir()
    (tmp_path / "sums" / "SHA256SUMS").write_text(f"{'0' * 64}  kml/VERSION\n")
    ca = "/etc/ssl/certs/ca-certificates.crt"
    result = podman(
        "build", "--network", "host", "--volume", f"{ca}:{ca}:ro",
        "--build-arg", "COMMON_IMAGE=localhost/kunlun-common:dev",
        "--build-arg", "PACKAGE_IMAGE=localhost/kunlun-package:dev",
        "--build-context", f"kunlun-stack={small}", "--build-context", f"kunlun-stack-sums={tmp_path / 'sums'}",
        "-f", str(REPO / "runtime" / "Dockerfile"), "--target", "kunlun", str(REPO),
        check=False, timeout=900,
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "kunlun-stack: files differ from kunlunStack.sha256 in versions.yaml" in result.stdout + result.stderr
    )
