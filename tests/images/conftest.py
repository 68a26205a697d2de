"""Fixtures for the image tests: podman, and the images scripts/build-images.sh builds with it.

Each image is built once per session through the script (its layer cache makes a build of
unchanged sources a few seconds), so the tests always run what the Dockerfiles make of this
checkout. Without podman the tests skip with the reason, unless ``KUNLUN_REQUIRE_IMAGES=1`` (CI):
then a missing podman fails them. Containers use the host's network, so every port is chosen free
and every container gets a unique name and is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "KUNLUN_REQUIRE_IMAGES"
RUNTIME_CPU = "localhost/kunlun-runtime:cpu"
OPERATOR = "localhost/kunlun-operator:dev"
DEVICE_PLUGIN = "localhost/kunlun-device-plugin:dev"
BUILD_TIMEOUT_SECONDS = 1800  # a cold build of the runtime on 2 cores, with margin


def podman_missing_reason() -> str | None:
    """Why images cannot be built and run here (None: they can)."""
    for tool in ("podman", "runc", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y podman runc debootstrap)"
    if os.geteuid() != 0:
        return "podman runs rootful here (rootless needs subordinate ids this machine may lack)"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Podman:
    """podman with the settings these machines need (runc, no default ulimits)."""

    env: dict[str, str]

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run ``podman ARGS``; with ``check``, a failure fails the test with podman's output."""
        result = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"podman {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
            )
        return result

    def build_script(self, *args: str) -> subprocess.CompletedProcess[str]:
        """scripts/build-images.sh ARGS (not checked: some tests expect it to fail)."""
        return subprocess.run(
            ["bash", str(REPO / "scripts" / "build-images.sh"), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_SECONDS,
        )

    def build(self, *only: str) -> None:
        result = self.build_script("--only", ",".join(only))
        if result.returncode != 0:
            pytest.fail(
                f"build-images.sh --only {','.join(only)} failed:\n{result.stdout[-4000:]}{result.stderr}"
            )

    def container_name(self, what: str) -> str:
        return f"kunlun-test-{what}-{uuid.uuid4().hex[:8]}"

    def remove(self, name: str) -> None:
        self("rm", "--force", "--time", "0", name, check=False)


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    reason = podman_missing_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but images cannot be built here: {reason}")
        pytest.skip(reason)
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env:
        # crun fails on these machines (cgroups in hybrid mode, setrlimit): runc, no default ulimits.
        conf = tmp_path_factory.mktemp("podman") / "containers.conf"
        conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n')
        env["CONTAINERS_CONF"] = str(conf)
    return Podman(env)


@pytest.fixture(scope="session")
def runtime_cpu_image(podman: Podman) -> str:
    podman.build("cpu")
    return RUNTIME_CPU


@pytest.fixture(scope="session")
def operator_image(podman: Podman) -> str:
    podman.build("operator")
    return OPERATOR


@pytest.fixture(scope="session")
def device_plugin_image(podman: Podman) -> str:
    podman.build("device-plugin")
    return DEVICE_PLUGIN


@pytest.fixture
def container(podman: Podman) -> Iterator[list[str]]:
    """Names appended here are removed after the test (running or not)."""
    names: list[str] = []
    yield names
    for name in names:
        podman.remove(name)
