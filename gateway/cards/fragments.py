"""Fragments: objects larger than ``fragment_size`` are stored as several keys.

The fragments of one object are spread over the card's databases so they can be
read in parallel. Fragment 0 is written last, so its presence means the whole
object was written; a missing or corrupt fragment makes the object a miss.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np
import xxhash

# The fragment-key format, spelled here only: an object's key, then its fragment's index in
# 2 bytes, big-endian; fragment 0 (the head, written last) ends in b"\0\0".
_FRAG = struct.Struct(">H")
INDEX_BYTES = _FRAG.size
MAX_FRAGMENTS = 65535


def fragment_extents(object_bytes: int, fragment_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each fragment; one extent when fragment_size is 0."""
    if object_bytes <= 0:
        raise ValueError("object size must be positive")
    if fragment_size <= 0 or object_bytes <= fragment_size:
        return [(0, object_bytes)]
    count = -(-object_bytes // fragment_size)
    if count > MAX_FRAGMENTS:
        raise ValueError(f"{object_bytes} bytes in {fragment_size}-byte fragments exceeds {MAX_FRAGMENTS} fragments")
    return [(i * fragment_size, min(fragment_size, object_bytes - i * fragment_size)) for i in range(count)]


def fragment_key(key: bytes, index: int) -> bytes:
    """The storage key of fragment ``index`` of an object."""
    return key + _FRAG.pack(index)


def object_key(fkey: bytes) -> bytes:
    """The key of the object a fragment key belongs to."""
    return fkey[:-INDEX_BYTES]


def fragment_index(fkey: bytes) -> int:
    """The index of the fragment a fragment key names."""
    return _FRAG.unpack_from(fkey, len(fkey) - INDEX_BYTES)[0]


def is_head(fkey: bytes) -> bool:
    """Whether a fragment key names its object's head (fragment 0)."""
    return fkey[-INDEX_BYTES:] == b"\0\0"


# db_hash(key) -> int: the hash of an object's key that places its fragments: fragment ``i`` is
# in database ``(db_hash + i) % num_dbs`` when spread, else all in ``db_hash % num_dbs``.
# xxh3-64 itself (a C function: a GET batch hashes every key on the gateway's loop).
db_hash = xxhash.xxh3_64_intdigest


def fragment_db(key: bytes, index: int, num_dbs: int, spread: bool = True) -> int:
    """The database of a fragment: spread over all databases, or the object's own."""
    if num_dbs <= 1:
        return 0
    h = db_hash(key)
    return (h + index) % num_dbs if spread else h % num_dbs


def head_dbs(keys: Sequence[bytes], num_dbs: int) -> np.ndarray:
    """``fragment_db(key, 0, num_dbs)`` of every key of a batch (``int64``): the database of
    each object's head, spread or not (fragment 0 is in ``db_hash % num_dbs`` either way)."""
    if num_dbs <= 1:
        return np.zeros(len(keys), np.int64)
    return (np.fromiter(map(db_hash, keys), np.uint64, len(keys)) % np.uint64(num_dbs)).astype(np.int64)


def fragment_dbs(key: bytes, count: int, num_dbs: int, spread: bool = True) -> list[int]:
    """``fragment_db`` of fragments ``0 .. count-1`` of one object, its key hashed once."""
    if num_dbs <= 1:
        return [0] * count
    h = db_hash(key)
    return [(h + i) % num_dbs for i in range(count)] if spread else [h % num_dbs] * count
