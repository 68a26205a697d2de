"""The flags every engine-running subcommand shares, and the ``Command`` record subcommands export.

Engine flags carry vLLM's names (``--max-model-len``, ``--block-size``, ...) and map one to one
onto ``EngineConfig`` fields. Subcommand modules import this module; only ``cli`` imports them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from kunlun_runtime.config import (
    DEFAULT_MASTER_PORT,
    DeviceName,
    DTypeName,
    EngineConfig,
    KVCacheDTypeName,
    KVEventsEncoding,
    LinearBackendName,
    PrefixCachingHashAlgoName,
    QuantizationName,
    SchedulingPolicyOption,
    parse_kv_events_config,
    parse_memory,
    parse_speculative_config,
)
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.lora import add_lora_engine_args, lora_engine_options

# What LeaderWorkerSet sets in every container of a group.
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
# The default of --require-native-kernels (the runtime images set it to 1).
REQUIRE_NATIVE_KERNELS_ENV = "KUNLUN_REQUIRE_NATIVE_KERNELS"


@dataclass(frozen=True, slots=True)
class Command:
    """One ``kunlun-runtime`` subcommand: ``configure`` adds its flags, ``run`` runs it (exit code)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_engine_args(parser: argparse.ArgumentParser, *, default_dtype: str = "auto") -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    group.add_argument("--served-model-name", default=None)
    group.add_argument("--dtype", default=default_dtype, choices=get_args(DTypeName))
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=get_args(KVCacheDTypeName),
        help="what the KV cache stores (auto: the activations' dtype; BF16 if they are FP32 for want of native BF16)",
    )
    group.add_argument("--device", default="auto", choices=get_args(DeviceName))
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, bytes or e.g. 2GiB")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add_kv_events_args(group)
    group.add_argument("--max-preemptions", type=int, default=3)
    group.add_argument("--scheduling-policy", default="fixed", choices=get_args(SchedulingPolicyOption))
    group.add_argument(
        "--target-step-seconds", type=float, default=None, help="feedback: step cap while decoding"
    )
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    add_distributed_args(group)
    group.add_argument("--quantization", default=None, choices=get_args(QuantizationName))
    add_kernel_args(group)
    add_lora_engine_args(group)
    group.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="vLLM's speculative decoding config (n-gram or suffix drafts, no second model), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or \'{"method": "suffix"}\'',
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--config",
        type=Path,
        default=None,
        help="engine options YAML (e.g. the output of `kunlun-runtime tune`); flags given explicitly win",
    )


def add_kv_events_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The prefix cache's block hashes and vLLM's KV cache events (docs/server.md)."""
    parser.add_argument(
        "--prefix-caching-hash-algo",
        default="keyed_blake2b",
        choices=get_args(PrefixCachingHashAlgoName),
        help="keyed_blake2b: keyed per process, no outsider can recompute it; sha256, sha256_cbor: "
        "vLLM's, recomputable from tokens with $PYTHONHASHSEED",
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="vLLM's KVEventsConfig as JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )
    parser.add_argument(
        "--kv-events-encoding",
        default="array",
        choices=get_args(KVEventsEncoding),
        help="vLLM's KV event wire of that era: each event an array and replay replies without the topic "
        "(vLLM <= 0.25; every indexer reads it), or each event a map and replay replies with the topic (vLLM 0.26)",
    )


def add_distributed_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Pipeline stages and the nodes they run on; under LeaderWorkerSet the node flags default to
    the environment it sets in every pod."""
    parser.add_argument(
        "--pipeline-parallel-size", type=int, default=1, help="pipeline stages (layers split across them)"
    )
    parser.add_argument(
        "--nnodes", type=int, default=None, help=f"nodes in the group (default: ${LWS_GROUP_SIZE} or 1)"
    )
    parser.add_argument(
        "--node-rank", type=int, default=None, help=f"this node; 0 serves (default: ${LWS_WORKER_INDEX} or 0)"
    )
    parser.add_argument(
        "--master-addr",
        default=None,
        help=f"the leader's address (default: ${LWS_LEADER_ADDRESS}; 127.0.0.1 on one node, required on several)",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help=f"the leader's rendezvous port (default: a free port on one node, {DEFAULT_MASTER_PORT} across nodes)",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds a rank may stay silent before the group fails (the leader then exits 1)",
    )
    parser.add_argument(
        "--leader-wait-timeout",
        type=float,
        default=None,
        help="seconds a worker node (--node-rank >= 1) retries the leader's port before it exits 1 "
        "(default: --distributed-timeout)",
    )


def rendezvous_options(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The node flags, each from its flag, else from LeaderWorkerSet's environment, else the
    one-node default. Raises ConfigError naming an environment variable that is not a number."""

    def number(flag: int | None, variable: str, default: int) -> int:
        if flag is not None:
            return flag
        value = env.get(variable)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{variable}: must be an integer, got {value!r}", field=variable) from None

    nnodes = number(args.nnodes, LWS_GROUP_SIZE, 1)
    master_addr = args.master_addr or env.get(LWS_LEADER_ADDRESS)
    return {
        "nnodes": nnodes,
        "node_rank": number(args.node_rank, LWS_WORKER_INDEX, 0),
        "master_addr": master_addr or "127.0.0.1",
        "master_port": args.master_port,
    }


def check_leader_address(nnodes: int, master_addr: str | None) -> None:
    """Several nodes need the leader's address given: 127.0.0.1 would send every worker to its
    own loopback. Raises ConfigError naming the flags."""
    if nnodes > 1 and not master_addr:
        raise ConfigError(
            f"master_addr: --nnodes {nnodes} (or ${LWS_GROUP_SIZE}) needs the leader's address: give "
            f"--master-addr HOST (node 0's address, reachable from every node) or run under "
            f"LeaderWorkerSet, which sets ${LWS_LEADER_ADDRESS}",
            field="master_addr",
        )


def add_kernel_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--linear-backend",
        default="auto",
        choices=get_args(LinearBackendName),
        help="auto: our kernels where this CPU's tier has them, else oneDNN-prepacked where its BF16 runs, else plain",
    )
    parser.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our RMSNorm, decode-attention and one-call layer-stack kernels where the CPU tier has them",
    )
    parser.add_argument(
        "--require-native-kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="where this CPU runs our kernels, a failed build or load of them stops the start instead "
        f"of falling back to the slower path (default: ${REQUIRE_NATIVE_KERNELS_ENV}=1, else off)",
    )


def env_flag(env: Mapping[str, str], variable: str) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off (unset or empty: off).
    Raises ConfigError naming the variable for anything else."""
    value = env.get(variable, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{variable}: must be 1 or 0 (true or false), got {value!r}", field=variable)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags; options from ``--config`` fill every flag left at its
    default. Raises ConfigError naming the option (or the file and key)."""
    # The leader's address is checked first, on what the flags, LeaderWorkerSet's environment and
    # the file say together: the node count and the address may each come from any of them.
    nnodes = rendezvous_options(args, os.environ)["nnodes"]
    given_address = args.master_addr or os.environ.get(LWS_LEADER_ADDRESS)
    if getattr(args, "config", None) is None:
        check_leader_address(nnodes, given_address)
        return _config_from_flags(args)
    from dataclasses import replace

    from kunlun_runtime.options.config_file import load_engine_options

    file_options = load_engine_options(args.config)
    check_leader_address(
        nnodes if nnodes != 1 else file_options.get("nnodes", 1),
        given_address or file_options.get("master_addr"),
    )
    # Validated once merged: the flags alone may be half of a valid whole (nodes from the
    # environment, stages from the file).
    config = _config_from_flags(args, validate=False)
    defaults = argparse.ArgumentParser(add_help=False)
    add_engine_args(defaults)
    default_config = _config_from_flags(defaults.parse_args([]), validate=False)
    overrides = {
        key: value
        for key, value in file_options.items()
        if getattr(config, key) == getattr(default_config, key)  # not set on the command line
    }
    return replace(config, **overrides).validate()


def _config_from_flags(args: argparse.Namespace, *, validate: bool = True) -> EngineConfig:
    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=parse_memory(args.kv_cache_memory),
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        kv_events_config=parse_kv_events_config(args.kv_events_config),
        kv_events_encoding=args.kv_events_encoding,
        max_preemptions=args.max_preemptions,
        scheduling_policy=args.scheduling_policy,
        target_step_seconds=args.target_step_seconds,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_timeout_seconds=args.distributed_timeout,
        leader_wait_timeout_seconds=args.leader_wait_timeout,
        **rendezvous_options(args, os.environ),
        quantization=args.quantization,
        linear_backend=args.linear_backend,
        native_kernels=args.native_kernels,
        require_native_kernels=(
            env_flag(os.environ, REQUIRE_NATIVE_KERNELS_ENV)
            if args.require_native_kernels is None
            else args.require_native_kernels
        ),
        **lora_engine_options(args),
        speculative_config=parse_speculative_config(args.speculative_config),
        seed=args.seed,
    )
    return config.validate() if validate else config
