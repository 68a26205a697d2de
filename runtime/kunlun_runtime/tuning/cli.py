"""``kunlun-runtime tune``: profile the engine here, recommend a configuration, write it as YAML.

The YAML has three sections: ``engine`` (EngineConfig field names → values; what
``config_file.load_engine_options`` and ``serve --config`` read), ``why`` (one reason per value,
quoting the measurement behind it) and ``measurements`` (everything measured, for the record).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from kunlun_runtime.options.flags import Command
from kunlun_runtime.tuning.measurements import Measurements
from kunlun_runtime.tuning.recommender import Recommendation, recommend
from kunlun_runtime.tuning.targets import Targets, size


def build_document(measurements: Measurements, recommendation: Recommendation) -> dict[str, Any]:
    """The tune YAML as a dict: engine options, reasons, measurements."""
    return {
        "engine": dict(recommendation.options),
        "why": dict(recommendation.reasons),
        "measurements": measurements.to_dict(),
        "cpu": cpu_record(),
    }


def cpu_record() -> dict[str, object]:
    """The host CPU's ISA tier and caches: recommendations measured on one tier do not carry over."""
    from kunlun_runtime.platforms.cpu_features import cpu_capabilities

    return cpu_capabilities().describe()


def render_document(document: dict[str, Any]) -> str:
    """YAML text with a header saying what made it and how to use it."""
    m = document["measurements"]
    model, platform = m["model"], m["platform"]
    header = (
        f"# kunlun-runtime tune: model {model['name']} ({_precision(model)}) on {platform['name']}, "
        f"{platform['num_cards']} card(s) of {size(platform['memory_bytes_per_card'])}; "
        f"measured in {m['elapsed_seconds']:.1f} s of a {m['budget_seconds']:g} s budget.\n"
        "# Use: kunlun-runtime serve --config THIS_FILE (the `engine` section; `why` and `measurements` "
        "are the record).\n"
    )
    return header + yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)


def _precision(model: dict[str, Any]) -> str:
    weights = model.get("weight_dtype")
    return f"{model['dtype']} over {weights} weights" if weights else model["dtype"]


def _tune_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda", "kunlun"])
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add("--max-model-len", type=int, default=None, help="context to plan KV memory for (default: model's)")
    add("--budget-s", type=float, default=60.0, help="bound on the whole run in seconds (default 60)")
    add("--out", type=Path, default=None, help="write the YAML here (default: standard output)")
    add("--memory-fraction", type=float, default=0.9, help="share of a card's memory to use (default 0.9)")
    add(
        "--decode-step-target-ms",
        type=float,
        default=100.0,
        help="max_num_seqs: largest batch whose decode step stays within this (default 100)",
    )
    add(
        "--max-prefill-step-ms",
        type=float,
        default=500.0,
        help="max_num_batched_tokens: cap on one prefill step (default 500)",
    )
    add(
        "--cards-per-node",
        type=int,
        default=None,
        help="cards of a node to serve on, for tensor_parallel_size (default: the cards seen here)",
    )
    add(
        "--max-nodes",
        type=int,
        default=16,
        help="pipeline_parallel_size: at most this many nodes per replica (default 16)",
    )
    add(
        "--stage-boundary-ms",
        type=float,
        default=None,
        help="time one pipeline stage boundary adds to a decode step, measured or assumed (for the reason)",
    )
    add("--seed", type=int, default=0)


def run_tune(args: argparse.Namespace) -> int:
    from kunlun_runtime.config import EngineConfig
    from kunlun_runtime.tuning.profiler import ProfileOptions, Profiler

    if args.budget_s <= 0:
        raise _config_error("budget_s", f"must be positive, got {args.budget_s:g}")
    if not 0 < args.memory_fraction <= 1:
        raise _config_error("memory_fraction", f"must be in (0, 1], got {args.memory_fraction:g}")
    if args.cards_per_node is not None and args.cards_per_node < 1:
        raise _config_error("cards_per_node", f"must be >= 1, got {args.cards_per_node}")
    if args.max_nodes < 1:
        raise _config_error("max_nodes", f"must be >= 1, got {args.max_nodes}")
    if args.stage_boundary_ms is not None and not 0 <= args.stage_boundary_ms < float("inf"):
        raise _config_error("stage_boundary_ms", f"must be a time in ms >= 0, got {args.stage_boundary_ms:g}")
    EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len
    ).validate()
    options = ProfileOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        budget_seconds=args.budget_s,
        seed=args.seed,
    )
    targets = Targets(
        memory_fraction=args.memory_fraction,
        decode_step_target_seconds=args.decode_step_target_ms / 1000,
        max_prefill_step_seconds=args.max_prefill_step_ms / 1000,
        cards_per_node=args.cards_per_node,
        max_nodes=args.max_nodes,
        stage_boundary_seconds=None if args.stage_boundary_ms is None else args.stage_boundary_ms / 1000,
    )
    measurements = Profiler(options).run()
    recommendation = recommend(measurements, targets)
    text = render_document(build_document(measurements, recommendation))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        chosen = " ".join(f"{key}={value}" for key, value in recommendation.options.items())
        print(f"tune: wrote {args.out}: {chosen}")
    return 0


def _config_error(field: str, message: str) -> Exception:
    from kunlun_runtime.errors import ConfigError

    return ConfigError(f"{field}: {message}", field=field)


TUNE = Command(
    "tune",
    "measure the engine on this hardware and recommend a configuration (YAML)",
    _tune_args,
    run_tune,
)
