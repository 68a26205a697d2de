"""``kunlun-runtime``: the command line of the runtime.

Every subcommand is listed in ``COMMANDS`` below, from the module that implements it; nothing
registers itself on import. Errors the user can fix print one line and exit 2; nothing here prints
a traceback for a bad flag or a bad model.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kunlun_runtime.commands import checkpoint, golden, offline, preflight
from kunlun_runtime.errors import KunlunRuntimeError
from kunlun_runtime.options.flags import Command
from kunlun_runtime.server import cli as server_cli
from kunlun_runtime.tuning import cli as tuning_cli

COMMANDS: tuple[Command, ...] = (
    offline.GENERATE,
    offline.CHAT,
    golden.GOLDEN,
    checkpoint.IMPORT_GGUF,
    checkpoint.QUANTIZE,
    server_cli.SERVE,
    preflight.PREFLIGHT,
    tuning_cli.TUNE,
)


class _VersionAction(argparse.Action):
    """``--version``: the package version, what the CPU probe found (ISA tier, caches) and, known
    without a model, the kernel tier ``--dtype auto`` runs here and whether its library is there
    and loads (nothing is compiled), and the backend, tier and dtypes the automatic choices give on
    the CPU. What is in force needs a model: the engine's start line and ``/version`` say it."""

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
        from kunlun_runtime.kv.kv_dtype import resolve_kv_cache_dtype
        from kunlun_runtime.layers.runtime_info import defaults_without_model, kernels_without_model
        from kunlun_runtime.platforms import CpuPlatform
        from kunlun_runtime.platforms.dtypes import resolve_dtype, resolve_weight_dtype

        platform = CpuPlatform()
        kv_dtype = resolve_kv_cache_dtype("auto", resolve_dtype("auto", platform), platform)
        lines = [
            f"kunlun-runtime {__version__}",
            f"cpu: {cpu.model_name}",
            f"isa tier: {cpu.tier.value}{forced}",
            f"caches: {caches or 'unknown'}",
            f"cpu kernels (without a model): {kernels_without_model()}",
            "defaults on the cpu (without a model): "
            + defaults_without_model(resolve_weight_dtype("auto", platform), kv_dtype),
            "backend, kernel tier and dtypes in force: the engine's start line and /version",
        ]
        print("\n".join(lines))
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kunlun-runtime", description="kunlun-inference runtime")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the version, this CPU's ISA tier and whether our kernels for it load, then exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(child)
        child.set_defaults(run=command.run)
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
    sys.exit(main())
