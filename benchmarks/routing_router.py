"""The routers ``bench_routing.py`` compares: round-robin, and the Endpoint Picker stand-in.

``PrefixAware`` does what an EPP does, with the I/O an EPP has: it scrapes every replica's
``/metrics`` every ``--scrape-interval`` seconds (the queue, the KV use), turns a request's messages
into the prompt's tokens (``/tokenize``, taken in turn from the replicas: all share the model's
tokenizer), hashes the prompt's full blocks and asks its index which replica holds the longest
prefix; ``routing_picker`` scores and picks. Its index is the approximate one (the blocks it sent
each replica), or with ``precise`` one built from each replica's KV events, received on a ZeroMQ
SUB socket per replica. Hashes the picker recomputes must equal the engine's: the replicas hash
with ``sha256_cbor`` under a known ``PYTHONHASHSEED``, and every request through the HTTP server
carries the server's cache salt (an open server's one tenant, ``scoped_cache_salt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random

import httpx
import zmq
import zmq.asyncio
from routing_fleet import Replica, read_load
from routing_picker import (
    EventIndex,
    LruIndex,
    ReplicaLoad,
    Weights,
    chain_hashes,
    pick,
    score_replicas,
    sha256_cbor_hashes,
)

from kunlun_runtime.server.auth import DEFAULT_TENANT, scoped_cache_salt


class RoundRobin:
    """A plain Kubernetes Service: each request to the next replica."""

    def __init__(self, num_replicas: int) -> None:
        self._next = itertools.cycle(range(num_replicas))

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def choose(self, messages: list[dict]) -> int:
        return next(self._next)

    def stats(self) -> dict[str, object]:
        return {}


class PrefixAware:
    """The EPP stand-in: queue, KV-use and prefix-cache scorers over what the replicas publish."""

    def __init__(self, http: httpx.AsyncClient, replicas: list[Replica], args, *, precise: bool) -> None:
        self.http = http
        self.replicas = replicas
        self.scrape_interval = args.scrape_interval
        self.hash_seed = args.hash_seed
        self.precise = precise
        self.rng = random.Random(args.seed)
        self.weights = Weights(running=args.running_weight)
        self.loads = [ReplicaLoad(0.0, 0.0, 0.0) for _ in replicas]
        self.lru = [LruIndex(replica.num_blocks) for replica in replicas]
        self.events = [EventIndex() for _ in replicas]
        self.salt = scoped_cache_salt(DEFAULT_TENANT, None)  # what the server gives an open server's calls
        self._tokenizer = itertools.cycle(range(len(replicas)))
        self._tasks: list[asyncio.Task] = []
        self._context = zmq.asyncio.Context() if precise else None
        self.num_picks = 0
        self.num_matched_blocks = 0
        self.num_prompt_blocks = 0

    async def start(self) -> None:
        await self._scrape()
        self._tasks.append(asyncio.ensure_future(self._scrape_forever()))
        for index, replica in enumerate(self.replicas if self.precise else ()):
            assert self._context is not None and replica.events_endpoint is not None
            socket = self._context.socket(zmq.SUB)
            socket.connect(replica.events_endpoint)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            self._tasks.append(asyncio.ensure_future(self._receive(index, socket)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.destroy(linger=0)

    async def _scrape(self) -> None:
        self.loads = list(await asyncio.gather(*(read_load(self.http, r) for r in self.replicas)))

    async def _scrape_forever(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_interval)
            with contextlib.suppress(httpx.HTTPError):  # a missed scrape keeps the last loads, as an EPP
                await self._scrape()

    async def _receive(self, index: int, socket: zmq.asyncio.Socket) -> None:
        try:
            while True:
                _topic, seq, payload = await socket.recv_multipart()
                self.events[index].apply(int.from_bytes(seq, "big"), payload)
        finally:
            socket.close(linger=0)

    async def choose(self, messages: list[dict]) -> int:
        replica = self.replicas[next(self._tokenizer)]
        reply = await self.http.post(f"{replica.base_url}/tokenize", json={"messages": messages})
        reply.raise_for_status()
        tokens = reply.json()["tokens"]
        block_size = self.replicas[0].block_size
        if self.precise:
            hashes = sha256_cbor_hashes(tokens, block_size, self.hash_seed, self.salt)
            matched = [index.match(hashes) for index in self.events]
        else:
            hashes = chain_hashes(tokens, block_size)
            matched = [index.match(hashes) for index in self.lru]
        chosen = pick(score_replicas(matched, len(hashes), self.loads, self.weights), self.rng)
        if not self.precise:
            self.lru[chosen].add(hashes)
        self.num_picks += 1
        self.num_matched_blocks += matched[chosen]
        self.num_prompt_blocks += len(hashes)
        return chosen

    def stats(self) -> dict[str, object]:
        """What the picker believed: the fraction of prompt blocks its picks matched, and (precise)
        the event batches received and missed per replica."""
        believed = self.num_matched_blocks / self.num_prompt_blocks if self.num_prompt_blocks else 0.0
        out: dict[str, object] = {"picks": self.num_picks, "matched_block_fraction": believed}
        if self.precise:
            out["event_batches"] = [index.num_batches for index in self.events]
            out["event_batches_missed"] = [index.num_missed for index in self.events]
        return out


def make_router(
    mode: str, http: httpx.AsyncClient, replicas: list[Replica], args
) -> RoundRobin | PrefixAware:
    if mode in ("round_robin", "single"):
        return RoundRobin(len(replicas))
    return PrefixAware(http, replicas, args, precise=mode == "precise")
