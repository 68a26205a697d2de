"""Our CPU kernels failing for real, in fresh processes (whether they load is decided once per
process): a compiler that fails (``CXX=/bin/false``, nothing cached) and a prebuilt library that
does not load (``KUNLUN_CPU_KERNELS_DIR`` holding broken files). Either way the server still
serves, on the fall-back it names in its start line, with a WARNING giving the reason and the
cost, and /version and kunlun:runtime_info saying what runs; with --require-native-kernels or
KUNLUN_REQUIRE_NATIVE_KERNELS=1 the same fault is a start error that names it. ``--version``
says, without a model and without compiling, whether the kernels are there and load."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.kernel_choice import onednn_bf16_reason
from kunlun_runtime.platforms.cpu_features import cpu_capabilities
from tests.integration.server.live import free_port, health_status, sample, scrape
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_for

CLI_MAIN = "import sys; from kunlun_runtime.commands.cli import main; sys.exit(main())"
AUTO_DTYPE = torch.bfloat16 if cpu_capabilities().computes_bf16 else torch.float32
TIER = cpu_kernels.tier_for_dtype(AUTO_DTYPE)
RUNS_A_TIER = TIER is not None and cpu_kernels.cpu_reason(TIER) is None
# What --linear-backend auto falls back to without our kernels (kernel_choice.decide).
FALLBACK = "prepacked" if cpu_capabilities().computes_bf16 and onednn_bf16_reason() is None else "plain"
pytestmark = pytest.mark.skipif(not RUNS_A_TIER, reason="this CPU runs none of our kernel tiers")


@dataclass(frozen=True, slots=True)
class Fault:
    env: dict[str, str]  # what breaks the kernels
    reason: str  # how the fault's reason starts
    first_start: bool  # a compile was attempted (and announced)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fallbacks") / "tiny")


@pytest.fixture(params=["compiler", "loader"])
def fault(request: pytest.FixtureRequest, tmp_path: Path) -> Fault:
    assert TIER is not None
    empty_cache = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    if request.param == "compiler":
        reason = f"building the {TIER.tier.value} CPU kernels failed: "
        return Fault({**empty_cache, "CXX": "/bin/false"}, reason, first_start=True)
    broken = tmp_path / "kernels"
    broken.mkdir()
    for tier in cpu_kernels.TIERS.values():
        (broken / f"{tier.namespace}.so").write_bytes(b"\x7fELF truncated")
    library = broken / f"{TIER.namespace}.so"
    reason = f"loading {library} (KUNLUN_CPU_KERNELS_DIR) failed: {library}: "
    return Fault({**empty_cache, "KUNLUN_CPU_KERNELS_DIR": str(broken)}, reason, first_start=False)


def environment(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUNLUN_CPU_KERNELS_DIR", "KUNLUN_REQUIRE_NATIVE_KERNELS")
    }
    return {**env, **extra}


@pytest.fixture
def served(tiny_model_dir: Path, fault: Fault, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A server in a fresh process with the fault; yields its URL and its stderr's file."""
    port, log = free_port(), tmp_path / "serve.log"
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--host", "127.0.0.1"]
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", CLI_MAIN, *args, "--kv-cache-memory", "16MiB"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=environment(fault.env),
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: process.poll() is not None or health_status(base_url) == 200,
            timeout_seconds=300.0,
            message="the server to be ready",
        )
        assert process.poll() is None, log.read_text()
        yield base_url, log
    finally:
        process.terminate()
        process.wait(60)


def test_the_server_falls_back_and_says_why_what_it_costs_and_what_runs(
    served: tuple[str, Path], fault: Fault
) -> None:
    base_url, log = served
    runtime = httpx.get(f"{base_url}/version", timeout=10).json()["runtime"]
    assert (runtime["backend"], runtime["tier"], runtime["native_layers"]) == (FALLBACK, "none", False)
    assert runtime["dtype"] == str(AUTO_DTYPE).removeprefix("torch.")
    assert runtime["fault"].startswith(fault.reason), runtime["fault"]
    assert runtime["cost"].startswith("decode runs on ") and "docs/performance.md" in runtime["cost"]
    info = {"backend": FALLBACK, "tier": "none", "dtype": runtime["dtype"], "kv_dtype": runtime["kv_dtype"]}
    assert sample(scrape(base_url), "kunlun:runtime_info", **info) == 1
    text = log.read_text()
    assert (
        f"backend={FALLBACK} tier=none dtype={runtime['dtype']} weights=bfloat16 "
        f"kv_dtype={runtime['kv_dtype']} kv_capacity={runtime['num_kv_tokens']} tokens"
    ) in text
    warning = f"our CPU kernels are not running: {runtime['fault']}; {runtime['cost']}"
    assert f"WARNING kunlun_runtime.layers.runtime_info: {warning}" in text
    announced = f"first start on this machine: building the {runtime_tier()} CPU kernels" in text
    assert announced is fault.first_start


def runtime_tier() -> str:
    assert TIER is not None
    return TIER.tier.value


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_requiring_native_kernels_makes_the_fault_a_start_error(
    tiny_model_dir: Path, fault: Fault, how: str
) -> None:
    flag = ["--require-native-kernels"] if how == "flag" else []
    env = {**fault.env, **({"KUNLUN_REQUIRE_NATIVE_KERNELS": "1"} if how == "environment" else {})}
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "2", *flag]
    result = subprocess.run(
        [sys.executable, "-c", CLI_MAIN, *args],
        capture_output=True,
        text=True,
        env=environment(env),
        timeout=600,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    expected = (
        "kunlun-runtime generate: error: require_native_kernels: the engine runs on the CPU and our "
        f"CPU kernels did not load: {fault.reason}"
    )
    assert expected in result.stderr, result.stderr
    assert "without them decode runs on" in result.stderr and "--require-native-kernels" in result.stderr


def version(env: dict[str, str], prefix: str = "cpu kernels (without a model): ") -> str:
    result = subprocess.run(
        [sys.executable, "-c", CLI_MAIN, "--version"],
        capture_output=True,
        text=True,
        env=environment(env),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith(prefix)]
    return line.removeprefix(prefix)


DEFAULTS = "defaults on the cpu (without a model): "


def test_version_says_without_a_model_whether_the_kernels_load(fault: Fault, tmp_path: Path) -> None:
    assert TIER is not None
    auto = f"{TIER.tier.value} (--dtype auto computes in {str(AUTO_DTYPE).removeprefix('torch.')} here): "
    if "KUNLUN_CPU_KERNELS_DIR" in fault.env:
        assert version(fault.env).startswith(auto + fault.reason)
        # the backend the automatic choice falls back to, with no kernel tier running
        assert re.fullmatch(
            r"backend=(prepacked|plain) tier=none dtype=\w+ weights=\w+ kv_dtype=\w+",
            version(fault.env, DEFAULTS),
        )
        return
    cache = Path(fault.env["TORCH_EXTENSIONS_DIR"])
    found = shutil.which(fault.env["CXX"])
    assert version(fault.env) == (
        f"{auto}not built yet; the first start compiles it once, with {found}, into "
        f"{cache / cpu_kernels.cached_library(TIER).parent.name}"
    )
    assert not cache.exists()  # asking compiled and created nothing
    # not built yet: the defaults are what the first start builds and runs
    assert version(fault.env, DEFAULTS).startswith(f"backend=native tier={TIER.tier.value} dtype=")
    if not cpu_kernels.load(AUTO_DTYPE):  # this process's build, copied where a later start finds it
        pytest.fail(
            f"the {TIER.tier.value} kernels do not build here: {cpu_kernels.unavailable_reason(AUTO_DTYPE)}"
        )
    built = cpu_kernels.cached_library(TIER)
    prebuilt = os.environ.get(cpu_kernels.PREBUILT_ENV)  # where this process loaded them from instead
    source = Path(prebuilt) / f"{TIER.namespace}.so" if prebuilt else built
    (cache / built.parent.name).mkdir(parents=True)
    shutil.copy2(source, cache / built.parent.name / built.name)
    assert version(fault.env) == f"{auto}built earlier (cached in {cache / built.parent.name}), loads"


def test_a_cached_library_that_does_not_load_is_rebuilt_and_said(tmp_path: Path) -> None:
    if os.environ.get(cpu_kernels.PREBUILT_ENV):
        pytest.skip("this process loads prebuilt kernels (KUNLUN_CPU_KERNELS_DIR), not a build cache")
    assert TIER is not None
    if not cpu_kernels.load(AUTO_DTYPE):
        pytest.fail(
            f"the {TIER.tier.value} kernels do not build here: {cpu_kernels.unavailable_reason(AUTO_DTYPE)}"
        )
    built = cpu_kernels.cached_library(TIER)
    cache = tmp_path / "torch_extensions"
    shutil.copytree(built.parent, cache / built.parent.name)
    broken = cache / built.parent.name / built.name
    broken.write_bytes(b"\x7fELF truncated")  # a cached library that no longer loads
    probe = (
        "import torch; from kunlun_runtime.layers import cpu_kernels; "
        f"print(cpu_kernels.unavailable_reason(torch.{str(AUTO_DTYPE).removeprefix('torch.')}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=environment({"TORCH_EXTENSIONS_DIR": str(cache)}),
        timeout=600,
    )
    assert result.stdout.strip() == "None", result.stderr  # rebuilt and loaded
    assert f"the {TIER.tier.value} CPU kernels cached in {broken} do not load (" in result.stderr
    assert "rebuilding" in result.stderr
    assert broken.read_bytes()[:4] == b"\x7fELF" and broken.stat().st_size > 1000
