"""The runtime's ConfigMap: the effective engine configuration, and its hash.

Owns: the mapping from the spec to the runtime's vLLM-named flags (``runtime_flags``), used both
for the ConfigMap and for the container's arguments, so the two can never disagree. The hash of the
ConfigMap's data goes on the pod template: a configuration change rolls the pods; the one key it
leaves out is the adapter list of a service that updates its adapters at run time
(``adapters.LORA_MODULES_KEY``), so a change of it reaches the pods through their API instead.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from kunlun_operator import names
from kunlun_operator.builders.adapters import LORA_MODULES_KEY, lora_flags, lora_modules_file
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.builders.kv_events import kv_events_args, kv_events_flags
from kunlun_operator.builders.speculative import speculative_flags
from kunlun_operator.policy.feasibility import startup_budget_seconds
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

CONFIG_KEY = "config.yaml"


def runtime_flags(
    spec: InferenceSpec, model_path: str, *, image_volumes: bool = False
) -> list[tuple[str, Any]]:
    """``(flag, value)`` pairs of ``kunlun-runtime serve``; value None means a bare switch, a list
    several values; ``image_volumes``: where image adapters are mounted."""
    rt = spec.runtime
    flags: list[tuple[str, Any]] = [
        ("--model", model_path),
        ("--served-model-name", spec.model.name),
        ("--port", names.RUNTIME_PORT),
        ("--dtype", rt.dtype),
        ("--tensor-parallel-size", rt.tensor_parallel_size),
    ]
    if spec.multi_node:  # absent for one node: a single-node service's config (and hash) is unchanged
        flags.append(("--pipeline-parallel-size", rt.pipeline_parallel_size))
    optional = [
        ("--quantization", rt.quantization),
        ("--max-model-len", rt.max_model_len),
        ("--max-num-seqs", rt.max_num_seqs),
        ("--max-num-batched-tokens", rt.max_num_batched_tokens),
        ("--block-size", rt.block_size),
        ("--kv-cache-memory", rt.kv_cache_memory_bytes),  # the runtime takes bytes
    ]
    flags += [(flag, value) for flag, value in optional if value is not None]
    flags += kv_events_flags(spec)  # precise routing only: the hash and block size its indexer uses
    if rt.enable_prefix_caching is not None:  # unset: the runtime's default
        flags.append(
            ("--enable-prefix-caching" if rt.enable_prefix_caching else "--no-enable-prefix-caching", None)
        )
    return flags + speculative_flags(spec) + lora_flags(spec, image_volumes=image_volumes)


def rendezvous_args(spec: InferenceSpec) -> list[str]:
    """The multi-node group's torch.distributed rendezvous (empty for one node).

    Kubernetes expands ``$(VAR)`` in container arguments from the container's environment, which
    LeaderWorkerSet fills in every pod (``LWS_WORKER_INDEX``: 0 on the leader; ``LWS_LEADER_ADDRESS``:
    the leader's DNS name); explicit flags show the rendezvous in ``kubectl describe``. Not in the
    ConfigMap: the values differ per pod. A worker waits for the leader's port as long as the
    group's startup budget (``--leader-wait-timeout``): the leader's pod may still be pulling its
    image or model, and a worker that gave up sooner would make LeaderWorkerSet recreate the group.
    """
    if not spec.multi_node:
        return []
    return [
        "--nnodes",
        str(spec.runtime.pipeline_parallel_size),
        "--node-rank",
        f"$({names.LWS_ENV_WORKER_INDEX})",
        "--master-addr",
        f"$({names.LWS_ENV_LEADER_ADDRESS})",
        "--master-port",
        str(names.RENDEZVOUS_PORT),
        "--leader-wait-timeout",
        str(startup_budget_seconds(spec)),
    ]


def literal_arg(value: object) -> str:
    """``value`` as a container argument Kubernetes passes unchanged: it expands ``$(VAR)`` in
    arguments from the container's environment, and ``$$`` is its escape for ``$`` (a model or
    adapter directory named ``a$(HOME)`` stays that directory)."""
    return str(value).replace("$", "$$")


def runtime_args(spec: InferenceSpec, model_path: str, *, image_volumes: bool = False) -> list[str]:
    """The container arguments: ``serve``, the flags (their values literal: ``literal_arg``), the
    rendezvous (multi-node), the KV events (precise routing; those two expanded by Kubernetes on
    purpose), then ``spec.runtime.extraArgs``."""
    args = ["serve"]
    for flag, value in runtime_flags(spec, model_path, image_volumes=image_volumes):
        if value is None:
            args.append(flag)
        else:
            args += [flag, *map(literal_arg, value if isinstance(value, list) else [value])]
    return args + rendezvous_args(spec) + kv_events_args(spec) + list(spec.runtime.extra_args)


def build_config_data(spec: InferenceSpec, model_path: str, *, image_volumes: bool = False) -> dict[str, str]:
    config: dict[str, Any] = {
        flag.removeprefix("--"): (True if value is None else value)
        for flag, value in runtime_flags(spec, model_path, image_volumes=image_volumes)
    }
    if spec.runtime.extra_args:
        config["extra-args"] = list(spec.runtime.extra_args)
    return {
        CONFIG_KEY: yaml.safe_dump(config, sort_keys=False),
        **lora_modules_file(spec, image_volumes=image_volumes),
    }


def config_hash(data: dict[str, str]) -> str:
    """A short stable hash of the ConfigMap's data, but for the run-time adapter list."""
    hashed = {key: value for key, value in data.items() if key != LORA_MODULES_KEY}
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:16]


def build_configmap(
    ref: ServiceRef, spec: InferenceSpec, model_path: str, *, image_volumes: bool = False
) -> dict[str, Any]:
    return {
        **header(names.CONFIGMAP),
        "metadata": build_metadata(ref, names.CONFIGMAP),
        "data": build_config_data(spec, model_path, image_volumes=image_volumes),
    }
