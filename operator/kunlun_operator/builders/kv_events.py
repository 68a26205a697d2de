"""What a precisely routed service adds to its runtime pods: vLLM's KV events and their hash root.

Owns: the runtime's ``--prefix-caching-hash-algo sha256_cbor`` and explicit ``--block-size`` (the
picker's indexer recomputes block hashes from tokens, so both must be the ones it is told), the
per-pod ``--kv-events-config`` (vLLM's KVEventsConfig: a ZeroMQ PUB socket on the named container
port ``kv-events``, topic ``kv@<pod IP>:<port>@<model>``, which llm-d's indexer reads as the pod
its events come from), and the environment both need (``PYTHONHASHSEED``, the pod's IP).
Invariant: the seed, block size and port here are the ones ``picker_config`` gives the indexer.
"""

from __future__ import annotations

import json
from typing import Any

from kunlun_operator import names
from kunlun_operator.spec.routing import hash_seed
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

#: The block hash an indexer outside the pod can recompute from token ids and the seed.
HASH_ALGO = "sha256_cbor"
HASH_SEED_ENV = "PYTHONHASHSEED"
POD_IP_ENV = "POD_IP"
KV_EVENTS_FLAG = "--kv-events-config"
KV_EVENTS_CONTAINER_PORT = {
    "name": names.KV_EVENTS_PORT_NAME,
    "containerPort": names.KV_EVENTS_PORT,
    "protocol": "TCP",
}


def block_size(spec: InferenceSpec) -> int:
    """The runtime's KV block size in tokens: the spec's, else the runtime's default."""
    return spec.runtime.block_size or names.RUNTIME_DEFAULT_BLOCK_SIZE


def kv_events_flags(spec: InferenceSpec) -> list[tuple[str, Any]]:
    """The engine flags of a precisely routed service (empty otherwise): the hash algorithm and
    the block size, in the ConfigMap like the other engine flags."""
    if not spec.routing.precise:
        return []
    flags: list[tuple[str, Any]] = [("--prefix-caching-hash-algo", HASH_ALGO)]
    if spec.runtime.block_size is None:  # explicit: the indexer is told the same number
        flags.append(("--block-size", block_size(spec)))
    return flags


def kv_events_topic(spec: InferenceSpec) -> str:
    """The first frame of every event message: llm-d's indexer takes the pod (as the address it
    routes to, ``IP:port``) and the model from it. ``$(POD_IP)`` is expanded by the kubelet."""
    return f"kv@$({POD_IP_ENV}):{names.RUNTIME_PORT}@{spec.model.name}"


def kv_events_args(spec: InferenceSpec) -> list[str]:
    """``--kv-events-config JSON`` of a precisely routed service (empty otherwise). Per pod (its IP
    is in the topic), so in the container's arguments only, not in the ConfigMap."""
    if not spec.routing.precise:
        return []
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{names.KV_EVENTS_PORT}",
        "topic": kv_events_topic(spec),
    }
    return [KV_EVENTS_FLAG, json.dumps(config, separators=(",", ":"))]


def without_kv_events(args: list[str]) -> list[str]:
    """``args`` without ``--kv-events-config`` and its value: a multi-node group's workers run no
    engine of their own, so only the leader publishes."""
    if KV_EVENTS_FLAG not in args:
        return args
    at = args.index(KV_EVENTS_FLAG)
    return args[:at] + args[at + 2 :]


def kv_events_env(ref: ServiceRef, spec: InferenceSpec) -> list[dict[str, Any]]:
    """The runtime container's environment for precise routing (empty otherwise): the hash seed the
    picker's indexer shares, and the pod's IP for the events' topic."""
    if not spec.routing.precise:
        return []
    return [
        {"name": HASH_SEED_ENV, "value": hash_seed(spec.routing, ref.namespace, ref.name)},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
