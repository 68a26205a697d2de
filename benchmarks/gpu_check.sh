#!/usr/bin/env bash
# GPU check of the CUDA path (not part of the test suite; CI has no GPU). On a machine with a CUDA
# GPU and the repository's virtual environment, it runs in a few minutes and installs nothing:
#
#   1. the platform: CudaPlatform's device, dtypes, memory, telemetry and versions;
#   2. greedy golden: the embedded SmolLM2 through LLM(device="cuda", dtype="float32") against HF
#      transformers FP32 on the same GPU, token for token on five prompts;
#   3. per-layer golden: the engine's paged path on the GPU against HF FP32 (on the CPU, the
#      reference the CPU golden tests use), max relative error per layer, tolerance 1e-5;
#   4. engine throughput in the platform's default dtype: 64 requests × 128 new tokens;
#   5. optionally (GPU_CHECK_TUNE=1) `kunlun-runtime tune --device cuda` with a 60 s budget.
#
# Usage: benchmarks/gpu_check.sh            (from anywhere; PYTHON overrides .venv/bin/python)
# Exit status: 0 all checks passed, 1 a golden check failed, 2 no usable GPU.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

"$PYTHON" - <<'EOF'
import json
import sys
import time

import torch

if not torch.cuda.is_available():
    print("gpu_check: torch sees no CUDA device", file=sys.stderr)
    sys.exit(2)

from transformers import AutoModelForCausalLM

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.models.model_dir import resolve_model_dir
from kunlun_runtime.golden.runner import capture_engine, capture_reference, compare, layer_names
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.platforms import detect
from kunlun_runtime.models.tokenizer import Tokenizer

failed = False
started = time.perf_counter()

# 1. platform
platform = detect("cuda")
print("== platform")
print(json.dumps({
    "name": platform.name,
    "device": torch.cuda.get_device_name(0),
    "dtypes": [str(d).removeprefix("torch.") for d in platform.supported_dtypes()],
    "default_dtype": str(platform.default_dtype()).removeprefix("torch."),
    "total_memory_bytes": platform.total_memory_bytes(),
    "free_memory_bytes": platform.free_memory_bytes(),
    "telemetry": {k: getattr(platform.telemetry(), k) for k in platform.telemetry().__slots__},
    "versions": {k: getattr(platform.versions(), k) for k in platform.versions().__slots__},
}, indent=2))

# 2. greedy golden against HF FP32 on the same GPU
model_dir = resolve_model_dir(None)
prompts = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
]
print("== greedy golden (FP32, 5 prompts x 32 tokens, ours vs HF on cuda)")
llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=512, kv_cache_memory="256MiB")
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
for output in outputs:
    prompt = output.prompt_token_ids
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
    ours = output.outputs[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b), None)
    verdict = "identical" if same is None else f"DIFFER from token {same}"
    failed |= same is not None
    print(f"  {output.prompt!r}: {verdict}")
del llm, reference
torch.cuda.empty_cache()

# 3. per-layer golden: engine on cuda (FP32) vs HF FP32 reference
print("== per-layer golden (FP32 engine on cuda vs HF FP32)")
token_ids = Tokenizer(model_dir).encode("The capital of France is Paris. The capital of Italy is")
model, _ = load_model(model_dir, torch.float32, torch.device("cuda"), len(token_ids) + 1)
ours = {name: t.cpu() for name, t in capture_engine(model, token_ids).items()}
layers = compare(ours, capture_reference(model_dir, token_ids), layer_names(model.config.num_layers), 1e-5)
worst = max(layers, key=lambda layer: layer.max_rel_err)
first_bad = next((layer.name for layer in layers if not layer.passed), None)
failed |= first_bad is not None
print(f"  {len(layers)} layers, worst {worst.name} max_rel_err={worst.max_rel_err:.3e}, "
      f"first divergent layer: {first_bad}")
del model
torch.cuda.empty_cache()

# 4. engine throughput in the default dtype
print("== engine throughput (default dtype, 64 requests x 128 new tokens, 32-token prompts)")
llm = LLM(str(model_dir), device="cuda", max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=64)
prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 100 for j in range(32)]} for i in range(64)]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
torch.cuda.synchronize()
start = time.perf_counter()
outputs = llm.generate(prompts, params)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
generated = sum(len(o.outputs[0].token_ids) for o in outputs)
print(f"  dtype={str(llm.engine.dtype).removeprefix('torch.')} {generated} tokens in {seconds:.2f} s: "
      f"{generated / seconds:.0f} tokens/s")

print(f"== gpu_check {'FAILED' if failed else 'passed'} in {time.perf_counter() - started:.0f} s")
sys.exit(1 if failed else 0)
EOF

if [ "${GPU_CHECK_TUNE:-0}" = "1" ]; then
  echo "== tune (cuda, 60 s budget)"
  "$PYTHON" -m kunlun_runtime.commands.cli tune --device cuda --budget-s 60
fi
