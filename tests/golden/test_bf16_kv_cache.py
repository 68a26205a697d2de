"""A BF16 KV cache under FP32 activations (``--kv-cache-dtype``; the default on CPUs without native
BF16) against the FP32 HF reference, on the AVX2 tier's kernels and on the plain PyTorch path that
the plain floor runs.

Two checks per model: within ``BF16_KV_TOLERANCE`` of the reference over the same BF16 weights
(the documented bound: rounding every key and value to BF16 is an approximation the reference does
not make), and within ``ROUNDED_REFERENCE_TOLERANCE``, over ten times tighter, of a reference whose
attention rounds its keys and values to BF16 as the cache does: that rounding is then the only
difference, and the kernels' FP32 arithmetic over widened BF16 is right. (Not the FP32 bound itself:
a key that differs from the reference's by FP32 noise can round to the neighbouring BF16 value, a
step of 2**-8 relative in one element.) Then the engine's kernel paths against its plain path over
a BF16 cache.
"""

import pytest
import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.golden.runner import BF16_KV_TOLERANCE, run_golden
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.linear import convert_linears
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.platforms import CpuPlatform

TOKENS = [(13 * i + 5) % 300 for i in range(40)]
PATHS = ["avx2-kernels", "plain"]
HF_ATTENTION_MODULES = ("llama", "qwen2", "qwen3")
ROUNDED_REFERENCE_TOLERANCE = 1e-3


@pytest.fixture(params=PATHS)
def path(request) -> str:
    if request.param == "avx2-kernels" and not cpu_kernels.load(torch.float32):
        pytest.skip(str(cpu_kernels.unavailable_reason(torch.float32)))
    return request.param


@pytest.fixture
def reference_rounds_kv(monkeypatch) -> None:
    """HF's eager attention over keys and values rounded to BF16 and widened back, as the cache
    stores them (everything else of the reference stays FP32)."""
    import importlib

    for name in HF_ATTENTION_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        eager = module.eager_attention_forward

        def rounded(attention, query, key, value, *args, eager=eager, **kwargs):
            as_stored = [t.to(torch.bfloat16).to(t.dtype) for t in (key, value)]
            return eager(attention, query, *as_stored, *args, **kwargs)

        monkeypatch.setattr(module, "eager_attention_forward", rounded)


def _model(model_dir, path: str, max_positions: int = 64):
    model, _ = load_model(
        model_dir, torch.bfloat16, torch.device("cpu"), max_positions, compute_dtype=torch.float32
    )
    backend = "native" if path == "avx2-kernels" else "plain"
    convert_linears(model, backend=backend, quantization=None, compute_dtype=torch.float32)
    if path == "avx2-kernels":
        assert model.enable_native_kernels()
    return model


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("chunk", [1, 5, None])  # decode steps (the decode kernel), chunks, one prefill
def test_bf16_kv_stays_within_its_bound_of_the_fp32_reference(tiny_model_dirs, path, name, chunk):
    report = run_golden(
        _model(tiny_model_dirs[name], path), tiny_model_dirs[name], TOKENS, chunk_size=chunk,
        kv_cache_dtype=torch.bfloat16,
    )  # fmt: skip
    assert (report.dtype, report.weight_dtype, report.kv_cache_dtype) == ("float32", "bfloat16", "bfloat16")
    assert report.layers[-1].tolerance == BF16_KV_TOLERANCE
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("chunk", [1, None])
def test_bf16_kv_is_fp32_attention_over_the_rounded_keys_and_values(
    tiny_model_dirs, path, name, chunk, reference_rounds_kv
):
    report = run_golden(
        _model(tiny_model_dirs[name], path), tiny_model_dirs[name], TOKENS, chunk_size=chunk,
        kv_cache_dtype=torch.bfloat16, tolerance=ROUNDED_REFERENCE_TOLERANCE,
    )  # fmt: skip
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


@pytest.mark.parametrize("chunk", [4, None])
def test_smollm2_with_bf16_kv_stays_within_the_bound(smollm2_dir, path, chunk):
    from kunlun_runtime.models.tokenizer import Tokenizer

    token_ids = Tokenizer(smollm2_dir).encode("The capital of France is Paris. The capital of Italy is")
    report = run_golden(
        _model(smollm2_dir, path), smollm2_dir, token_ids, chunk_size=chunk, kv_cache_dtype=torch.bfloat16
    )
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


@pytest.fixture
def avx2_engine_options(monkeypatch) -> dict:
    """An engine built with ``dtype="auto"`` computes as on a CPU without native BF16: FP32 over
    BF16 weights, the AVX2 kernels, and (auto) a BF16 KV cache."""
    if not cpu_kernels.load(torch.float32):
        pytest.skip(str(cpu_kernels.unavailable_reason(torch.float32)))
    monkeypatch.setattr(CpuPlatform, "default_dtype", lambda self: torch.float32)
    return {"dtype": "auto", "kv_cache_memory": "8MiB"}


def _generate(llm: LLM, sequences: int):
    prompts = [
        {"prompt_token_ids": [(11 * i + 7 * b) % 300 + 3 for i in range(5 + 9 * b)]} for b in range(sequences)
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm.engine.block_pool.reset_prefix_cache()  # every run prefills the same way
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("sequences", [1, 3])
def test_avx2_kernels_over_a_bf16_cache_match_the_plain_path(
    tiny_model_dirs, avx2_engine_options, sequences, monkeypatch
):
    """The one-call layer stack, the per-layer kernels and the plain PyTorch path over a BF16 cache:
    the first two bit for bit, the plain path to FP32 noise (its attention sums in another order)."""
    model_dir = str(tiny_model_dirs["llama-gqa"])
    llm = LLM(model_dir, **avx2_engine_options)
    assert llm.engine.kv_cache_dtype == torch.bfloat16 and llm.engine.model.decode_weights is not None
    calls = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    one_call = _generate(llm, sequences)
    assert max(calls) == sequences  # the decode steps ran the one-call stack over the BF16 cache
    weights, llm.engine.model.decode_weights = llm.engine.model.decode_weights, None
    per_layer = _generate(llm, sequences)
    llm.engine.model.decode_weights = weights
    assert one_call == per_layer
    plain = _generate(
        LLM(model_dir, **avx2_engine_options, native_kernels=False, linear_backend="plain"), sequences
    )
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(one_call, plain, strict=True):
        assert tokens == plain_tokens
        for ours, theirs in zip(logprobs, plain_logprobs, strict=True):
            assert ours.keys() == theirs.keys()  # the same top tokens
            assert all(abs(ours[t].logprob - theirs[t].logprob) <= 1e-4 for t in ours)
