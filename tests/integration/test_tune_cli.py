"""`kunlun-runtime tune` end to end on a tiny random model: the real engine is profiled within a small
budget, the YAML it writes is read back by `load_engine_options`, and the engine accepts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from kunlun_runtime.commands.cli import main
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.llm import LLM
from kunlun_runtime.options.config_file import load_engine_options
from kunlun_runtime.platforms import CpuPlatform
from kunlun_runtime.platforms.cpu_features import cpu_capabilities
from kunlun_runtime.tuning.profiler import BLOCK_SIZES, DECODE_SEQS, PREFILL_TOKENS
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

ENGINE_KEYS = [
    "dtype",
    "max_model_len",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
    "tensor_parallel_size",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tune") / "tiny-llama", TINY_SPECS["llama-gqa"])


def test_tune_writes_yaml_that_serves(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tuned" / "engine.yaml"
    code = main(["tune", "--model", str(tiny_model), "--device", "cpu", "--budget-s", "6", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    # BF16 where it is native; below that FP32 over BF16 weights, which only `auto` reproduces.
    native_bf16 = CpuPlatform().default_dtype() == torch.bfloat16
    compute, weights = ("bfloat16", None) if native_bf16 else ("float32", "bfloat16")
    assert printed.startswith(
        f"tune: wrote {out}: dtype={compute if native_bf16 else 'auto'} max_model_len=512 block_size="
    )

    text = out.read_text()
    precision = compute if native_bf16 else f"{compute} over {weights} weights"
    assert text.startswith(f"# kunlun-runtime tune: model tiny-llama ({precision}) on cpu, 1 card(s) of ")
    document = yaml.safe_load(text)
    assert list(document) == ["engine", "why", "measurements", "cpu"]
    assert document["cpu"] == cpu_capabilities().describe()
    assert list(document["engine"]) == ENGINE_KEYS
    assert list(document["why"]) == ENGINE_KEYS
    measured = document["measurements"]
    assert measured["model"] == {
        "name": "tiny-llama",
        "dtype": compute,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "weight_bytes": measured["model"]["weight_bytes"],
        "max_model_len": 512,
        "weight_dtype": weights,
    }
    # at least the bf16 bytes of the matrices: embedding and lm head, then per layer q/o, k/v and the MLP
    matrices = 2 * 320 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160)
    assert measured["model"]["weight_bytes"] >= 2 * matrices
    assert (measured["platform"]["name"], measured["platform"]["num_cards"]) == ("cpu", 1)
    assert measured["budget_seconds"] == 6.0
    # every sweep point was either measured or listed as skipped, in order
    sweeps = {
        "prefill tokens": (
            [p["num_tokens"] for p in measured["prefill"]],
            [n for n in PREFILL_TOKENS if n <= 256],  # n + 2 tokens must fit the model's 512 positions
        ),
        "decode seqs": ([p["num_seqs"] for p in measured["decode"]], list(DECODE_SEQS)),
        "block size": ([p["block_size"] for p in measured["block_sizes"]], list(BLOCK_SIZES)),
    }
    for name, (done, planned) in sweeps.items():
        skipped = [int(s.split()[-2]) for s in measured["skipped"] if s.startswith(name)]
        assert done + skipped == planned, name
    assert measured["prefill"] and measured["decode"]

    options = load_engine_options(out)
    assert options == document["engine"]
    llm = LLM(model=str(tiny_model), device="cpu", **options)
    assert llm.engine.config.max_num_seqs == options["max_num_seqs"]
    result = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(result[0].outputs[0].token_ids) == 3


def test_tune_refuses_a_bad_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--budget-s", "0"]) == 2
    assert capsys.readouterr().err == "kunlun-runtime tune: error: budget_s: must be positive, got 0\n"
