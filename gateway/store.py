"""The object store: objects → fragments → (card, database), pins and I/O counters.

The server asks it for the fragments of an object and runs their I/O on its
thread pool; the store does the card calls and keeps the statistics.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Optional, Sequence

from adpkv_core.fragments import fragment_db, fragment_extents, fragment_key

from .cards.base import Card
from .placement import Placement, key_layout_fingerprint

logger = logging.getLogger("adpkv.gateway.store")


@dataclasses.dataclass(frozen=True)
class Fragment:
    card: int
    db: int
    fkey: bytes
    offset: int     # within the object
    length: int


class CardStats:
    """I/O counters of one card (updated from the I/O threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reads = self.writes = self.read_errors = self.write_errors = 0
        self.bytes_read = self.bytes_written = 0
        self.io_seconds = 0.0
        self.io_count = 0
        self.io_max_s = 0.0

    def record(self, write: bool, ok: bool, nbytes: int, seconds: float) -> None:
        with self.lock:
            if write:
                self.writes += 1
                self.bytes_written += nbytes if ok else 0
                self.write_errors += 0 if ok else 1
            else:
                self.reads += 1
                self.bytes_read += nbytes if ok else 0
                self.read_errors += 0 if ok else 1
            self.io_seconds += seconds
            self.io_count += 1
            self.io_max_s = max(self.io_max_s, seconds)


class ObjectStore:
    """All cards of one gateway, seen as one key-value store of objects."""

    def __init__(self, cards: Sequence[Card], storage_slots: int, num_dbs: int, placement: str,
                 fragment_size: int, spread: bool):
        self.cards = list(cards)
        self.num_dbs = num_dbs
        self.fragment_size = fragment_size
        self.spread = spread
        self.placement = Placement([c.serial for c in self.cards], storage_slots, placement)
        self.fingerprint = key_layout_fingerprint([c.serial for c in self.cards], storage_slots,
                                                  num_dbs, placement, fragment_size)
        self.stats = [CardStats() for _ in self.cards]
        self._pins: collections.Counter = collections.Counter()
        self._pins_lock = threading.Lock()
        self.counters = collections.Counter()   # hits, misses, stored, store_failed (server thread only)

    # ------------------------------------------------------------------ layout
    def fragments(self, key: bytes, mark: int, object_bytes: int) -> list[Fragment]:
        """The fragments of an object, fragment 0 last (it is written last)."""
        card = self.placement.card(key, mark)
        extents = fragment_extents(object_bytes, self.fragment_size)
        frags = [Fragment(card, fragment_db(key, i, self.num_dbs, self.spread), fragment_key(key, i), off, ln)
                 for i, (off, ln) in enumerate(extents)]
        return frags[1:] + frags[:1]

    def head(self, key: bytes, mark: int) -> Fragment:
        """Fragment 0: its presence means the object was written in full."""
        card = self.placement.card(key, mark)
        return Fragment(card, fragment_db(key, 0, self.num_dbs, self.spread), fragment_key(key, 0), 0, 0)

    # ------------------------------------------------------------------ I/O (thread pool)
    def read(self, frag: Fragment, buf: memoryview) -> bool:
        t0 = time.monotonic()
        try:
            ok = self.cards[frag.card].read(frag.db, frag.fkey, buf)
        except Exception:
            logger.exception("read from card %s failed", self.cards[frag.card].serial)
            ok = False
        self.stats[frag.card].record(False, ok, len(buf), time.monotonic() - t0)
        return ok

    def write_object(self, frags: Sequence[Fragment], obj: memoryview) -> bool:
        """Write all fragments of one object, fragment 0 last."""
        for frag in frags:
            t0 = time.monotonic()
            try:
                ok = self.cards[frag.card].write(frag.db, frag.fkey, obj[frag.offset:frag.offset + frag.length])
            except Exception:
                logger.exception("write to card %s failed", self.cards[frag.card].serial)
                ok = False
            self.stats[frag.card].record(True, ok, frag.length, time.monotonic() - t0)
            if not ok:
                return False
        return True

    # ------------------------------------------------------------------ metadata
    def exists(self, keys: Sequence[bytes], marks: Optional[Sequence[int]]) -> list[bool]:
        out = []
        for i, key in enumerate(keys):
            h = self.head(key, marks[i] if marks else 0)
            out.append(self.cards[h.card].contains(h.db, h.fkey))
        return out

    def delete(self, keys: Sequence[bytes], marks: Optional[Sequence[int]]) -> int:
        deleted = 0
        for i, key in enumerate(keys):
            card = self.cards[self.placement.card(key, marks[i] if marks else 0)]
            index = 0
            found = False
            while True:
                db = fragment_db(key, index, self.num_dbs, self.spread)
                if not card.delete(db, fragment_key(key, index)):
                    break
                found = True
                index += 1
            deleted += found
        return deleted

    def clean(self) -> int:
        return sum(card.clean() for card in self.cards)

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Sequence[bytes]) -> None:
        with self._pins_lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._pins_lock:
            for key in keys:
                n = self._pins.get(key, 0)
                if n <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] = n - 1

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pinned_count(self) -> int:
        return len(self._pins)
