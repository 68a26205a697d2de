"""``golden``: compare every layer of our model with HF transformers in FP32 on one prompt."""

from __future__ import annotations

import argparse
import json
from typing import get_args

from kunlun_runtime.config import KVCacheDTypeName
from kunlun_runtime.options.flags import Command, add_kernel_args


def _golden_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="auto: what serve's --dtype auto runs on this CPU (FP32 over BF16 weights without native BF16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=get_args(KVCacheDTypeName),
        help="the engine side's KV cache, as serve resolves it (auto: BF16 under --dtype auto without native BF16)",
    )
    parser.add_argument("--prompt", default="The capital of France is Paris. The capital of Italy is")
    parser.add_argument("--tolerance", type=float, default=None, help="override the dtype's tolerance")
    parser.add_argument("--chunk-size", type=int, default=None, help="prefill in chunks of this many tokens")
    add_kernel_args(parser)  # a chunk size of at most 16 exercises the decode kernels, 1 attention too
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="run the engine side split N ways"
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="run the engine side's layers as N pipeline stages, one process per rank",
    )
    parser.add_argument("--json", action="store_true")


def run_golden_command(args: argparse.Namespace) -> int:
    import torch

    from kunlun_runtime.golden.runner import format_report, report_against_reference, run_golden
    from kunlun_runtime.kv.kv_dtype import resolve_kv_cache_dtype
    from kunlun_runtime.models.loader import load_model
    from kunlun_runtime.models.model_dir import resolve_model_dir
    from kunlun_runtime.models.tokenizer import Tokenizer
    from kunlun_runtime.platforms import CpuPlatform
    from kunlun_runtime.platforms.dtypes import resolve_dtype, resolve_weight_dtype

    model_dir = resolve_model_dir(args.model)
    dtype = resolve_dtype(args.dtype, CpuPlatform())
    weight_dtype = resolve_weight_dtype(args.dtype, CpuPlatform())
    kv_cache_dtype = resolve_kv_cache_dtype(
        args.kv_cache_dtype, dtype, CpuPlatform(), dtype_is_auto=args.dtype == "auto"
    )
    token_ids = Tokenizer(model_dir).encode(args.prompt)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        from kunlun_runtime.golden.ranks import capture_parallel
        from kunlun_runtime.models.model_config import load_model_config

        ours = capture_parallel(
            model_dir,
            token_ids,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            dtype,
            weight_dtype,
            kv_cache_dtype,
        )
        num_layers = load_model_config(model_dir).num_layers
        report = report_against_reference(
            ours,
            model_dir,
            token_ids,
            dtype,
            num_layers,
            args.tolerance,
            args.tensor_parallel_size,
            weight_dtype=None if weight_dtype == dtype else weight_dtype,
            pipeline_parallel_size=args.pipeline_parallel_size,
            kv_cache_dtype=None if kv_cache_dtype == dtype else kv_cache_dtype,
        )
    else:
        from kunlun_runtime.layers.linear import choose_linear_backend, convert_linears

        device = torch.device("cpu")
        model, _ = load_model(
            model_dir, weight_dtype, device, max(len(token_ids), 1) + 1, compute_dtype=dtype
        )
        backend = choose_linear_backend(args.linear_backend, dtype, device, weight_dtype)
        convert_linears(model, backend=backend, quantization=None, compute_dtype=dtype)
        if args.native_kernels:
            model.enable_native_kernels()
        report = run_golden(
            model,
            model_dir,
            token_ids,
            tolerance=args.tolerance,
            chunk_size=args.chunk_size,
            kv_cache_dtype=kv_cache_dtype,
        )
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return 0 if report.passed else 1


GOLDEN = Command(
    "golden",
    "compare every layer with HF transformers in FP32; exit 0 only if all pass",
    _golden_args,
    run_golden_command,
)
