"""KV cache events as plain data, and their wire form: vLLM's msgpack ``EventBatch``.

The block pool records ``BlockStored`` when full blocks enter the prefix cache, ``BlockRemoved``
when cached blocks are evicted and ``AllBlocksCleared`` when the cache is reset; the engine drains
them once per step and hands them to the publisher (kv/event_publisher.py), which encodes them
here. Pure: no sockets, no torch.

The wire form is that of ``vllm/distributed/kv_events.py`` (msgspec structs, ``tag=True``): a batch
is the array ``[ts, events, data_parallel_rank]``; an event is, in the ``array`` encoding (vLLM up
to 0.23, ``array_like=True``: every field in declaration order), ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
kv_cache_spec_kind, kv_cache_spec_sliding_window]``, ``["BlockRemoved", block_hashes, medium,
group_idx]`` or ``["AllBlocksCleared"]``; in the ``map`` encoding (vLLM since PR #42892, June
2026) a map whose ``type`` key is the tag, fields with a default left out while at the default.
Hashes are unsigned 64-bit integers (prefix_hash.external_block_hash). Blocks computed with a
LoRA adapter carry its ``lora_id`` and ``lora_name``. We send no ``extra_keys``: those would
carry the cache salts, which are tenants' secrets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]  # ships no type information

from kunlun_runtime.config import KVEventsEncoding

# What vLLM sends for the accelerator's memory and for host memory; the engine picks by its device.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# Our KV cache is one group of full-attention layers (vLLM's group 0, FullAttentionSpec).
GROUP_IDX = 0
KV_CACHE_SPEC_KIND = "full_attention"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks entered the prefix cache: consecutive blocks of one request, each after the one
    before it; the first comes after ``parent_block_hash`` (None: it starts the request)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # the blocks' tokens, block after block
    block_size: int
    lora_id: int | None = None  # the adapter the blocks were computed with (None: the base model)
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (their memory went to other tokens)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was emptied: on a reset, and as the first event after the engine starts."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event_batch(
    ts: float,
    events: Sequence[KVCacheEvent],
    *,
    medium: str,
    data_parallel_rank: int = 0,
    encoding: KVEventsEncoding = "array",
) -> bytes:
    """The msgpack payload of one ``EventBatch``, byte for byte what vLLM's msgspec encoder gives."""
    encode = _as_array if encoding == "array" else _as_map
    wire = [encode(event, medium) for event in events]
    payload: bytes = msgpack.packb([ts, wire, data_parallel_rank], use_bin_type=True)
    return payload


def _as_array(event: KVCacheEvent, medium: str) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            medium,
            event.lora_name,
            None,  # extra_keys
            GROUP_IDX,
            KV_CACHE_SPEC_KIND,
            None,  # kv_cache_spec_sliding_window
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), medium, GROUP_IDX]
    return ["AllBlocksCleared"]


def _as_map(event: KVCacheEvent, medium: str) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": medium,
            "lora_name": event.lora_name,
            "group_idx": GROUP_IDX,
            "kv_cache_spec_kind": KV_CACHE_SPEC_KIND,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": medium,
            "group_idx": GROUP_IDX,
        }
    return {"type": "AllBlocksCleared"}
