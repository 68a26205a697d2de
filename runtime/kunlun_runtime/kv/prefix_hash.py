"""Prefix hashes of full KV blocks, by the algorithm ``--prefix-caching-hash-algo`` names.

- ``keyed_blake2b`` (the default, ours): BLAKE2b-64 of (parent hash, salt, token ids) under a key
  random per process. Nobody outside the process can predict or recompute it, so KV events that
  carry it are consistent within one run but cannot be matched to a prompt by an outside indexer
  that recomputes hashes (one that maps the events' hashes to its own from their token ids can).
- ``sha256`` and ``sha256_cbor``: vLLM's. SHA-256 of the pickle (protocol 5) or the canonical
  CBOR of ``(parent digest, token ids, extra keys)``; the first block's parent is vLLM's
  ``NONE_HASH``, the algorithm's own hash of ``$PYTHONHASHSEED`` (random when it is unset), and the
  extra keys are the LoRA adapter's name on every block of a request on one, then the salt on
  the first block of a salted request (None when there are neither). With the seed known, an
  indexer recomputes every hash from tokens (CBOR needs no Python).

A request on a LoRA adapter hashes its adapter into every block: KV computed with one adapter is
never served to another, nor to the base model. ``keyed_blake2b`` hashes the adapter's id and
name, so an adapter loaded again under its name (a new id: new weights) never finds the old
one's blocks; vLLM's algorithms hash the name only, as vLLM does (reset the prefix cache when
reloading changed weights under one name).

The salt is the request's cache salt; the server makes it the tenant's namespace narrowed by the
client's ``cache_salt`` (server/auth.py), so two tenants' identical prompts never share a hash.
A hash is an int, the whole digest big-endian (64 bits, or 256 for SHA-256), so the prefix cache
keys on all of it; KV events carry ``external_block_hash``, its low 64 bits, as vLLM's int hashes.
Pure: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

from kunlun_runtime.config import PrefixCachingHashAlgoName

logger = logging.getLogger(__name__)

BlockHash = int
ROOT_HASH = 0  # keyed_blake2b: the parent of a first block
SHA256_BYTES = 32
_MASK_64 = (1 << 64) - 1


def sha256_pickle(value: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the value pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the value's canonical CBOR (reproducible in any language)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_SHA256_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}


def external_block_hash(block_hash: BlockHash) -> int:
    """What a KV event names a block by: the hash's low 64 bits (vLLM's int block hashes, the
    default of its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), an unsigned 64-bit integer."""
    return block_hash & _MASK_64


@dataclass(frozen=True, slots=True)
class PrefixHasher:
    """One algorithm and its secret: the key (keyed_blake2b) or the root digest (the SHA-256 ones)."""

    algo: PrefixCachingHashAlgoName
    secret: bytes

    @classmethod
    def create(cls, algo: PrefixCachingHashAlgoName, seed: str | None = None) -> PrefixHasher:
        """The hasher of ``algo``. ``seed`` is ``$PYTHONHASHSEED`` for the SHA-256 algorithms (None:
        a random root, as vLLM, and a warning: no indexer can then recompute the hashes)."""
        if algo == "keyed_blake2b":
            return cls(algo, secrets.token_bytes(32))
        function = _SHA256_FUNCTIONS.get(algo)
        if function is None:
            raise ValueError(f"unknown prefix caching hash algorithm {algo!r}")
        if seed is None:
            logger.warning(
                "prefix caching hash %s without PYTHONHASHSEED: the first block's parent is random, "
                "so no indexer can recompute the block hashes from tokens; set PYTHONHASHSEED",
                algo,
            )
            return cls(algo, os.urandom(SHA256_BYTES))
        return cls(algo, function(seed))

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        salt: str | None,
        lora: tuple[int, str] | None = None,
    ) -> BlockHash:
        """The hash of one full block after ``parent`` (None for a request's first block), of a
        request on the LoRA adapter ``lora`` ((id, name); None: the base model)."""
        if self.algo == "keyed_blake2b":
            digest = hashlib.blake2b(key=self.secret, digest_size=8)
            digest.update((ROOT_HASH if parent is None else parent).to_bytes(8, "little"))
            digest.update((salt or "").encode())
            digest.update(b"\x00")
            if lora is not None:  # after the salt's terminator: no salt can spell an adapter
                digest.update(b"\x01" + lora[0].to_bytes(8, "little") + lora[1].encode() + b"\x00")
            digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
            return int.from_bytes(digest.digest(), "little")
        parent_digest = self.secret if parent is None else parent.to_bytes(SHA256_BYTES, "big")
        # vLLM's extra keys: the adapter's name on every block, then the salt on the first.
        keys = ((lora[1],) if lora is not None else ()) + ((salt,) if parent is None and salt else ())
        extra_keys = keys or None
        payload = (parent_digest, tuple(token_ids), extra_keys)
        return int.from_bytes(_SHA256_FUNCTIONS[self.algo](payload), "big")

    def hash_full_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        salt: str | None = None,
        start_hashes: Sequence[BlockHash] = (),
        *,
        lora: tuple[int, str] | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``; ``start_hashes`` are reused for a known prefix."""
        hashes = list(start_hashes)
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), len(token_ids) // block_size):
            block = token_ids[index * block_size : (index + 1) * block_size]
            parent = self.hash_block(parent, block, salt, lora)
            hashes.append(parent)
        return hashes


DEFAULT_HASHER = PrefixHasher.create("keyed_blake2b")  # what a KV manager uses unless told otherwise
