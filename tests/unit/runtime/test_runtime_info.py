"""What the engine says it runs with: the start line, the WARNING beside it when our kernels fell
short, /version's fields, the kunlun:runtime_info gauge, and the flag and environment variable that
make a fall-back a start error."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers import runtime_info
from kunlun_runtime.layers.kernel_choice import KernelChoice, fallback_cost
from kunlun_runtime.layers.runtime_info import RuntimeInfo, announce_start
from kunlun_runtime.options.flags import REQUIRE_NATIVE_KERNELS_ENV, add_engine_args, engine_config_from_args
from kunlun_runtime.server.metrics import build_metrics

FAULT = "building the avx2 CPU kernels failed: Command '['/bin/false', '--version']' returned non-zero exit status 1"
FELL_BACK = RuntimeInfo(
    device="cpu",
    kernels=KernelChoice("plain", "none", False, (), FAULT, fallback_cost("plain", torch.float32), "float32"),
    dtype=torch.float32,
    weight_dtype=torch.bfloat16,
    quantization="int8",
    kv_dtype=torch.bfloat16,
    num_kv_tokens=4096,
)


def test_the_start_line_states_backend_tier_dtypes_and_kv_capacity(caplog) -> None:
    caplog.set_level(logging.INFO, logger=runtime_info.__name__)
    announce_start(FELL_BACK, model="/models/m", max_model_len=512, kv_cache_bytes=3 << 20)
    (start, warning) = caplog.records
    assert (start.levelno, warning.levelno) == (logging.INFO, logging.WARNING)
    assert start.getMessage() == (
        "engine ready: model=/models/m device=cpu backend=plain tier=none dtype=float32 "
        "weights=bfloat16 (int8) kv_dtype=bfloat16 kv_capacity=4096 tokens (3.0 MiB) max_model_len=512"
    )
    assert warning.getMessage() == (
        f"our CPU kernels are not running: {FAULT}; decode runs on plain PyTorch, every BF16 weight "
        "widened to FP32 each step: 0.12-0.17x of its speed with our kernels where measured "
        "(docs/performance.md). Fix: a working C++ compiler for the first start, or prebuilt libraries "
        "in $KUNLUN_CPU_KERNELS_DIR; --require-native-kernels makes this a start error"
    )


def test_notes_go_on_the_start_line_and_no_warning_without_a_fault(caplog) -> None:
    caplog.set_level(logging.INFO, logger=runtime_info.__name__)
    asked = KernelChoice("plain", "avx512", True, ("--linear-backend plain as asked",))
    info = RuntimeInfo("cpu", asked, torch.bfloat16, torch.bfloat16, None, torch.bfloat16, 64)
    announce_start(info, model="m", max_model_len=8, kv_cache_bytes=1 << 20)
    (start,) = caplog.records
    assert "backend=plain tier=avx512 (--linear-backend plain as asked) dtype=bfloat16 weights=bfloat16 " in (
        start.getMessage()
    )


def test_version_fields_and_gauge_labels() -> None:
    assert FELL_BACK.describe() == {
        "device": "cpu",
        "backend": "plain",
        "tier": "none",
        "native_layers": False,
        "large_batches": "float32",
        "notes": [],
        "fault": FAULT,
        "cost": FELL_BACK.kernels.cost,
        "dtype": "float32",
        "weight_dtype": "bfloat16",
        "quantization": "int8",
        "kv_dtype": "bfloat16",
        "num_kv_tokens": 4096,
    }
    registry = CollectorRegistry()
    metrics = build_metrics(registry, "m")
    metrics.set_runtime_info(backend="native", tier="avx512", dtype="bfloat16", kv_dtype="bfloat16")
    metrics.set_runtime_info(**FELL_BACK.labels())  # a later engine replaces the series
    (family,) = [
        f
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name == "kunlun:runtime_info"
    ]
    assert family.type == "gauge"
    assert [(sample.labels, sample.value) for sample in family.samples] == [
        (
            {
                "model_name": "m",
                "engine": "0",
                "backend": "plain",
                "tier": "none",
                "dtype": "float32",
                "kv_dtype": "bfloat16",
            },
            1.0,
        )
    ]


def _config(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("value", "argv", "required"),
    [
        (None, [], False),
        ("1", [], True),
        ("true", [], True),
        ("0", [], False),
        ("1", ["--no-require-native-kernels"], False),
        (None, ["--require-native-kernels"], True),
    ],
)
def test_the_environment_variable_is_the_flags_default(monkeypatch, value, argv, required) -> None:
    monkeypatch.delenv(REQUIRE_NATIVE_KERNELS_ENV, raising=False)
    if value is not None:
        monkeypatch.setenv(REQUIRE_NATIVE_KERNELS_ENV, value)
    assert _config(argv).require_native_kernels is required


def test_a_bad_value_names_the_variable_and_the_option(monkeypatch) -> None:
    monkeypatch.setenv(REQUIRE_NATIVE_KERNELS_ENV, "maybe")
    with pytest.raises(ConfigError, match="KUNLUN_REQUIRE_NATIVE_KERNELS: must be 1 or 0") as caught:
        _config([])
    assert caught.value.field == REQUIRE_NATIVE_KERNELS_ENV
    with pytest.raises(ConfigError, match="require_native_kernels: must be true or false") as config_error:
        EngineConfig(require_native_kernels="yes").validate()  # type: ignore[arg-type]
    assert config_error.value.field == "require_native_kernels"
