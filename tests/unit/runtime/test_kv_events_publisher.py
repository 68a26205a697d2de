"""The KV event publisher over real ZeroMQ sockets on loopback: the three frames of vLLM's wire,
replay from a sequence number with its end marker, the bounded queue dropping its oldest batch
(counted, and exported as kunlun:kv_event_batches_dropped), and a busy endpoint refused at start."""

from __future__ import annotations

import socket

import pytest
import zmq
from prometheus_client import CollectorRegistry

from kunlun_runtime.config import KVEventsConfig
from kunlun_runtime.engine.outputs import EngineCounters
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.event_publisher import END_OF_REPLAY, KVEventPublisher, binds
from kunlun_runtime.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kunlun_runtime.parallel.group import free_port
from kunlun_runtime.server.metrics import build_metrics
from kunlun_runtime.server.stats import StatsRecorder
from tests.support.kv_event_subscriber import KVEventSubscriber, decode_batch


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes what a failed test left open


@pytest.fixture
def endpoints():
    """The SUB's bound endpoint (the publisher connects) and the replay endpoint."""
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def make_publisher(endpoints, encoding="array", **overrides) -> KVEventPublisher:
    pub, replay = endpoints
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub, replay_endpoint=replay, **overrides)
    return KVEventPublisher(config, medium="CPU", encoding=encoding)


def receive(dealer: zmq.Socket) -> list[bytes]:
    """The next reply on ``dealer``, failing (not hanging) when none comes within 10 s."""
    assert dealer.poll(10_000), "the replay socket did not answer"
    return dealer.recv_multipart()


def stored(first: int) -> BlockStored:
    return BlockStored((first,), None, tuple(range(8)), 8)


def test_vllms_bind_or_connect_rule():
    assert (
        binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv") and binds("inproc://kv")
    )
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://indexer.svc:5557")


def test_live_messages_are_topic_seq_payload_and_replay_resends_from_a_sequence_number(context, endpoints):
    subscriber = KVEventSubscriber(context, endpoints[0], endpoints[1], topic="kv@pod@m")
    publisher = make_publisher(endpoints, topic="kv@pod@m")
    publisher.start()
    try:
        publisher.publish([AllBlocksCleared()])
        publisher.publish([])  # nothing happened: no batch, no number
        subscriber.replay()  # catch up on what was sent before the subscription reached the publisher
        sent = 1
        while not subscriber.live_seqs:  # the link is up once one batch arrives live
            publisher.publish([stored(sent)])
            sent += 1
            subscriber.receive_live(timeout_ms=200)
            assert sent < 100, "nothing arrived live"
        assert subscriber.next_seq == sent and subscriber.cached == set(range(1, sent))
        publisher.publish([BlockRemoved((1,))])
        assert subscriber.receive_live(timeout_ms=5000) == 1 and subscriber.live_seqs[-1] == sent
        assert subscriber.cached == set(range(2, sent))

        subscriber.dealer.send_multipart([b"", (sent - 1).to_bytes(8, "big")])
        frames = [receive(subscriber.dealer) for _ in range(3)]
        assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [sent - 1, sent, -1]
        assert frames[-1] == [b"", END_OF_REPLAY, b""]
        assert decode_batch(frames[1][2]).events[0].block_hashes == [1]
    finally:
        publisher.close()
        subscriber.close()


def test_with_the_map_encoding_replay_replies_carry_the_topic_as_vllm_0_26_does(context, endpoints):
    publisher = make_publisher(endpoints, encoding="map", topic="kv@pod@m")
    publisher.start()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoints[1])
    try:
        publisher.publish([AllBlocksCleared()])
        publisher.publish([stored(1)])
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        first = receive(dealer)
        assert first[:3] == [b"", b"kv@pod@m", (1).to_bytes(8, "big")]
        assert decode_batch(first[3], "map").events[0].block_hashes == [1]
        assert receive(dealer) == [b"", b"", END_OF_REPLAY, b""]
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_a_malformed_replay_request_is_ignored_and_the_next_one_answered(context, endpoints):
    publisher = make_publisher(endpoints)
    publisher.start()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoints[1])
    try:
        publisher.publish([AllBlocksCleared()])
        dealer.send_multipart([b"", b"\x00"])  # a 1-byte start: not vLLM's 8 bytes
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert int.from_bytes(receive(dealer)[1], "big") == 0
        assert receive(dealer)[1:] == [END_OF_REPLAY, b""]
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_a_full_queue_drops_its_oldest_batches_and_counts_them(context, endpoints):
    subscriber = KVEventSubscriber(context, endpoints[0], endpoints[1])
    publisher = make_publisher(endpoints, max_queue_size=3)
    try:
        for first in range(5):  # the thread is not running yet: nothing leaves the queue
            publisher.publish([stored(first)])
        assert publisher.num_dropped == 2
        publisher.start()
        subscriber.next_seq = 2  # the first two numbers are gone for good
        assert subscriber.replay() == [2, 3, 4]
        assert subscriber.cached == {2, 3, 4}
    finally:
        publisher.close()
        subscriber.close()


def test_a_batch_that_cannot_be_sent_is_counted_as_dropped_and_the_thread_goes_on(context, endpoints):
    publisher = make_publisher(endpoints)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoints[1])
    try:
        publisher.publish([stored(0)])
        publisher.publish([BlockStored((1,), None, (2**70,), 1)])  # a token id msgpack cannot encode
        publisher.publish([stored(2)])
        publisher.start()
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while not seqs or seqs[-1] != -1:
            seqs.append(int.from_bytes(receive(dealer)[1], "big", signed=True))
        assert seqs == [0, 2, -1]  # 1 is gone for good, as a batch dropped from a full queue
        assert publisher.num_dropped == 1
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_replay_keeps_only_the_last_buffer_steps_batches(context, endpoints):
    subscriber = KVEventSubscriber(context, endpoints[0], endpoints[1])
    publisher = make_publisher(endpoints, buffer_steps=2)
    publisher.start()
    try:
        for first in range(4):
            publisher.publish([stored(first)])
        subscriber.next_seq = 2
        assert subscriber.replay() == [2, 3]
    finally:
        publisher.close()
        subscriber.close()


def test_a_replay_longer_than_zeromqs_default_high_water_mark_arrives_whole(context, endpoints):
    steps = 3000  # ZeroMQ's default send high-water mark is 1000 messages
    publisher = make_publisher(endpoints, buffer_steps=steps)
    slow, quick = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    for dealer in (slow, quick):
        dealer.connect(endpoints[1])
    try:
        for first in range(steps):  # ~1 KiB each: more than the socket buffers hold
            publisher.publish([BlockStored((first,), None, tuple(range(256)), 256)])
        publisher.start()
        slow.send_multipart([b"", (0).to_bytes(8, "big")])  # not read until its whole answer is sent
        quick.send_multipart([b"", (steps - 1).to_bytes(8, "big")])  # answered after slow's
        assert quick.poll(30_000)
        seqs = []
        while not seqs or seqs[-1] != -1:
            assert slow.poll(10_000), f"the replay stopped after {len(seqs)} messages"
            seqs.append(int.from_bytes(slow.recv_multipart()[1], "big", signed=True))
        assert seqs == [*range(steps), -1]
    finally:
        slow.close(linger=0)
        quick.close(linger=0)
        publisher.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_ipv6_endpoints_bind_and_replay(context):
    replay = f"tcp://[::1]:{free_port()}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://[::]:{free_port()}", replay_endpoint=replay
    )
    publisher = KVEventPublisher(config, medium="CPU")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IPV6, 1)
    dealer.connect(replay)
    try:
        publisher.start()
        publisher.publish([AllBlocksCleared()])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert int.from_bytes(receive(dealer)[1], "big") == 0
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_a_busy_replay_endpoint_is_a_start_error_naming_the_key(endpoints):
    first = make_publisher(endpoints)
    try:
        with pytest.raises(ConfigError, match="cannot bind") as error:
            make_publisher(endpoints)
        assert error.value.field == "kv_events_config.replay_endpoint"
    finally:
        first.close()


class _Counters:
    """An engine as the stats recorder reads it: its counters, here only the drops changing."""

    def __init__(self) -> None:
        self.dropped = 0

    def counters(self) -> EngineCounters:
        return EngineCounters(0, 0, 0.0, 0, 0, 0, 0, 0, 0.0, (), num_kv_event_batches_dropped=self.dropped)


def test_drops_are_exported_as_a_counter():
    registry = CollectorRegistry()
    engine = _Counters()
    recorder = StatsRecorder(build_metrics(registry, "m"), engine)
    for dropped in (3, 5):
        engine.dropped = dropped
        recorder.record(engine, [], ran_step=False)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("kunlun:kv_event_batches_dropped_total", labels) == 5
