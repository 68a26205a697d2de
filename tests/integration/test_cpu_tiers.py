"""The runtime on each CPU tier below the machine's, forced with KUNLUN_CPU_ISA in fresh processes
(the probe is read once per process): the plain floor (no kernels of ours) serves and passes
golden; what a tier cannot run is refused at start with the setting and the reason named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kunlun_runtime.golden.runner import BF16_KV_TOLERANCE
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities
from tests.integration.server.live import free_port, health_status
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_for

CLI_MAIN = "import sys; from kunlun_runtime.commands.cli import main; sys.exit(main())"
HAS_AVX2 = cpu_capabilities().detected_tier >= IsaTier.AVX2


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiers") / "tiny")


def run_cli(tier: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUNLUN_CPU_ISA": tier}
    return subprocess.run(
        [sys.executable, "-c", CLI_MAIN, *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_version_shows_the_forced_tier_and_what_the_cpu_has() -> None:
    result = run_cli("none", "--version")
    assert result.returncode == 0, result.stderr
    detected = cpu_capabilities().detected_tier.value
    forced = "" if detected == "none" else f" (forced; the CPU has {detected})"
    assert f"isa tier: none{forced}\n" in result.stdout
    assert result.stdout.startswith("kunlun-runtime ")


def test_a_tier_the_cpu_lacks_is_refused_with_the_missing_flags() -> None:
    if cpu_capabilities().detected_tier is IsaTier.AMX:
        pytest.skip("this CPU has every tier")
    result = run_cli("amx", "--version")
    assert result.returncode == 2
    assert "KUNLUN_CPU_ISA=amx" in result.stderr and "lacks" in result.stderr


@pytest.mark.parametrize(
    ("tensor_parallel_size", "kv_cache_dtype", "kv_report", "bound"),
    [
        ("1", "auto", "bfloat16", BF16_KV_TOLERANCE),  # auto: BF16 K/V under FP32 activations
        ("2", "auto", "bfloat16", BF16_KV_TOLERANCE),  # the KV dtype reaches the worker ranks
        ("1", "float32", None, 1e-4),
    ],
)
def test_the_plain_floor_passes_golden_in_fp32_over_bf16_weights(
    tiny_model_dir: Path, tensor_parallel_size, kv_cache_dtype, kv_report, bound
) -> None:
    result = run_cli("none", "golden", "--model", str(tiny_model_dir), "--dtype", "auto", "--json",
                     "--tensor-parallel-size", tensor_parallel_size, "--kv-cache-dtype", kv_cache_dtype)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["dtype"], report["weight_dtype"], report["passed"]) == ("float32", "bfloat16", True)
    assert (report["tensor_parallel_size"], report["kv_cache_dtype"]) == (
        int(tensor_parallel_size),
        kv_report,
    )
    assert max(layer["max_rel_err"] for layer in report["layers"]) <= bound


def test_kernels_the_forced_tier_lacks_are_refused_by_name(tiny_model_dir: Path) -> None:
    native = run_cli("none", "generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                     "--linear-backend", "native")  # fmt: skip
    assert native.returncode == 2
    assert "linear_backend: native is unavailable here" in native.stderr
    forced = cpu_capabilities().detected_tier is not IsaTier.NONE  # on aarch64 nothing is forced
    assert ("KUNLUN_CPU_ISA=none" in native.stderr) == forced
    prepacked = run_cli("none", "generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                        "--dtype", "bfloat16", "--linear-backend", "prepacked")  # fmt: skip
    assert prepacked.returncode == 2
    assert "linear_backend: prepacked (oneDNN BF16) is unavailable here" in prepacked.stderr


def test_the_plain_floor_serves_the_openai_api(tiny_model_dir: Path) -> None:
    port = free_port()
    command = [
        sys.executable, "-c", CLI_MAIN, "--log-level", "INFO", "serve", "--model", str(tiny_model_dir),
        "--kv-cache-memory", "16MiB", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "KUNLUN_CPU_ISA": "none"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: health_status(base_url) == 200,
            timeout_seconds=300.0,
            message="the server to become ready",
        )
        assert httpx.get(f"{base_url}/version").json()["cpu"]["isa_tier"] == "none"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model=tiny_model_dir.name,
            prompt="hello",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    assert "backend=plain tier=none (the avx2 kernels need the avx2 ISA tier; " in output  # the start line
    assert " dtype=float32 weights=bfloat16 " in output
    assert (
        "ISA tier none (forced by KUNLUN_CPU_ISA" in output
        or cpu_capabilities().detected_tier is IsaTier.NONE
    )


@pytest.mark.skipif(not HAS_AVX2, reason="the CPU lacks AVX2, FMA or F16C")
def test_the_avx2_tier_runs_our_kernels_and_passes_golden(tiny_model_dir: Path) -> None:
    result = run_cli("avx2", "golden", "--model", str(tiny_model_dir), "--dtype", "auto", "--chunk-size", "1",
                     "--linear-backend", "native", "--json")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["dtype"], report["weight_dtype"], report["passed"]) == ("float32", "bfloat16", True)
