"""The engine's KV cache events end to end: a real ZeroMQ subscriber, decoding every message with
vLLM's published types, rebuilds exactly the engine's cached blocks through admissions, evictions
under memory pressure, preemption, a reset and a restart; a lost range comes back through the
replay socket; the sha256_cbor hashes are recomputable from the events' tokens; two tenants never
share a hash; a wrong configuration stops `serve` at start with the key named; one publisher per
engine under tensor parallelism."""

from __future__ import annotations

import hashlib
import shutil
import time

import cbor2
import httpx
import pytest
import zmq

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.commands.cli import main
from kunlun_runtime.config import KVEventsConfig
from kunlun_runtime.errors import ConfigError, ModelLoadError
from kunlun_runtime.parallel.group import free_port
from tests.integration.server.live import serve_in_thread
from tests.support.kv_event_subscriber import AllBlocksCleared, KVEventSubscriber
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

BLOCK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv-events") / "tiny", TINY_SPECS["llama-gqa"])


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes what a failed test left open


def start(model_dir, context, *, encoding="array", **options):
    """An engine publishing KV events to a fresh subscriber (15 blocks of 8 tokens: little room)."""
    sub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    subscriber = KVEventSubscriber(context, sub, replay, topic="kv@pod-0@tiny", encoding=encoding)
    events = {
        "enable_kv_cache_events": True,
        "endpoint": sub,
        "replay_endpoint": replay,
        "topic": "kv@pod-0@tiny",
    }
    options = {"max_model_len": 64, "kv_cache_memory": "64KiB", **options}
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK,
        kv_events_config=events,
        kv_events_encoding=encoding,
        **options,
    )
    return llm, subscriber


def in_sync(llm, subscriber, within_s: float = 10.0) -> set[int]:
    """Take in what arrived live, replay the rest, and check the subscriber's set becomes the
    engine's. The publisher sends from its own thread (as vLLM's does), so the last step's batch
    may still be queued when ``generate`` returns: on a loaded machine a replay asked for at once
    found nothing new. The subscriber takes in and replays until the sets agree or ``within_s``
    passes."""
    cached = set(llm.engine.block_pool.cached_block_hashes())
    deadline = time.monotonic() + within_s
    while True:
        subscriber.receive_live()
        subscriber.replay()
        if subscriber.cached == cached or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert subscriber.cached == cached
    return cached


def generate(llm, prompts, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 300 + 1 for i in range(length)]


def until_live(llm, subscriber, *, seed: int) -> int:
    """Serve new prompts (from ``seed``) until a batch arrives live: the PUB socket connects and
    learns the subscription in the background. Returns the next unused seed."""
    for attempt in range(100):
        generate(llm, [prompt(seed + attempt, 20)], max_tokens=2)
        if subscriber.receive_live(timeout_ms=200):
            return seed + attempt + 1
    raise AssertionError("no batch arrived live")


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_the_subscriber_rebuilds_the_cached_set_through_pressure_preemption_reset_and_restart(
    model_dir, context, encoding
):
    llm, subscriber = start(model_dir, context, encoding=encoding)
    try:
        history = prompt(1, 30)
        generate(llm, [history, history + prompt(2, 10)])  # a shared prefix: admissions and a hit
        assert len(in_sync(llm, subscriber)) >= 4
        assert type(subscriber.batches[0].events[0]).__name__.endswith("AllBlocksCleared")  # seq 0

        generate(llm, [prompt(seed, 40) for seed in range(3, 9)])  # more than 15 blocks: evictions
        assert llm.engine.block_pool.num_evictions > 0 and subscriber.removed_hashes() == []
        in_sync(llm, subscriber)
        assert len(subscriber.removed_hashes()) == llm.engine.block_pool.num_evictions

        preempted = llm.engine.scheduler.num_preemptions_total
        generate(llm, [prompt(seed, 20) for seed in range(10, 16)], max_tokens=36)  # 6 x 7 blocks > 15
        assert llm.engine.scheduler.num_preemptions_total > preempted
        in_sync(llm, subscriber)

        llm.engine.add_request("holds-blocks", {"prompt_token_ids": history}, SamplingParams(max_tokens=2))
        llm.engine.step()
        assert not llm.reset_prefix_cache()  # refused while a request holds blocks, as vLLM's
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert llm.reset_prefix_cache()
        assert in_sync(llm, subscriber) == set()
        generate(llm, [history])
        assert in_sync(llm, subscriber)
        assert {e.medium for e in subscriber.stored_events()} == {"CPU"}
    finally:
        llm.engine.close()
    # A restart: a new engine, the same endpoints; its numbers begin again with AllBlocksCleared.
    events = llm.engine.config.kv_events_config
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=64, kv_cache_memory="64KiB",
              kv_events_config=events, kv_events_encoding=encoding)  # fmt: skip
    try:
        generate(llm, [history])
        subscriber.next_seq = 0  # it knows the pod restarted (or sees number 0 again live)
        restarted_at = len(subscriber.applied_seqs)
        assert in_sync(llm, subscriber)
        after = subscriber.applied_seqs[restarted_at:]
        assert after == list(range(len(after))) and len(after) >= 2
        first = subscriber.batches[restarted_at].events  # number 0 of the new run: the cache is empty
        assert len(first) == 1 and isinstance(first[0], AllBlocksCleared)
    finally:
        llm.engine.close()
        subscriber.close()


def test_a_lost_range_is_recovered_through_the_replay_socket(model_dir, context):
    llm, subscriber = start(model_dir, context)
    try:
        seed = until_live(llm, subscriber, seed=100)
        subscriber.replay()
        lost = set(range(subscriber.next_seq, subscriber.next_seq + 3))
        subscriber.lose = set(lost)
        replayed_before = len(subscriber.replayed_seqs)
        while subscriber.lose or subscriber.next_seq <= max(lost):  # until a later batch shows the gap
            generate(llm, [prompt(seed, 20)], max_tokens=2)  # new blocks: one batch at least
            seed += 1
            assert subscriber.receive_live(timeout_ms=10_000), "no live batch came"
        assert lost <= set(subscriber.replayed_seqs[replayed_before:]) and not lost & set(
            subscriber.live_seqs
        )
        in_sync(llm, subscriber)
    finally:
        llm.engine.close()
        subscriber.close()


def vllm_sha256_cbor(parent: bytes, tokens: list[int], extra: tuple | None) -> bytes:
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)).digest()


def test_sha256_cbor_event_hashes_are_recomputed_from_the_events_tokens(model_dir, context, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    llm, subscriber = start(model_dir, context, prefix_caching_hash_algo="sha256_cbor")
    try:
        tokens = prompt(5, 33)
        engine = llm.engine
        engine.add_request(
            "salted", {"prompt_token_ids": tokens}, SamplingParams(max_tokens=1), cache_salt="t1"
        )
        while engine.has_unfinished_requests():
            engine.step()
        generate(llm, [tokens])
        in_sync(llm, subscriber)
        root = hashlib.sha256(cbor2.dumps("1234", canonical=True)).digest()
        for salt in ("t1", None):  # the indexer recomputes each chain from tokens alone
            digests, parent = [], root
            for index in range(4):
                parent = vllm_sha256_cbor(
                    parent,
                    tokens[index * BLOCK : (index + 1) * BLOCK],
                    (salt,) if index == 0 and salt else None,
                )
                digests.append(int.from_bytes(parent[-8:], "big"))
            stored = [e for e in subscriber.stored_events() if e.block_hashes[0] == digests[0]]
            assert (
                len(stored) == 1 and stored[0].block_hashes == digests and stored[0].parent_block_hash is None
            )
            assert stored[0].token_ids == tokens[:32]
    finally:
        llm.engine.close()
        subscriber.close()


def test_two_tenants_identical_prompts_never_share_an_event_hash(model_dir, context):
    llm, subscriber = start(model_dir, context)
    try:
        tokens = prompt(9, 33)
        for salt in ("tenant-a\x00", "tenant-b\x00"):  # server/auth.py's tenant namespaces
            llm.engine.add_request(
                salt, {"prompt_token_ids": tokens}, SamplingParams(max_tokens=1), cache_salt=salt
            )
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        in_sync(llm, subscriber)
        a, b = (set(e.block_hashes) for e in subscriber.stored_events())
        assert len(a) == len(b) == 4 and not a & b
    finally:
        llm.engine.close()
        subscriber.close()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
            "kv_events_config.publisher",
        ),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}'],
            "kv_events_config.endpont",
        ),
        (["--kv-events-config", '{"endpoint": "tcp://host"}'], "kv_events_config.endpoint"),
        (["--kv-events-config", "enable_kv_cache_events=true"], "kv_events_config: not valid JSON"),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true}', "--no-enable-prefix-caching"],
            "needs prefix caching",
        ),
    ],
)
def test_a_wrong_config_stops_serve_at_start_naming_the_key(model_dir, capsys, flags, named):
    assert main(["serve", "--model", str(model_dir), *flags]) == 2
    assert named in capsys.readouterr().err


def test_one_publisher_per_engine_under_tensor_parallelism(model_dir, context):
    llm, subscriber = start(model_dir, context, tensor_parallel_size=2)
    try:
        generate(llm, [prompt(1, 30), prompt(2, 30)])
        seed = until_live(llm, subscriber, seed=3)
        generate(llm, [prompt(seed, 20)], max_tokens=2)
        in_sync(llm, subscriber)
        # One numbering: every batch once, none live twice (a second publisher would repeat them).
        assert subscriber.applied_seqs == list(range(subscriber.next_seq))
        assert len(set(subscriber.live_seqs)) == len(subscriber.live_seqs) > 0
    finally:
        llm.engine.close()
        subscriber.close()


def port_is_free(endpoint: str) -> bool:
    """Whether a fresh socket can bind ``endpoint`` (the publisher that held it has let it go)."""
    probe = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        probe.bind(endpoint)
        return True
    except zmq.ZMQError:
        return False
    finally:
        probe.close(linger=0)


def test_leaving_with_llm_closes_the_publisher_its_last_batch_sent_and_its_port_free(model_dir, context):
    llm, subscriber = start(model_dir, context)
    replay = subscriber.replay_endpoint
    with llm:
        until_live(llm, subscriber, seed=500)
        assert not port_is_free(replay)
        generate(llm, [prompt(600, 24)], max_tokens=2)
        cached = set(llm.engine.block_pool.cached_block_hashes())
    try:
        assert llm.engine.kv_events is None and port_is_free(replay)
        while subscriber.receive_live(timeout_ms=2000):  # what the close flushed
            pass
        assert subscriber.cached == cached and subscriber.applied_seqs == list(range(subscriber.next_seq))
    finally:
        subscriber.close()


def test_serve_closes_the_engine_on_shutdown_its_last_batch_sent_and_its_port_free(model_dir, context):
    sub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    subscriber = KVEventSubscriber(context, sub, replay, topic="kv@pod-0@tiny")
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=sub, replay_endpoint=replay, topic="kv@pod-0@tiny"
    )
    try:
        with serve_in_thread(
            model_dir, block_size=BLOCK, max_model_len=64, kv_events_config=events
        ) as server:

            def complete(seed: int) -> None:
                body = {"model": server.model_name, "prompt": prompt(seed, 24), "max_tokens": 2}
                assert (
                    httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
                )

            for seed in range(700, 800):  # until a batch arrives live: the link is up
                complete(seed)
                if subscriber.receive_live(timeout_ms=200):
                    break
            subscriber.replay()
            assert subscriber.cached and not port_is_free(replay)
            complete(900)
        assert port_is_free(replay)
        stored_before = len(subscriber.stored_events())
        while subscriber.receive_live(timeout_ms=2000):  # the second request's blocks, sent before the close
            pass
        assert len(subscriber.stored_events()) > stored_before
        assert subscriber.applied_seqs == list(range(subscriber.next_seq))
    finally:
        subscriber.close()


def test_a_busy_endpoint_fails_before_the_model_loads(model_dir, context, tmp_path):
    weightless = tmp_path / "tiny"
    shutil.copytree(model_dir, weightless)
    (weightless / "model.safetensors").unlink()  # loading the model would fail on this
    replay = f"tcp://127.0.0.1:{free_port()}"
    holder = context.socket(zmq.ROUTER)
    holder.bind(replay)
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": replay,
    }
    with pytest.raises(ConfigError, match="cannot bind") as error:
        LLM(str(weightless), dtype="float32", block_size=BLOCK, kv_events_config=events)
    assert error.value.field == "kv_events_config.replay_endpoint"
    holder.close(linger=0)


def test_a_failed_load_frees_the_endpoints_it_bound(model_dir, tmp_path):
    weightless = tmp_path / "tiny"
    shutil.copytree(model_dir, weightless)
    (weightless / "model.safetensors").unlink()
    replay = f"tcp://127.0.0.1:{free_port()}"
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": replay,
    }
    with pytest.raises(ModelLoadError, match="weight files"):
        LLM(str(weightless), dtype="float32", block_size=BLOCK, kv_events_config=events)
    assert port_is_free(replay)
