"""The native CPU kernels, layer by layer against the FP32 reference: decode-sized steps (a chunk
size of at most 16 rows sends every linear through our kernels — AVX-512 for 1-2 rows, AMX tiles
for 3-16 where the shapes allow; a chunk of 1 is a decode step, which takes the fused
decode-attention kernel) stay within the BF16 bound and no less accurate than the
oneDNN/ATen path."""

import pytest
import torch

from kunlun_runtime.cli import main
from kunlun_runtime.golden import run_golden
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.linear import NativeLinear, convert_linears
from kunlun_runtime.models.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason=str(cpu_kernels.unavailable_reason()))
TOKENS = [(13 * i + 5) % 300 for i in range(40)]


def _golden(model_dir, backend: str, chunk: int):
    model, _ = load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64)
    convert_linears(model, backend=backend, quantization=None)
    if backend == "native":
        assert model.enable_native_kernels()
    return model, run_golden(model, model_dir, TOKENS, chunk_size=chunk)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_native_bf16_decode_steps_match_fp32_reference(tiny_model_dirs, name, chunk):
    model, native = _golden(tiny_model_dirs[name], "native", chunk)
    assert isinstance(model.lm_head, NativeLinear) and isinstance(model.layers[0].mlp.down_proj, NativeLinear)
    assert native.passed, [(layer.name, layer.max_rel_err) for layer in native.layers]
    _, plain = _golden(tiny_model_dirs[name], "plain", chunk)
    assert native.layers[-1].max_rel_err <= 2 * plain.layers[-1].max_rel_err + 1e-3


def test_native_int8_stays_within_the_int8_bound(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2-bias"]
    model, _ = load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64)
    convert_linears(model, backend="native", quantization="int8")
    assert model.layers[0].self_attn.qkv_proj.native
    report = run_golden(model, model_dir, TOKENS, tolerance=0.15, chunk_size=4)
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


def test_golden_cli_checks_the_native_kernels_on_smollm2(capsys):
    for chunk in ("1", "4"):
        args = ["golden", "--dtype", "bfloat16", "--chunk-size", chunk, "--linear-backend", "native"]
        assert main(args) == 0  # the default prompt (the BF16 bound is prompt-dependent)
        assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "quantization", "sequences"),
    [("llama-gqa", None, 3), ("llama-gqa", None, 13), ("qwen2-bias", None, 3), ("qwen2-bias", "int8", 3)],
)
def test_one_call_layer_stack_is_bit_identical_to_the_per_layer_path(
    tiny_model_dirs, name, quantization, sequences, monkeypatch
):
    """Decode steps of up to 16 sequences (8 with INT8 weights) run every layer in one C++ call
    (decode_layers); the per-layer path, checked against HF above, must give the same logprobs."""
    from kunlun_runtime import LLM, SamplingParams

    llm = LLM(str(tiny_model_dirs[name]), dtype="bfloat16", kv_cache_memory="8MiB", quantization=quantization)
    model = llm.engine.model
    assert model.decode_weights is not None
    prompts = [
        {"prompt_token_ids": [(11 * i + 7 * b) % 300 + 3 for i in range(5 + 9 * b)]} for b in range(sequences)
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run():
        llm.engine.block_pool.reset_prefix_cache()  # both runs prefill the same way
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    calls = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    fused = run()
    assert max(calls) == sequences  # every sequence decoded together in one call per step
    weights, model.decode_weights = model.decode_weights, None
    per_layer = run()
    model.decode_weights = weights
    assert fused == per_layer


def test_qk_norm_and_ablations_keep_the_per_layer_path(tiny_model_dirs):
    model, _ = load_model(tiny_model_dirs["qwen3-qknorm"], torch.bfloat16, torch.device("cpu"), 64)
    convert_linears(model, backend="native", quantization=None)
    assert model.enable_native_kernels() and model.decode_weights is None  # Q/K norms run in Python
    model, _ = load_model(tiny_model_dirs["llama-gqa"], torch.bfloat16, torch.device("cpu"), 64)
    convert_linears(model, backend="prepacked", quantization=None)
    assert model.enable_native_kernels() and model.decode_weights is None  # not our linears
