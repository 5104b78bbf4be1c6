"""All or nothing per page group: write ids stamped on every object of a hybrid model.

A *page group* is what one SGLang backup operation stores for a prefix: its KV pages
(``batch_set_v1``) and the pages of the auxiliary pools that belong to them
(``batch_set_v2``): a Mamba state at the last page, an SWA window ending there, DSA
indexer and draft pages beside every KV page. SGLang writes and reads them in separate
calls, so two writers of the same prefix (two servers, or one server and its restart)
could interleave: a restore must never take a state from one write with KV from another.

The rule here:

- Every object of a hybrid deployment carries a 16-byte **stamp** after its page bytes:
  ``write_id:u64 | key_tag:u64`` (little endian). ``key_tag`` is a digest of the object's
  own key, so an object found under a key must have been written for that key.
- ``write_id`` names the write of a page group: ``blake2b(nonce, last page hash)``, with a
  per-instance random ``nonce``. Every ``batch_set_v2`` call of one backup operation ends
  at the same last page hash (SGLang splits one operation's sidecars into calls by tail
  length, each call's keys end at the operation's last page), so all its sidecar objects
  get one write id without any state between calls.
- The KV pages a group closes (the last page for trailing pools, every page for pools
  beside the KV pages) are **bound** to that write id (``bind``); the following
  ``batch_set_v1`` stamps them with it and writes them even when stored already
  (a stored page carries another write's id).
- Reading: ``batch_get_v1`` records the write id of every KV page it loads (``loaded``);
  ``batch_get_v2`` accepts an auxiliary page only when its stamp names its key, and its
  write id equals that of the group's closing KV page where this instance loaded that page
  from L3 (a page the engine still holds was computed by the engine itself, not written by
  anyone), and, for a window, every page of the window carries the same write id. Anything
  else is reported as not loaded: the usable prefix shrinks, no mixed group is used.

Both tables are bounded (``TABLE_ENTRIES``, oldest dropped first): an entry dropped from
``bind`` makes a later group's KV page keep a fresh write id (its sidecars then miss, never
mix); one dropped from ``loaded`` leaves only the window check for that page.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

import numpy as np

STAMP_BYTES = 16
TABLE_ENTRIES = 1 << 16


def key_tag(key: bytes) -> int:
    """The 8-byte digest of a storage key that its object's stamp carries."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class Stamps:
    """The stamps of one request's objects: an (n, 2) uint64 array whose rows the ring copies
    read (PUT) or fill (GET) as the object's last segment."""

    __slots__ = ("array", "tags")

    def __init__(self, keys: Sequence[bytes], write_ids: Optional[Sequence[int]] = None):
        self.tags = np.fromiter((key_tag(k) for k in keys), dtype=np.uint64, count=len(keys))
        self.array = np.zeros((len(keys), 2), dtype=np.uint64)
        if write_ids is not None:
            self.array[:, 0] = np.asarray(write_ids, dtype=np.uint64)
            self.array[:, 1] = self.tags

    def subset(self, idx: Sequence[int]) -> "Stamps":
        out = Stamps.__new__(Stamps)
        out.tags = self.tags[list(idx)]
        out.array = np.ascontiguousarray(self.array[list(idx)])
        return out

    def addresses(self) -> np.ndarray:
        """(n, 1) host addresses of the rows, as a segment column for ``RingView``."""
        base = self.array.ctypes.data
        return (base + STAMP_BYTES * np.arange(len(self.array), dtype=np.int64))[:, None]

    def valid(self) -> np.ndarray:
        """Per object: its stamp names its own key and a write (after a GET)."""
        return (self.array[:, 1] == self.tags) & (self.array[:, 0] != 0)

    def write_ids(self) -> np.ndarray:
        return self.array[:, 0]


class WriteIds:
    """Write ids of this instance: the bound KV pages of groups being written, the KV pages
    loaded from L3 (see the module docstring). Thread-safe (backup and prefetch threads)."""

    def __init__(self):
        self._nonce = os.urandom(16)
        self._lock = threading.Lock()
        self._bound: OrderedDict[bytes, int] = OrderedDict()
        self._loaded: OrderedDict[bytes, int] = OrderedDict()

    def group_id(self, last_page_hash: str) -> int:
        """The write id of the group that ends at ``last_page_hash`` (never 0)."""
        d = hashlib.blake2b(last_page_hash.encode("utf-8"), digest_size=8, key=self._nonce).digest()
        return int.from_bytes(d, "little") or 1

    def fresh_id(self) -> int:
        return int.from_bytes(os.urandom(8), "little") or 1

    @staticmethod
    def _put(table: OrderedDict, items: Iterable[tuple[bytes, int]]) -> None:
        for k, w in items:
            table[k] = int(w)
            table.move_to_end(k)
        while len(table) > TABLE_ENTRIES:
            table.popitem(last=False)

    def bind(self, kv_keys: Iterable[bytes], write_id: int) -> None:
        with self._lock:
            self._put(self._bound, ((k, write_id) for k in kv_keys))

    def take_bound(self, kv_keys: Sequence[bytes]) -> list[Optional[int]]:
        """The bound write id of each KV key (None: not bound), unbinding them."""
        with self._lock:
            return [self._bound.pop(k, None) for k in kv_keys]

    def note_loaded(self, kv_keys: Sequence[bytes], write_ids: Sequence[int], hits: Sequence[bool]) -> None:
        with self._lock:
            self._put(self._loaded, ((k, w) for k, w, h in zip(kv_keys, write_ids, hits) if h))

    def loaded(self, kv_keys: Sequence[bytes]) -> list[Optional[int]]:
        with self._lock:
            return [self._loaded.get(k) for k in kv_keys]
