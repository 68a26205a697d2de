"""Prefix hashes of full KV blocks: hash(parent hash, token ids, salt) under a secret key.

The key is random per process, so hashes cannot be predicted from outside; a per-request salt
(e.g. the tenant) additionally keeps one tenant's cached prefix out of another's reach, so a
timing probe cannot tell whether someone else sent the same prompt.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

_KEY = secrets.token_bytes(32)
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: str | None = None) -> int:
    """64-bit keyed hash of one full block given its parent's hash."""
    digest = hashlib.blake2b(key=_KEY, digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little"))
    digest.update((salt or "").encode())
    digest.update(b"\x00")
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return int.from_bytes(digest.digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, start_hashes: Sequence[int] = ()
) -> list[int]:
    """Hashes of every full block of ``token_ids``; ``start_hashes`` are reused for a known prefix."""
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else ROOT_HASH
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
