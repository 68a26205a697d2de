"""``import-gguf`` and ``quantize``: write model directories (from a GGUF file; as INT8)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kunlun_runtime.options.flags import Command


def _import_gguf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="llama-architecture GGUF file")
    parser.add_argument("out_dir", type=Path, help="output HF-format directory")
    parser.add_argument("--no-progress", action="store_true")


def run_import_gguf(args: argparse.Namespace) -> int:
    from kunlun_runtime.models.gguf_import import import_gguf

    out = import_gguf(args.file, args.out_dir, progress=not args.no_progress)
    print(out)
    return 0


def _quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument(
        "--calibration", type=Path, required=True, help="text file for activation calibration"
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory for the INT8 checkpoint")
    parser.add_argument("--max-chunks", type=int, default=16, help="calibration chunks of 256 tokens")
    parser.add_argument(
        "--static-max-error",
        type=float,
        default=0.01,
        help="use W8A8 static for a layer only if its calibration output error stays below this",
    )


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from kunlun_runtime.commands.quantize import calibrate, read_calibration_chunks, write_quantized
    from kunlun_runtime.models.loader import load_model
    from kunlun_runtime.models.model_dir import resolve_model_dir
    from kunlun_runtime.models.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    if not args.calibration.is_file():
        print(
            f"kunlun-runtime quantize: error: --calibration {args.calibration}: no such file", file=sys.stderr
        )
        return 2
    chunks = read_calibration_chunks(args.calibration, Tokenizer(model_dir), max_chunks=args.max_chunks)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), max(len(c) for c in chunks) + 1)
    calibration = calibrate(model, chunks, args.static_max_error)
    write_quantized(model, model_dir, args.out, calibration)
    num_static = sum(entry.static for entry in calibration.values())
    print(
        f"{args.out}: {len(calibration)} INT8 linears and lm_head, {num_static} with static activation scales "
        f"(calibrated on {sum(len(c) for c in chunks)} tokens)"
    )
    return 0


IMPORT_GGUF = Command(
    "import-gguf",
    "convert a llama GGUF into a HF-format model directory",
    _import_gguf_args,
    run_import_gguf,
)

QUANTIZE = Command(
    "quantize",
    "calibrate on a text file and write an INT8 (W8A8 static) checkpoint",
    _quantize_args,
    run_quantize,
)
