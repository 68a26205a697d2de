"""``kunlun-runtime``: the command line of the runtime.

Subcommands: generate, chat, golden, import-gguf, serve (when the server is installed). Engine
flags carry vLLM's names (``--max-model-len``, ``--block-size``, ...). Errors the user can fix
print one line and exit 2; nothing here prints a traceback for a bad flag or a bad model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kunlun_runtime.config import EngineConfig, parse_memory
from kunlun_runtime.errors import KunlunRuntimeError

COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {}


def command(name: str, help_text: str, configure: Callable[[argparse.ArgumentParser], None]):
    """Register a subcommand: ``configure`` adds its flags, the decorated function runs it."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (help_text, configure, run)
        return run

    return register


def add_engine_args(parser: argparse.ArgumentParser, *, default_dtype: str = "auto") -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    group.add_argument("--served-model-name", default=None)
    group.add_argument("--dtype", default=default_dtype, choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "kunlun"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, bytes or e.g. 2GiB")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--max-preemptions", type=int, default=3)
    group.add_argument("--scheduling-policy", default="fixed", choices=["fixed", "feedback"])
    group.add_argument(
        "--target-step-seconds", type=float, default=None, help="feedback: step cap while decoding"
    )
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--quantization", default=None, choices=["int8"])
    _add_kernel_args(group)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--config",
        type=Path,
        default=None,
        help="engine options YAML (e.g. the output of `kunlun-runtime tune`); flags given explicitly win",
    )


def _add_kernel_args(parser) -> None:
    parser.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "native", "prepacked", "plain"],
        help="auto: our AVX-512 BF16 / AMX decode kernels where the CPU has them, else oneDNN-prepacked",
    )
    parser.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BF16 on AVX-512 BF16 CPUs: our RMSNorm, decode-attention and one-call layer-stack kernels",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags; options from ``--config`` fill every flag left at its
    default. Raises ConfigError naming the option (or the file and key)."""
    config = _config_from_flags(args)
    if getattr(args, "config", None) is None:
        return config
    from dataclasses import replace

    from kunlun_runtime.config_file import load_engine_options

    defaults = argparse.ArgumentParser(add_help=False)
    add_engine_args(defaults)
    default_config = _config_from_flags(defaults.parse_args([]))
    file_options = load_engine_options(args.config)
    overrides = {
        key: value
        for key, value in file_options.items()
        if getattr(config, key) == getattr(default_config, key)  # not set on the command line
    }
    return replace(config, **overrides).validate()


def _config_from_flags(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=parse_memory(args.kv_cache_memory),
        enable_prefix_caching=args.enable_prefix_caching,
        max_preemptions=args.max_preemptions,
        scheduling_policy=args.scheduling_policy,
        target_step_seconds=args.target_step_seconds,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        linear_backend=args.linear_backend,
        native_kernels=args.native_kernels,
        seed=args.seed,
    ).validate()


def _generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@command("generate", "generate text for one prompt", _generate_args)
def run_generate(args: argparse.Namespace) -> int:
    from kunlun_runtime.llm import LLM
    from kunlun_runtime.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    if args.raw or llm.tokenizer.chat_template is None:
        result = llm.generate(args.prompt, params)[0]
    else:
        result = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    completion = result.outputs[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "prompt_token_ids": result.prompt_token_ids,
                    "finish_reason": completion.finish_reason,
                }
            )
        )
    else:
        print(completion.text)
    return 0


def _chat_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--system", default=None, help="system prompt")


@command("chat", "interactive chat; tokens stream as they come (Ctrl-D to quit)", _chat_args)
def run_chat(args: argparse.Namespace) -> int:
    from kunlun_runtime.llm import LLM
    from kunlun_runtime.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    printed = 0

    def stream(output) -> None:
        nonlocal printed
        text = output.outputs[0].text
        print(text[printed:], end="", flush=True)
        printed = len(text)

    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        printed = 0
        print("assistant> ", end="", flush=True)
        reply = llm.chat(messages, params, on_output=stream)[0].outputs[0].text
        print(reply[printed:])
        messages.append({"role": "assistant", "content": reply})


def _golden_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="auto: what serve's --dtype auto runs on this CPU (FP32 over BF16 weights without native BF16)",
    )
    parser.add_argument("--prompt", default="The capital of France is Paris. The capital of Italy is")
    parser.add_argument("--tolerance", type=float, default=None, help="override the dtype's tolerance")
    parser.add_argument("--chunk-size", type=int, default=None, help="prefill in chunks of this many tokens")
    _add_kernel_args(parser)  # a chunk size of at most 16 exercises the decode kernels, 1 attention too
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="run the engine side split N ways"
    )
    parser.add_argument("--json", action="store_true")


@command("golden", "compare every layer with HF transformers in FP32; exit 0 only if all pass", _golden_args)
def run_golden_command(args: argparse.Namespace) -> int:
    import torch

    from kunlun_runtime.engine.llm_engine import resolve_dtype, resolve_model_dir, resolve_weight_dtype
    from kunlun_runtime.golden import format_report, report_against_reference, run_golden
    from kunlun_runtime.models.loader import load_model
    from kunlun_runtime.platforms import CpuPlatform
    from kunlun_runtime.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    dtype = resolve_dtype(args.dtype, CpuPlatform())
    weight_dtype = resolve_weight_dtype(args.dtype, CpuPlatform())
    token_ids = Tokenizer(model_dir).encode(args.prompt)
    if args.tensor_parallel_size > 1:
        from kunlun_runtime.golden_tp import capture_tensor_parallel
        from kunlun_runtime.models.model_config import load_model_config

        ours = capture_tensor_parallel(model_dir, token_ids, args.tensor_parallel_size, dtype, weight_dtype)
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
        )
    else:
        from kunlun_runtime.layers.linear import choose_linear_backend, convert_linears

        device = torch.device("cpu")
        model, _ = load_model(model_dir, weight_dtype, device, max(len(token_ids), 1) + 1, compute_dtype=dtype)
        backend = choose_linear_backend(args.linear_backend, dtype, device, weight_dtype)
        convert_linears(model, backend=backend, quantization=None, compute_dtype=dtype)
        if args.native_kernels:
            model.enable_native_kernels()
        report = run_golden(model, model_dir, token_ids, tolerance=args.tolerance, chunk_size=args.chunk_size)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return 0 if report.passed else 1


def _import_gguf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="llama-architecture GGUF file")
    parser.add_argument("out_dir", type=Path, help="output HF-format directory")
    parser.add_argument("--no-progress", action="store_true")


@command("import-gguf", "convert a llama GGUF into a HF-format model directory", _import_gguf_args)
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


@command("quantize", "calibrate on a text file and write an INT8 (W8A8 static) checkpoint", _quantize_args)
def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from kunlun_runtime.engine.llm_engine import resolve_model_dir
    from kunlun_runtime.models.loader import load_model
    from kunlun_runtime.quantize import calibrate, read_calibration_chunks, write_quantized
    from kunlun_runtime.tokenizer import Tokenizer

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


def _load_optional_commands() -> None:
    # Subcommands living in other modules register themselves on import.
    for module in ("kunlun_runtime.server.cli", "kunlun_runtime.preflight", "kunlun_runtime.tuning.cli"):
        try:
            __import__(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise


class _VersionAction(argparse.Action):
    """``--version``: the package version and what the CPU probe found (ISA tier, caches)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from kunlun_runtime.platforms.cpu_features import cpu_capabilities
        from kunlun_runtime.version import __version__

        try:
            cpu = cpu_capabilities()
        except KunlunRuntimeError as error:
            parser.exit(2, f"kunlun-runtime {__version__}\nerror: {error}\n")
        forced = "" if cpu.tier == cpu.detected_tier else f" (forced; the CPU has {cpu.detected_tier.value})"
        caches = ", ".join(
            f"{name} {value // 1024} KiB"
            for name, value in (("L1d", cpu.l1d_bytes), ("L2", cpu.l2_bytes), ("L3", cpu.l3_bytes))
            if value
        )
        lines = [
            f"kunlun-runtime {__version__}",
            f"cpu: {cpu.model_name}",
            f"isa tier: {cpu.tier.value}{forced}",
            f"caches: {caches or 'unknown'}",
        ]
        print("\n".join(lines))
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    _load_optional_commands()
    parser = argparse.ArgumentParser(prog="kunlun-runtime", description="kunlun-inference runtime")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version and this CPU's kernel tier, then exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, configure, run) in COMMANDS.items():
        child = sub.add_parser(name, help=help_text, description=help_text)
        configure(child)
        child.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.run(args)
    except KunlunRuntimeError as error:
        print(f"kunlun-runtime {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run the registered module, not this __main__ copy: subcommands register on kunlun_runtime.cli.
    from kunlun_runtime.cli import main as registered_main

    sys.exit(registered_main())
