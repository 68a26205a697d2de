"""KV cache events without sockets: --kv-events-config parsed as vLLM's keys, the prefix hashes
(vLLM's sha256 and sha256_cbor recomputed here from their definition), the block pool's events,
and the wire bytes against vLLM's own struct definitions encoded by msgspec."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.config import EngineConfig, KVEventsConfig, parse_kv_events_config
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.block_pool import BlockPool
from kunlun_runtime.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_event_batch
from kunlun_runtime.kv.prefix_hash import PrefixHasher, external_block_hash
from tests.support import kv_event_subscriber as vllm

TOKENS = list(range(100, 124))  # three blocks of 8


# -- configuration ---------------------------------------------------------------------------------
def test_the_json_of_vllms_kv_events_config_is_read_with_its_defaults():
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001",'
        ' "buffer_steps": 5, "hwm": 0, "max_queue_size": 7, "topic": "kv@pod-a@m"}'
    )
    assert config == KVEventsConfig(True, None, "tcp://*:6000", "tcp://*:6001", 5, 0, 7, "kv@pod-a@m")
    assert config.publishes
    assert parse_kv_events_config("{}") == KVEventsConfig()
    assert not KVEventsConfig().publishes  # vLLM's default: off, publisher "null"
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert parse_kv_events_config(None) is None


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("{enable: true}", "kv_events_config", "not valid JSON"),
        ("[1, 2]", "kv_events_config", "must be a JSON object"),
        ('{"enable_kv_cache_event": true}', "kv_events_config.enable_kv_cache_event", "unknown key"),
        ('{"publisher": "kafka"}', "kv_events_config.publisher", "must be one of \\['null', 'zmq'\\]"),
        ('{"endpoint": "tcp://localhost"}', "kv_events_config.endpoint", "ZeroMQ endpoint"),
        ('{"endpoint": "tcp://*:70000"}', "kv_events_config.endpoint", "ZeroMQ endpoint"),
        ('{"endpoint": 5557}', "kv_events_config.endpoint", "must be a string"),
        ('{"replay_endpoint": "udp://*:1"}', "kv_events_config.replay_endpoint", "ZeroMQ endpoint"),
        ('{"replay_endpoint": "tcp://*:5557"}', "kv_events_config.replay_endpoint", "must differ"),
        ('{"max_queue_size": 0}', "kv_events_config.max_queue_size", ">= 1"),
        ('{"buffer_steps": true}', "kv_events_config.buffer_steps", ">= 1"),
        ('{"hwm": -1}', "kv_events_config.hwm", ">= 0"),
        ('{"enable_kv_cache_events": "yes"}', "kv_events_config.enable_kv_cache_events", "true or false"),
    ],
)
def test_a_wrong_kv_events_config_names_the_key(text, field, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_kv_events_config(text)
    assert error.value.field == field


def test_events_need_prefix_caching_and_the_hash_algorithm_is_checked():
    events = KVEventsConfig(enable_kv_cache_events=True)
    with pytest.raises(ConfigError, match="needs prefix caching") as error:
        EngineConfig(enable_prefix_caching=False, kv_events_config=events).validate()
    assert error.value.field == "kv_events_config"
    EngineConfig(enable_prefix_caching=False, kv_events_config=KVEventsConfig()).validate()  # off: fine
    with pytest.raises(ConfigError) as error:
        EngineConfig(prefix_caching_hash_algo="md5").validate()  # type: ignore[arg-type]
    assert error.value.field == "prefix_caching_hash_algo"


# -- hashes ------------------------------------------------------------------------------------------
def vllm_sha256_cbor_chain(seed: str, blocks: list[list[int]], salt: str | None) -> list[bytes]:
    """vLLM's sha256_cbor chain written from its definition: NONE_HASH = sha256(cbor(seed)), then
    sha256(cbor((parent, tokens, extra_keys))) with (salt,) on the first block only."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for index, tokens in enumerate(blocks):
        extra = (salt,) if index == 0 and salt else None
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("salt", [None, "tenant-a\x00"])
def test_sha256_cbor_is_vllms_and_events_carry_the_low_64_bits(salt):
    hasher = PrefixHasher.create("sha256_cbor", seed="42")
    ours = hasher.hash_full_blocks([*TOKENS, 1, 2, 3], 8, salt)  # the partial block is not hashed
    want = vllm_sha256_cbor_chain("42", [TOKENS[0:8], TOKENS[8:16], TOKENS[16:24]], salt)
    assert [h.to_bytes(32, "big") for h in ours] == want
    assert [external_block_hash(h) for h in ours] == [int.from_bytes(d[-8:], "big") for d in want]


def test_sha256_is_vllms_pickle_hash():
    hasher = PrefixHasher.create("sha256", seed="7")
    root = hashlib.sha256(pickle.dumps("7", protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((root, tuple(TOKENS[:8]), None), protocol=5)).digest()
    assert hasher.hash_full_blocks(TOKENS[:8], 8) == [int.from_bytes(first, "big")]


def test_without_a_seed_the_root_is_random_and_with_one_it_is_shared():
    assert PrefixHasher.create("sha256_cbor", "1").hash_full_blocks(TOKENS, 8) == PrefixHasher.create(
        "sha256_cbor", "1"
    ).hash_full_blocks(TOKENS, 8)
    first, second = (PrefixHasher.create("sha256_cbor", None).hash_full_blocks(TOKENS, 8) for _ in "ab")
    assert not set(first) & set(second)
    keyed = [PrefixHasher.create("keyed_blake2b").hash_full_blocks(TOKENS, 8) for _ in "ab"]
    assert not set(keyed[0]) & set(keyed[1])  # a key per process: nobody outside can recompute


@pytest.mark.parametrize("algo", ["keyed_blake2b", "sha256", "sha256_cbor"])
def test_two_tenants_identical_prompts_share_no_hash(algo):
    hasher = PrefixHasher.create(algo, seed="0")
    a, b, none = (hasher.hash_full_blocks(TOKENS, 8, salt) for salt in ("a\x00", "b\x00", None))
    assert not set(a) & set(b) and not set(a) & set(none) and len(set(a)) == 3


# -- the block pool's events -------------------------------------------------------------------------
def test_the_pool_records_stored_runs_evictions_and_clears():
    pool = BlockPool(4, record_events=True)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:2], [11, 12], None, list(range(16)), 8)
    pool.cache_blocks(blocks[2:], [13], 12, list(range(16, 24)), 8)
    assert pool.drain_events() == [
        BlockStored((11, 12), None, tuple(range(16)), 8),
        BlockStored((13,), 12, tuple(range(16, 24)), 8),
    ]
    other = pool.allocate(1)  # the free block: no eviction
    pool.cache_blocks(other, [12], 11, list(range(8, 16)), 8)  # 12 is cached by another block: no event
    pool.free(list(reversed(blocks)))  # tail first: 13, 12, 11 evicted in that order
    pool.allocate(2)
    assert pool.drain_events() == [BlockRemoved((13, 12))]
    assert pool.cached_block_hashes() == frozenset({11})
    pool.reset_prefix_cache()
    assert pool.drain_events() == [AllBlocksCleared()] and pool.drain_events() == []
    assert BlockPool(2).drain_events() == []  # not recording


def test_a_run_broken_by_a_duplicate_block_is_two_events_with_the_right_parents():
    pool = BlockPool(6, record_events=True)
    (holder,) = pool.allocate(1)
    pool.cache(holder, 22)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [21, 22, 23], None, list(range(24)), 8)
    assert pool.drain_events() == [
        BlockStored((21,), None, tuple(range(8)), 8),
        BlockStored((23,), 22, tuple(range(16, 24)), 8),
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("acfr"), st.integers(0, 30)), max_size=40))
def test_stored_minus_removed_is_always_the_cached_set(ops):
    pool = BlockPool(6, record_events=True)
    held: list = []
    seen: set[int] = set()
    for op, value in ops:
        if op == "a" and pool.num_free:
            held.append(pool.allocate(1)[0])
        elif op == "c" and held:
            pool.cache_blocks(held[-1:], [value], None, list(range(8)), 8)
        elif op == "f" and held:
            pool.free([held.pop(0)])
        elif op == "r":
            pool.reset_prefix_cache()
        for event in pool.drain_events():
            if isinstance(event, AllBlocksCleared):
                seen.clear()
            elif isinstance(event, BlockStored):
                assert not seen & set(event.block_hashes)
                seen |= set(event.block_hashes)
            else:
                assert set(event.block_hashes) <= seen
                seen -= set(event.block_hashes)
        assert seen == pool.cached_block_hashes()


# -- the wire: byte for byte what vLLM's msgspec structs encode to -----------------------------------
EVENTS = [
    AllBlocksCleared(),
    BlockStored((2**64 - 1, 5), None, tuple(range(16)), 8),
    BlockStored((7,), 5, tuple(range(16, 24)), 8),
    BlockRemoved((5, 2**63)),
]


def vllm_batch(encoding: str, medium: str) -> object:
    stored, removed, cleared = (
        (vllm.ArrayBlockStored, vllm.ArrayBlockRemoved, vllm.ArrayAllBlocksCleared)
        if encoding == "array"
        else (vllm.MapBlockStored, vllm.MapBlockRemoved, vllm.MapAllBlocksCleared)
    )
    events: list[object] = [
        cleared(),
        stored([2**64 - 1, 5], None, list(range(16)), 8, None, medium, None, None, 0, "full_attention"),
        stored([7], 5, list(range(16, 24)), 8, None, medium, None, None, 0, "full_attention"),
        removed([5, 2**63], medium, 0),
    ]
    return vllm.BATCH_TYPES[encoding](1789095808.8378847, events, 0)


@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("medium", ["CPU", "GPU"])
def test_our_batches_are_the_bytes_vllm_sends_and_decode_with_its_types(encoding, medium):
    ours = encode_event_batch(1789095808.8378847, EVENTS, medium=medium, encoding=encoding)
    assert ours == msgspec.msgpack.Encoder().encode(vllm_batch(encoding, medium))
    decoded = vllm.decode_batch(ours, encoding)
    assert decoded == vllm_batch(encoding, medium)
    with pytest.raises(msgspec.ValidationError):  # the other encoding is really different
        vllm.decode_batch(ours, "map" if encoding == "array" else "array")
