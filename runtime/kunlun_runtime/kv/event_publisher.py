"""Publishing KV cache events on ZeroMQ, as vLLM's ``ZmqEventPublisher`` does on the wire.

Every message on the PUB socket is three frames: the topic, the batch's sequence number (8 bytes,
big-endian) and the msgpack ``EventBatch`` (kv/kv_events.py). The ROUTER replay socket answers a
request ``[b"", start_seq]`` (a DEALER client; 8 bytes, big-endian) with one message per buffered
batch from ``start_seq`` on, then an end marker (-1 as 8 signed bytes, an empty payload), in the
layout of the vLLM whose event encoding was chosen: ``map`` (vLLM since 0.26, PR #45177) puts the
topic before the number as the live messages do, ``[b"", topic, seq, payload]`` and the marker
``[b"", b"", -1, b""]``; ``array`` (vLLM up to 0.25) sends ``[b"", seq, payload]`` and
``[b"", -1, b""]``.

The engine step only calls ``publish``: it numbers the batch and appends it to a bounded queue,
never blocking. When the queue is full the oldest waiting batch is dropped and counted
(``num_dropped``): its sequence number is then missing for good, a gap a subscriber sees and
replay cannot fill. A batch that cannot be encoded or sent is dropped, logged and counted the
same way, and the thread goes on with the next. One thread encodes, sends, keeps the last ``buffer_steps`` batches for
replay and serves the replay socket; the sockets are created here (a bad or busy endpoint is an
error at start) and then used by that thread alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kunlun_runtime.config import KVEventsConfig, KVEventsEncoding
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.kv_events import KVCacheEvent, encode_event_batch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_LINGER_MILLISECONDS = 1000  # how long closing may wait for sent batches to leave


@dataclass(frozen=True, slots=True)
class _Batch:
    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]


def binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB socket binds an endpoint naming every interface (``*``, ``::``) or a
    local one (``ipc://``, ``inproc://``) and connects to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The PUB and replay sockets of one engine and the thread that feeds them."""

    def __init__(self, config: KVEventsConfig, *, medium: str, encoding: KVEventsEncoding = "array") -> None:
        self._config = config
        self._medium = medium
        self._encoding = encoding
        self._queue: deque[_Batch] = deque()
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = 0
        self.num_dropped = 0  # batches dropped from a full queue
        self._stopping = False
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        try:
            self._pub.setsockopt(zmq.IPV6, 1)  # IPv6 endpoints, and `*` on IPv6-only clusters too
            self._pub.set_hwm(config.hwm)
            self._open("endpoint", self._pub, config.endpoint, bind=binds(config.endpoint))
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.IPV6, 1)
                # A whole replay and its end marker fit under the send high-water mark: past it a
                # ROUTER drops what it sends without a word (ZeroMQ's default is 1000 messages).
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self._open("replay_endpoint", self._replay, config.replay_endpoint, bind=True)
        except ConfigError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)

    @staticmethod
    def _open(key: str, socket: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> None:
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as error:
            verb = "bind" if bind else "connect to"
            raise ConfigError(
                f"kv_events_config.{key}: cannot {verb} {endpoint}: {error}", field=f"kv_events_config.{key}"
            ) from None

    def start(self) -> None:
        """Start the thread that sends what ``publish`` queues (batches queued before wait)."""
        logger.info(
            "publishing KV cache events on %s (replay: %s, topic %r)",
            self._config.endpoint,
            self._config.replay_endpoint or "off",
            self._config.topic,
        )
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one batch (one step's events) under the next sequence number; never blocks."""
        if not events:
            return
        with self._lock:
            if self._stopping:
                return
            if len(self._queue) >= self._config.max_queue_size:
                self._queue.popleft()
                self.num_dropped += 1
                if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                    logger.warning(
                        "KV events: the publisher's queue is full (max_queue_size %d); %d batches "
                        "dropped so far (kunlun:kv_event_batches_dropped)",
                        self._config.max_queue_size,
                        self.num_dropped,
                    )
            self._queue.append(_Batch(self._next_seq, time.time(), tuple(events)))
            self._next_seq += 1
        self._wake()

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join()
        self._close_sockets()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread is woken already
            os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            stopping = self._send_queued()
            if self._replay is not None and self._replay in ready:
                try:
                    self._serve_replay(self._replay)
                except Exception:  # a failed replay must not end the thread; logged
                    logger.exception("KV events: answering a replay request failed")
            if stopping:
                return

    def _send_queued(self) -> bool:
        """Send every queued batch, oldest first; True once ``close`` has asked to stop."""
        while True:
            with self._lock:
                if not self._queue:
                    return self._stopping
                batch = self._queue.popleft()
            try:
                payload = encode_event_batch(
                    batch.ts, batch.events, medium=self._medium, encoding=self._encoding
                )
                self._pub.send_multipart((self._config.topic.encode(), batch.seq.to_bytes(8, "big"), payload))
            except Exception:  # one bad batch must not end the thread; counted, logged
                with self._lock:
                    self.num_dropped += 1
                logger.exception(
                    "KV events: batch %d could not be sent and is dropped (kunlun:kv_event_batches_dropped)",
                    batch.seq,
                )
                continue
            self._replay_buffer.append((batch.seq, payload))

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        """Answer every waiting replay request with the buffered batches from its start on."""
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("KV events: ignored a malformed replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # vLLM >= 0.26 (the map encoding's) carries the topic in replies, an empty one in the end marker.
            topic = (self._config.topic.encode(),) if self._encoding == "map" else ()
            end_topic = (b"",) if topic else ()
            for seq, payload in list(self._replay_buffer):
                if seq >= start_seq:
                    replay.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", *end_topic, END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=_LINGER_MILLISECONDS)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
        os.close(self._wake_read)
        os.close(self._wake_write)
