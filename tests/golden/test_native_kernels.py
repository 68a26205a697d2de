"""The native CPU kernels of every tier this CPU runs, layer by layer against the FP32 reference:
decode-sized steps (a chunk size of at most 16 rows sends every linear through our kernels —
AVX-512 for 1-2 rows and AMX tiles for 3-16 where granted, or the AVX2 tier's; a chunk of 1 is a
decode step, which takes the fused decode-attention kernel) stay within the tier's bound and no
less accurate than the plain PyTorch path. The AVX-512 tier computes in BF16 (BF16 bound); the AVX2
tier in FP32 over BF16 weights, checked against HF FP32 over the same rounded weights (1e-4)."""

from dataclasses import dataclass

import pytest
import torch

from kunlun_runtime.commands.cli import main
from kunlun_runtime.golden.runner import run_golden
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.linear import NativeLinear, convert_linears
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.platforms import CpuPlatform

TOKENS = [(13 * i + 5) % 300 for i in range(40)]


@dataclass(frozen=True)
class Tier:
    name: str
    compute_dtype: torch.dtype  # the activations; weights are BF16 in both tiers
    int8_tolerance: float


TIERS = [Tier("avx512", torch.bfloat16, 0.15), Tier("avx2", torch.float32, 0.1)]


@pytest.fixture(params=TIERS, ids=[tier.name for tier in TIERS])
def tier(request, monkeypatch) -> Tier:
    """A kernel tier this CPU runs; engines built with ``dtype="auto"`` compute in its dtype."""
    tier = request.param
    if not cpu_kernels.load(tier.compute_dtype):
        pytest.skip(str(cpu_kernels.unavailable_reason(tier.compute_dtype)))
    monkeypatch.setattr(CpuPlatform, "default_dtype", lambda self: tier.compute_dtype)
    return tier


def _load(model_dir, tier: Tier):
    return load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64, compute_dtype=tier.compute_dtype)[0]


def _golden(model_dir, tier: Tier, backend: str, chunk: int):
    model = _load(model_dir, tier)
    convert_linears(model, backend=backend, quantization=None, compute_dtype=tier.compute_dtype)
    if backend == "native":
        assert model.enable_native_kernels()
    return model, run_golden(model, model_dir, TOKENS, chunk_size=chunk)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_native_decode_steps_match_fp32_reference(tiny_model_dirs, tier, name, chunk):
    model, native = _golden(tiny_model_dirs[name], tier, "native", chunk)
    assert isinstance(model.lm_head, NativeLinear) and isinstance(model.layers[0].mlp.down_proj, NativeLinear)
    assert native.passed, [(layer.name, layer.max_rel_err) for layer in native.layers]
    assert native.dtype == str(tier.compute_dtype).removeprefix("torch.")
    _, plain = _golden(tiny_model_dirs[name], tier, "plain", chunk)
    assert native.layers[-1].max_rel_err <= 2 * plain.layers[-1].max_rel_err + 1e-3


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_a_prefill_in_fp32_is_as_accurate_as_in_bf16(tiny_model_dirs, name, monkeypatch):
    """A prefill of WIDE_FROM_ROWS rows or more: where large_batches_in_fp32 (a CPU whose FMAs
    outrun its BF16 dot products, no AMX) the native linears run oneDNN's SGEMM over the weight
    widened to FP32 and the prompt's attention SDPA's FP32 kernel, else the BF16 ones; both are
    forced here, whatever this CPU would choose, and checked layer by layer against the FP32
    reference."""
    from kunlun_runtime.layers import attention, attention_backend, linear

    if not cpu_kernels.load(torch.bfloat16):
        pytest.skip(str(cpu_kernels.unavailable_reason(torch.bfloat16)))
    tokens = [(13 * i + 5) % 300 for i in range(linear.WIDE_FROM_ROWS + 24)]
    model_dir = tiny_model_dirs[name]
    errors = {}
    widened: list[int] = []  # widened linears
    prompts: list[bool] = []  # fresh prompts' attention: in FP32 or not
    real_linear, real_attention = linear.widened_linear, attention.fresh_prompt_attention
    monkeypatch.setattr(linear, "widened_linear", lambda *a, **k: widened.append(1) or real_linear(*a, **k))
    monkeypatch.setattr(
        attention,
        "fresh_prompt_attention",
        lambda *a, **k: prompts.append(k.get("in_fp32", False)) or real_attention(*a, **k),
    )
    for wide in (True, False):
        monkeypatch.setattr(linear, "large_batches_in_fp32", lambda wide=wide: wide)
        monkeypatch.setattr(attention_backend, "large_batches_in_fp32", lambda wide=wide: wide)
        model = load_model(model_dir, torch.bfloat16, torch.device("cpu"), 160, compute_dtype=torch.bfloat16)
        convert_linears(model[0], backend="native", quantization=None, compute_dtype=torch.bfloat16)
        assert model[0].enable_native_kernels()
        widened.clear()
        prompts.clear()
        report = run_golden(model[0], model_dir, tokens, chunk_size=None)
        assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]
        # The paths asked for ran, and only then: every layer's prompt attention in FP32 or none.
        assert bool(widened) == wide and prompts and set(prompts) == {wide}
        errors[wide] = report.layers[-1].max_rel_err
    assert errors[True] <= 1.5 * errors[False] + 1e-3


@pytest.mark.parametrize("chunk", [4, None])  # decode-sized steps; one 40-token prefill
def test_native_int8_stays_within_the_int8_bound(tiny_model_dirs, tier, chunk):
    model_dir = tiny_model_dirs["qwen2-bias"]
    model = _load(model_dir, tier)
    convert_linears(model, backend="native", quantization="int8", compute_dtype=tier.compute_dtype)
    assert model.layers[0].self_attn.qkv_proj.native
    report = run_golden(model, model_dir, TOKENS, tolerance=tier.int8_tolerance, chunk_size=chunk)
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


def test_golden_cli_checks_the_native_kernels_on_smollm2(capsys, tier):
    for chunk in ("1", "4"):
        args = ["golden", "--dtype", "auto", "--chunk-size", chunk, "--linear-backend", "native"]
        assert main(args) == 0  # the default prompt (the BF16 bound is prompt-dependent)
        assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "quantization", "sequences"),
    [
        ("llama-gqa", None, 3),
        ("llama-gqa", None, 13),
        ("llama-gqa", None, 29),  # past 16: groups of 8 rows over each block of weights
        ("llama-gqa", None, 45),  # past 32: two passes over the weights
        ("qwen2-bias", None, 3),
        ("qwen2-bias", "int8", 3),
    ],
)
def test_one_call_layer_stack_is_bit_identical_to_the_per_layer_path(
    tiny_model_dirs, tier, name, quantization, sequences, monkeypatch
):
    """Decode steps of up to 64 sequences (8 with INT8 weights) run every layer in one C++ call
    (decode_layers); the per-layer path, checked against HF above, must give the same logprobs."""
    from kunlun_runtime import LLM, SamplingParams

    llm = LLM(str(tiny_model_dirs[name]), dtype="auto", kv_cache_memory="8MiB", quantization=quantization)
    model = llm.engine.model
    assert model.decode_weights is not None and llm.engine.dtype == tier.compute_dtype
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


def test_qk_norm_and_ablations_keep_the_per_layer_path(tiny_model_dirs, tier):
    model = _load(tiny_model_dirs["qwen3-qknorm"], tier)
    convert_linears(model, backend="native", quantization=None, compute_dtype=tier.compute_dtype)
    assert model.enable_native_kernels() and model.decode_weights is None  # Q/K norms run in Python
    model = _load(tiny_model_dirs["llama-gqa"], tier)
    convert_linears(model, backend="plain", quantization=None, compute_dtype=tier.compute_dtype)
    assert model.enable_native_kernels() and model.decode_weights is None  # not our linears


@pytest.mark.parametrize("mix", ["one-adapter", "two-adapters-and-base"])
def test_one_call_layer_stack_with_lora_is_bit_identical_to_the_per_layer_path(
    tiny_model_dirs, tier, mix, tmp_path, monkeypatch
):
    """With LoRA adapters in the step, the one-call decode step applies the same updates
    (cpu_kernels.lora_update) as the per-layer path, which the LoRA golden tests check against
    HF + PEFT: the same logprobs."""
    from kunlun_runtime import LLM, LoRARequest, SamplingParams
    from tests.support.lora_adapters import make_adapter

    model_dir = tiny_model_dirs["llama-gqa"]
    adapters = [
        LoRARequest(
            f"a{i}", i + 1, str(make_adapter(model_dir, tmp_path / f"a{i}", rank=4 + 4 * i, seed=i + 1))
        )
        for i in range(2)
    ]
    loras = [adapters[0]] * 3 if mix == "one-adapter" else [adapters[0], None, adapters[1]]
    llm = LLM(str(model_dir), dtype="auto", kv_cache_memory="8MiB", enable_lora=True, max_loras=2)
    model = llm.engine.model
    assert model.decode_weights is not None and model.decode_lora is not None
    prompts = [{"prompt_token_ids": [(11 * i + 7 * b) % 300 + 3 for i in range(5 + 9 * b)]} for b in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run():
        llm.engine.block_pool.reset_prefix_cache()
        outputs = llm.generate(prompts, params, lora_request=loras)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    calls = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(
        cpu_kernels, "decode_layers", lambda x, *a: calls.append(a[-2] is not None) or real(x, *a)
    )
    fused = run()
    assert calls and all(calls)  # every decode step ran in one call, with the adapters
    weights, model.decode_weights = model.decode_weights, None
    per_layer = run()
    model.decode_weights = weights
    assert fused == per_layer
