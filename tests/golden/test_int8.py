"""INT8: weight-only quantization on the fly, and the static toolchain (calibrate → checkpoint →
load), both against the FP32 reference with documented bounds."""

import json

import pytest
import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.commands.cli import main
from kunlun_runtime.golden.runner import run_golden
from kunlun_runtime.layers.linear import Int8Linear, convert_linears
from kunlun_runtime.models.loader import load_model

TOKENS = [(17 * i + 3) % 300 for i in range(48)]
INT8_BOUND = 0.15  # relative per-token error bound of INT8 (W8A16) vs FP32, tiny models


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calibration.txt"
    path.write_text(
        "the quick brown fox jumps over the lazy dog. " * 40 + "in an ancient land, the king ran."
    )
    return path


def test_weight_only_int8_stays_within_its_bound(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama-gqa"]
    model, _ = load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64)
    assert convert_linears(model, backend="plain", quantization="int8") == 2 * 4 + 1  # lm_head too
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the tied embedding stays BF16
    report = run_golden(model, model_dir, TOKENS, tolerance=INT8_BOUND)
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


def test_quantize_cli_writes_a_checkpoint_that_serves(tiny_model_dirs, calibration_file, tmp_path, capsys):
    model_dir = tiny_model_dirs["qwen2-bias"]
    out = tmp_path / "int8"
    assert (
        main(
            ["quantize", "--model", str(model_dir), "--calibration", str(calibration_file), "--out", str(out)]
        )
        == 0
    )
    assert "8 INT8 linears and lm_head" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "kunlun-int8"
    layers = json.loads((out / "quantization.json").read_text())
    assert len(layers) == 8 and all(layer["rel_err"] >= 0 for layer in layers)
    model, _ = load_model(out, torch.bfloat16, torch.device("cpu"), 64)
    assert isinstance(model.layers[1].self_attn.qkv_proj, Int8Linear) and isinstance(
        model.lm_head, Int8Linear
    )
    assert model.lm_head.input_scale is None  # weight-only: no calibrated activation scale
    assert model.layers[1].self_attn.qkv_proj.bias is not None  # Qwen2's QKV bias survives
    ours = run_golden(model, model_dir, TOKENS, tolerance=INT8_BOUND)  # checkpoint vs the original FP32
    assert ours.passed
    output = LLM(str(out), dtype="bfloat16", kv_cache_memory="8MiB").generate(
        {"prompt_token_ids": TOKENS[:9]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert len(output[0].outputs[0].token_ids) == 6


def test_static_w8a8_layers_use_the_int8_matrix_path(tiny_model_dirs, calibration_file, tmp_path):
    model_dir = tiny_model_dirs["llama-gqa"]
    out = tmp_path / "w8a8"
    args = ["quantize", "--model", str(model_dir), "--calibration", str(calibration_file), "--out", str(out)]
    assert main([*args, "--static-max-error", "1.0"]) == 0  # every layer static
    model, _ = load_model(out, torch.bfloat16, torch.device("cpu"), 64)
    layer = model.layers[0].mlp.gate_up_proj
    assert layer.input_scale is not None
    x = torch.randn(9, layer.in_features, dtype=torch.bfloat16)
    reference = x.float() @ (layer.weight_int8.float() * layer.scales_fp32[:, None]).t()
    relative = ((layer(x).float() - reference).norm() / reference.norm()).item()
    assert 0 < relative < 0.05
