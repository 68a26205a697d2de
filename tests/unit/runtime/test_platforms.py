"""Platforms: Kunlun on fixture hosts (versions, telemetry, memory, card mapping, missing stack), CPU
telemetry, and detect()."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms import CpuPlatform, Telemetry, Versions, detect
from kunlun_runtime.platforms import kunlun as kunlun_module
from kunlun_runtime.platforms.kunlun import KunlunPlatform, probe_stack, source_from_env, visible_card_indices

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "xpu"
MIB = 1024 * 1024


def host_env(host: str, **extra: str) -> dict[str, str]:
    return {
        "KUNLUN_XPU_SMI": str(FIXTURES / host / "xpu-smi"),
        "KUNLUN_DEV_ROOT": str(FIXTURES / host / "root"),
        **extra,
    }


def make_kunlun(host: str, local_index: int = 0, **extra: str) -> KunlunPlatform:
    env = host_env(host, **extra)
    return KunlunPlatform(source_from_env(env), local_index=local_index, env=env)


def test_kunlun_versions_on_p800_host() -> None:
    assert make_kunlun("p800-8").versions() == Versions(
        driver="5.0.21.26", firmware="1.0.2.14.1.54", compute_library="kml-3.2.0"
    )


def test_kunlun_telemetry_follows_xpu_visible_devices() -> None:
    # local rank 1 of XPU_VISIBLE_DEVICES=4,5 is host card 5 (busy: 61440 MiB used, 91 %)
    platform = make_kunlun("p800-8", local_index=1, XPU_VISIBLE_DEVICES="4,5")
    assert platform.host_index() == 5
    assert platform.device() == torch.device("cuda", 1)
    assert platform.telemetry() == Telemetry(
        utilization_ratio=0.91,
        memory_used_bytes=61440 * MIB,
        memory_total_bytes=98304 * MIB,
        temperature_celsius=41.0,
        power_watts=90.0,
    )
    assert (platform.total_memory_bytes(), platform.free_memory_bytes()) == (98304 * MIB, 36864 * MIB)
    assert platform.num_cards() == 2


def test_kunlun_without_visible_devices_uses_rank_as_card_and_counts_all() -> None:
    platform = make_kunlun("p800-8", local_index=3)
    assert (platform.host_index(), platform.num_cards(), platform.free_memory_bytes()) == (3, 8, 98304 * MIB)
    assert platform.telemetry().temperature_celsius == 44.0


def test_kunlun_rank_beyond_visible_devices_is_a_config_error() -> None:
    platform = make_kunlun("p800-8", local_index=2, XPU_VISIBLE_DEVICES="4,5")
    with pytest.raises(ConfigError, match="local rank 2 but XPU_VISIBLE_DEVICES lists 2 cards"):
        platform.host_index()


@pytest.mark.parametrize("value", ["4,x", "0;1", "-1"])
def test_bad_xpu_visible_devices_names_the_variable(value: str) -> None:
    message = "XPU_VISIBLE_DEVICES: expected comma-separated card indices"
    with pytest.raises(ConfigError, match=message) as info:
        visible_card_indices({"XPU_VISIBLE_DEVICES": value})
    assert info.value.field == "XPU_VISIBLE_DEVICES"
    assert visible_card_indices({"XPU_VISIBLE_DEVICES": " 0, 2 "}) == (0, 2)
    assert visible_card_indices({}) is None


@pytest.mark.parametrize("host", ["missing-tool", "garbage"])
def test_kunlun_readings_are_none_when_xpu_smi_fails(host: str) -> None:
    platform = make_kunlun(host)
    assert platform.telemetry() == Telemetry()
    assert platform.versions() == Versions()
    with pytest.raises(ConfigError, match="cannot read the memory of card 0 from xpu-smi"):
        platform.total_memory_bytes()
    with pytest.raises(ConfigError, match="device: cannot count the Kunlun cards: "):
        platform.num_cards()


def test_kunlun_card_not_listed_gives_no_readings() -> None:
    assert make_kunlun("p800-8", XPU_VISIBLE_DEVICES="9").telemetry() == Telemetry()


def test_probe_finds_complete_stack_on_fixture_host() -> None:
    stack = probe_stack(host_env("p800-8"), find_module=lambda name: name == "xtorch_ops")
    assert (stack.torch_extension, stack.xpu_smi_found, stack.missing) == ("xtorch_ops", True, ())


def test_probe_names_everything_missing() -> None:
    stack = probe_stack(host_env("missing-tool"), find_module=lambda name: False)
    assert stack.missing == (
        "Kunlun's PyTorch build (Python module torch_xmlir or xtorch_ops)",
        f"xpu-smi ({str(FIXTURES / 'missing-tool' / 'xpu-smi')!r} not found; set KUNLUN_XPU_SMI)",
    )


def test_detect_kunlun_without_stack_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in host_env("missing-tool").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(kunlun_module, "TORCH_EXTENSION_MODULES", ("kunlun_test_no_such_module",))
    with pytest.raises(ConfigError) as info:
        detect("kunlun")
    assert info.value.field == "device"
    assert str(info.value) == (
        "device: kunlun asked for but the Kunlun software stack is incomplete here; missing: "
        "Kunlun's PyTorch build (Python module kunlun_test_no_such_module); "
        f"xpu-smi ({str(FIXTURES / 'missing-tool' / 'xpu-smi')!r} not found; set KUNLUN_XPU_SMI)"
    )
    # auto-detection simply skips Kunlun
    monkeypatch.setattr("kunlun_runtime.platforms.CudaPlatform.is_available", staticmethod(lambda: False))
    assert isinstance(detect("auto"), CpuPlatform)


def test_detect_prefers_kunlun_when_its_stack_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in host_env("p800-8", XPU_VISIBLE_DEVICES="6,7").items():
        monkeypatch.setenv(key, value)
    # stand in for Kunlun's PyTorch build with a module that is certainly installed
    monkeypatch.setattr(kunlun_module, "TORCH_EXTENSION_MODULES", ("json",))
    for device in ("auto", "kunlun"):
        platform = detect(device)
        assert isinstance(platform, KunlunPlatform)
        assert (platform.name, platform.device_type, platform.host_index()) == ("kunlun", "cuda", 6)
        assert platform.default_dtype() == torch.bfloat16


def test_cpu_telemetry_is_sane() -> None:
    platform = CpuPlatform()
    reading = platform.telemetry()
    assert reading.memory_total_bytes == psutil.virtual_memory().total == platform.total_memory_bytes()
    assert 0 < reading.memory_used_bytes < reading.memory_total_bytes
    assert 0.0 <= reading.utilization_ratio <= 1.0
    assert reading.power_watts is None
    assert 0 < platform.free_memory_bytes() <= platform.total_memory_bytes()
    assert platform.versions() == Versions(compute_library=f"torch-{torch.__version__}")
    assert platform.cache_line_bytes in (32, 64, 128, 256)


def test_gpu_check_script_is_valid_bash_and_python(tmp_path: Path) -> None:
    # benchmarks/gpu_check.sh needs a GPU to run; here only its syntax (bash, and the Python it feeds)
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    text = script.read_text()
    python = text.split("<<'EOF'", 1)[1].split("\n", 1)[1].split("\nEOF\n", 1)[0]
    assert "sys.exit" in python
    compile(python, f"{script}:python", "exec")
