"""The Endpoint Picker stand-in of ``bench_routing.py``: scores replicas from what an EPP can read.

Never shipped: it exists to measure what prefix-aware routing gains over round-robin. It mirrors
the Gateway API Inference Extension's default scheduling profile: a queue scorer (shortest
``vllm:num_requests_waiting`` 1, longest 0), a KV-cache-utilisation scorer (1 minus
``vllm:kv_cache_usage_perc``) and a prefix-cache scorer (the fraction of the prompt's full blocks
the replica is believed to hold), weighted 2, 2 and 3, the highest total wins (ties at random).
``Weights.running`` adds the extension's running-requests-size scorer (fewest
``vllm:num_requests_running`` 1, most 0), which its default profile leaves out: without it, every
conversation that shares a system prompt goes to the replica that first cached it, since a
replica's queue stays empty while its batch has room and its KV use stays low.

What a replica is believed to hold comes from one of two indexes:

- ``LruIndex`` (approximate, as the extension's prefix plugin): the block hashes of the prompts this
  picker sent to the replica, least recently used dropped beyond the replica's block count
  (``vllm:cache_config_info{num_gpu_blocks}``). Hashes chain over the prompt's tokens.
- ``EventIndex`` (precise, as llm-d's KV-events indexer): the blocks the replica's KV events say
  are cached, matched by hashes the picker recomputes from the prompt's tokens with vLLM's
  ``sha256_cbor`` and the replicas' ``PYTHONHASHSEED`` (``sha256_cbor_hashes``).

Pure: no sockets, no HTTP (bench_routing.py does the I/O).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import msgpack

_MASK_64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Weights:
    """Each scorer's weight; the defaults (``running`` 0) are the extension's default profile."""

    prefix: float = 3.0
    queue: float = 2.0
    kv_usage: float = 2.0
    running: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's protocol gauges at the last scrape."""

    waiting: float
    running: float
    kv_usage: float


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The approximate index's hashes: one per full block, each over the block and its parent's
    hash, so equal hashes mean equal prefixes (as the extension's prefix plugin chains them)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def sha256_cbor_hashes(token_ids: Sequence[int], block_size: int, seed: str, salt: str | None) -> list[int]:
    """vLLM's ``sha256_cbor`` block hashes of the prompt's full blocks, as KV events carry them
    (the digest's low 64 bits). The first block's parent is the digest of ``seed``
    (``$PYTHONHASHSEED``), and its extra keys are ``(salt,)`` when the request has a cache salt."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    hashes: list[int] = []
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra_keys = (salt,) if index == 0 and salt else None
        payload = (parent, tuple(token_ids[start : start + block_size]), extra_keys)
        parent = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
        hashes.append(int.from_bytes(parent, "big") & _MASK_64)
    return hashes


class LruIndex:
    """The block hashes last sent to one replica, at most ``capacity`` (its block count)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this index holds."""
        return _leading(hashes, self._hashes)


class EventIndex:
    """One replica's cached blocks as its KV events tell them: stored minus removed."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.num_batches = 0
        self.num_missed = 0  # batches lost between two received sequence numbers
        self._last_seq: int | None = None

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply one published message (its sequence number and msgpack ``EventBatch``)."""
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.num_missed += seq - self._last_seq - 1
        self._last_seq = seq
        self.num_batches += 1
        for kind, hashes in decode_event_batch(payload):
            if kind == "BlockStored":
                self.cached.update(hashes)
            elif kind == "BlockRemoved":
                self.cached.difference_update(hashes)
            elif kind == "AllBlocksCleared":
                self.cached.clear()

    def match(self, hashes: Sequence[int]) -> int:
        return _leading(hashes, self.cached)


def decode_event_batch(payload: bytes) -> list[tuple[str, list[int]]]:
    """(event type, block hashes) of each event of a vLLM ``EventBatch`` (``[ts, events, rank]``),
    whether its events are arrays (``[tag, block_hashes, ...]``) or maps (``{"type": tag, ...}``).
    Raises ValueError on anything else."""
    batch = msgpack.unpackb(payload, raw=False)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError(f"not an EventBatch: {batch!r:.200}")
    return [_decode_event(event) for event in batch[1]]


def _decode_event(event: Any) -> tuple[str, list[int]]:
    if isinstance(event, list) and event and isinstance(event[0], str):
        kind, hashes = event[0], (event[1] if len(event) > 1 else [])
    elif isinstance(event, dict) and isinstance(event.get("type"), str):
        kind, hashes = event["type"], event.get("block_hashes", [])
    else:
        raise ValueError(f"not a KV cache event: {event!r:.200}")
    return kind, [int.from_bytes(h, "big") & _MASK_64 if isinstance(h, bytes) else h for h in hashes]


def _leading(hashes: Sequence[int], held: Any) -> int:
    count = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        count += 1
    return count


def score_replicas(
    matched_blocks: Sequence[int], num_blocks: int, loads: Sequence[ReplicaLoad], weights: Weights
) -> list[float]:
    """The weighted score of each replica: prefix match, queue depth, KV-cache use, running."""
    prefix = [matched / num_blocks if num_blocks else 0.0 for matched in matched_blocks]
    queue = _fewest_best([load.waiting for load in loads])
    running = _fewest_best([load.running for load in loads])
    kv = [1.0 - load.kv_usage for load in loads]
    return [
        weights.prefix * p + weights.queue * q + weights.kv_usage * k + weights.running * r
        for p, q, k, r in zip(prefix, queue, kv, running, strict=True)
    ]


def _fewest_best(values: Sequence[float]) -> list[float]:
    """1 for the smallest value, 0 for the largest, linear between; all 1 when they are equal."""
    low, high = min(values), max(values)
    return [1.0 if high == low else (high - value) / (high - low) for value in values]


def pick(scores: Sequence[float], rng: random.Random) -> int:
    """The replica with the highest score; a tie is broken at random, as the max-score picker does."""
    best = max(scores)
    return rng.choice([index for index, score in enumerate(scores) if score == best])
