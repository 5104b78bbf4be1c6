"""The rows of the fs card's index (``fs_index``): how one object's row is stored, and the
hash that places its key in the index's table.

Contract:

- ``Rows``: the object table as numpy columns (the 28-byte key, bytes on disk, the size its
  head records, the head's payload length, fragment count, databases, write generation, the
  head's write id, last use, namespace: ``Rows.BYTES``, 72 bytes an object), each in its own
  anonymous mapping (``mapped``). Rows ``0 .. n-1`` are objects, dense: a removed row is
  replaced by the last one (``move``). ``COLUMNS`` names them in the order a snapshot
  (``fs_snapshot``) records them; nothing here locks: the index's lock covers every use.
- ``key_hash`` / ``key_hashes``: the 64-bit hash of an object key under a per-process seed
  (one key, or many at once: the same values); ``HASH_NAME`` names it, so that a snapshot
  whose rows were placed by another hash is not taken.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from adpkv_core.keys import KEY_BYTES

HASH_NAME = "xor-multiply-4w+fmix64"   # ``key_hash``: a snapshot's rows were hashed with it


_M = (1 << 64) - 1
_LIBC = ctypes.CDLL(None)
_C1, _C2, _C3 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


def key_hash(okey: bytes, seed: int) -> int:
    """The 64-bit hash of a 28-byte object key that places it in the hash table: its four
    little-endian words (the last zero-padded) folded into the per-process ``seed`` by
    xor-multiply, then murmur3's finaliser (keys chosen to collide cannot be made without the
    seed). ``key_hashes`` is the same over many keys at once."""
    h = seed
    for at in (0, 8, 16, 24):
        h = ((h ^ int.from_bytes(okey[at:at + 8], "little")) * _C1) & _M
    h ^= h >> 33
    h = (h * _C2) & _M
    h ^= h >> 33
    h = (h * _C3) & _M
    return h ^ (h >> 33)


def key_hashes(okeys: np.ndarray, seed: int) -> np.ndarray:
    """``key_hash`` of each row of ``okeys`` (``uint8``, shape (n, 28)), as ``uint64``."""
    n = len(okeys)
    words = np.zeros((n, 4), np.uint64)
    words.view(np.uint8).reshape(n, 32)[:, :KEY_BYTES] = okeys
    h = np.full(n, seed, np.uint64)
    with np.errstate(over="ignore"):
        for w in range(4):
            h = (h ^ words[:, w]) * np.uint64(_C1)
        h ^= h >> np.uint64(33)
        h *= np.uint64(_C2)
        h ^= h >> np.uint64(33)
        h *= np.uint64(_C3)
        h ^= h >> np.uint64(33)
    return h


def mapped(shape: tuple, dtype) -> np.ndarray:
    """An array in its own anonymous mapping: its pages take memory only once written, and
    all of it goes back to the system when the array goes (a heap allocation freed after a
    table grew would stay in the process's heap)."""
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype, int(np.prod(shape))).reshape(shape)


def give_back_heap() -> None:
    """Hand the heap freed since back to the system (glibc's ``malloc_trim``; nothing where
    there is none). The table's own columns are ``mapped`` and go back whole, but what building
    it frees on the heap (the temporaries of a rehash, the scan's listings) the allocator keeps
    for good: ~15 bytes an object after a fill of 1M objects, ~40 after a scan of 4M."""
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:
        pass


def bytes_of(column: np.ndarray) -> memoryview:
    """The bytes of a contiguous piece of a column (a view: no copy)."""
    return column.reshape(-1).view(np.uint8).data


class Rows:
    """The columns of the object table; rows ``0 .. n-1`` are objects (dense: a removed row
    is replaced by the last one)."""

    COLUMNS = (("key", np.uint8, (KEY_BYTES,)), ("disk", np.uint64, ()), ("total", np.uint64, ()),
               ("flen", np.uint32, ()), ("nfrag", np.uint16, ()), ("db0", np.uint16, ()),
               ("dbmod", np.uint16, ()), ("gen", np.uint32, ()), ("wid", np.uint64, ()),
               ("tick", np.uint32, ()), ("ns", np.uint16, ()))
    BYTES = sum(np.dtype(t).itemsize * (s[0] if s else 1) for _, t, s in COLUMNS)
    key: np.ndarray
    disk: np.ndarray
    total: np.ndarray
    flen: np.ndarray
    nfrag: np.ndarray
    db0: np.ndarray
    dbmod: np.ndarray
    gen: np.ndarray
    wid: np.ndarray
    tick: np.ndarray
    ns: np.ndarray

    def __init__(self, capacity: int = 1024):
        self.n = 0
        self.capacity = capacity
        for name, dtype, shape in self.COLUMNS:
            setattr(self, name, mapped((capacity,) + shape, dtype))

    def grow(self) -> None:
        self.capacity *= 2
        for name, dtype, shape in self.COLUMNS:
            old = getattr(self, name)
            new = mapped((self.capacity,) + shape, dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)

    def move(self, src: int, dst: int) -> None:
        for name, _, _ in self.COLUMNS:
            col = getattr(self, name)
            col[dst] = col[src]
