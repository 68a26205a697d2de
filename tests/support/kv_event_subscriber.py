"""A KV-event subscriber as an outside indexer writes one: vLLM's published types, ZeroMQ, replay.

The types are written from ``vllm/distributed/kv_events.py`` as vLLM publishes them, as msgspec
structs (vLLM's own serialiser), in both of its encodings: ``array`` (vLLM up to 0.23: batch and
events ``array_like=True``) and ``map`` (vLLM since PR #42892: the batch still an array, each
event a map tagged by ``type``). Hashes are vLLM's ``ExternalBlockHash`` (``bytes | int``).
Decoding is msgspec's strict typed decode, so a field of the wrong type or place fails it.

``KVEventSubscriber`` binds a SUB socket (the engine's PUB connects to a ``tcp://127.0.0.1:PORT``
endpoint, vLLM's rule), talks to the replay socket as a DEALER (``[b"", start]``; replies
``[b"", seq, payload]`` as vLLM up to 0.25 sends them with the array encoding, ``[b"", topic, seq,
payload]`` and an end marker with an empty topic as vLLM since 0.26 does with the map one), and rebuilds
the set of cached block hashes: stored minus removed, emptied by ``AllBlocksCleared``. It checks
what an indexer relies on as it goes: sequence numbers without repeats, a stored block's parent
already known, token counts of whole blocks, a removed block one that was stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int
END_OF_REPLAY = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# -- the events' fields, as vLLM declares them -----------------------------------------------------
class BlockStored(msgspec.Struct, omit_defaults=True, gc=False):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False):
    pass


# -- the array encoding (vLLM up to 0.23: array_like=True) and the map encoding (since PR #42892) --
class ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


class MapBlockStored(BlockStored, tag="BlockStored"):
    pass


class MapBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    pass


class MapAllBlocksCleared(AllBlocksCleared, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(EventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


BATCH_TYPES: dict[str, type[EventBatch]] = {"array": ArrayKVEventBatch, "map": MapKVEventBatch}


def decode_batch(payload: bytes, encoding: str = "array") -> Any:
    """One ``KVEventBatch``, decoded strictly with vLLM's types of ``encoding``."""
    return msgspec.msgpack.Decoder(BATCH_TYPES[encoding]).decode(payload)


@dataclass
class KVEventSubscriber:
    """What one indexer knows of one engine's prefix cache, from its events."""

    context: zmq.Context[zmq.Socket[bytes]]
    sub_endpoint: str  # where the SUB binds (the engine's PUB connects there)
    replay_endpoint: str
    topic: str = ""
    encoding: str = "array"
    cached: set[int] = field(default_factory=set)
    next_seq: int = 0
    live_seqs: list[int] = field(default_factory=list)  # received on the SUB socket, in order
    replayed_seqs: list[int] = field(default_factory=list)  # received from the replay socket
    batches: list[Any] = field(default_factory=list)  # every batch applied, in order
    applied_seqs: list[int] = field(default_factory=list)  # their sequence numbers
    lose: set[int] = field(default_factory=set)  # live sequence numbers to drop, as a lossy link would

    def __post_init__(self) -> None:
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self.sub.bind(self.sub_endpoint)
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.connect(self.replay_endpoint)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)

    def receive_live(self, timeout_ms: int = 0) -> int:
        """Apply every message waiting on the SUB socket (waiting ``timeout_ms`` for the first); a
        gap is filled from the replay socket first. Returns how many arrived."""
        count = 0
        while self.sub.poll(timeout_ms if count == 0 else 0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode()
            seq = int.from_bytes(seq_bytes, "big")
            count += 1
            if seq in self.lose:
                self.lose.discard(seq)
                continue
            self.live_seqs.append(seq)
            if seq == 0 and self.next_seq > 0:  # the engine restarted: its numbers begin again
                self.next_seq = 0
            if seq > self.next_seq:
                self.replay()
            if seq == self.next_seq:
                self._apply(seq, payload)
        return count

    def replay(self, timeout_ms: int = 10_000) -> list[int]:
        """Ask the replay socket for everything from ``next_seq`` on and apply it; returns the
        sequence numbers replayed."""
        self.dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        got = []
        while True:
            assert self.dealer.poll(timeout_ms), "the replay socket did not answer"
            frames = self.dealer.recv_multipart()
            if self.encoding == "map":  # vLLM >= 0.26: the topic frame, as on the live socket
                empty, topic, seq_bytes, payload = frames
            else:
                (empty, seq_bytes, payload), topic = frames, None
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_OF_REPLAY:
                assert payload == b"" and topic in (None, b"")
                return got
            assert topic in (None, self.topic.encode())
            got.append(seq)
            self.replayed_seqs.append(seq)
            assert seq == self.next_seq, f"replay sent {seq}, expected {self.next_seq} (a batch is lost)"
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload, self.encoding)
        assert batch.data_parallel_rank == 0
        self.batches.append(batch)
        self.applied_seqs.append(seq)
        self.next_seq = seq + 1
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.cached.clear()
            elif isinstance(event, BlockStored):
                assert (
                    event.parent_block_hash is None
                    or event.parent_block_hash in self.cached
                    or (event.parent_block_hash in self._ever_stored())
                ), "a stored block's parent was never announced"
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert not self.cached & set(event.block_hashes), "a block stored twice"
                self.cached |= set(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert set(event.block_hashes) <= self.cached, "removed a block never stored"
                self.cached -= set(event.block_hashes)

    def _ever_stored(self) -> set[int]:
        return {
            h for b in self.batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes
        }

    def stored_events(self) -> list[Any]:
        return [event for batch in self.batches for event in batch.events if isinstance(event, BlockStored)]

    def removed_hashes(self) -> list[int]:
        return [
            h
            for batch in self.batches
            for e in batch.events
            if isinstance(e, BlockRemoved)
            for h in e.block_hashes
        ]
