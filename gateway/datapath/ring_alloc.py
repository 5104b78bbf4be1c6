"""Allocation of ring extents to batches (first fit over a sorted free list), and each engine's ring
with what its stores may hold of it."""

from __future__ import annotations

import bisect

from adpkv_core.memory.ring import RING_ALIGN

# the part of an engine's ring its stores' batches may hold at once (a batch is at most half the
# ring, so one always fits): the rest is kept for restores, which a returning prompt waits for
# while a store can wait for the ring without anyone waiting for it
STORE_SHARE = 0.75


class RingAllocator:
    """Hands out aligned, contiguous extents of the ring; ``free`` coalesces."""

    def __init__(self, size: int, align: int = RING_ALIGN):
        self.size = size - size % align
        self.align = align
        self._starts = [0]        # sorted starts of free extents
        self._lens = [self.size]
        self.in_use = 0

    def largest_free(self) -> int:
        return max(self._lens, default=0)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free extent of ``nbytes`` (rounded up to the alignment), or None."""
        nbytes = -(-nbytes // self.align) * self.align
        for i, length in enumerate(self._lens):
            if length >= nbytes:
                start = self._starts[i]
                if length == nbytes:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += nbytes
                    self._lens[i] -= nbytes
                self.in_use += nbytes
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        nbytes = -(-nbytes // self.align) * self.align
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + nbytes) or \
                (i > 0 and self._starts[i - 1] + self._lens[i - 1] > offset):
            raise ValueError(f"double free of ring extent [{offset}, {offset + nbytes})")
        self._starts.insert(i, offset)
        self._lens.insert(i, nbytes)
        self.in_use -= nbytes
        if i + 1 < len(self._starts) and offset + nbytes == self._starts[i + 1]:
            self._lens[i] += self._lens.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == offset:
            self._lens[i - 1] += self._lens.pop(i)
            self._starts.pop(i)


class EngineRing:
    """The ring of one attached engine and the allocator of its extents.

    A fresh sealed memfd per engine (``Ring.create``): no session of another engine ever
    maps memory that carried this engine's data, and this engine's sessions never map a
    ring that carried another's. ``retired`` once the engine detached: no batch is started
    on it any more; ``batches`` counts the batches that still hold extents of it, and the
    gateway unmaps it when the last one retires (``Transfers``). The memfd itself goes with
    the last mapping of it (a client's, or an I/O process's that has not seen a later ring).
    ``number``: this ring's place in the gateway's sequence of rings (I/O processes map
    rings by it). ``store_bytes``: what the PUT batches hold of it; they may hold at most
    ``STORE_SHARE`` of it (``store_room``), the rest is kept for restores (``Transfers``)."""

    __slots__ = ("ring", "alloc", "number", "retired", "batches", "store_bytes")

    def __init__(self, ring, number: int):
        self.ring = ring
        self.alloc = RingAllocator(ring.size)
        self.number = number
        self.retired = False
        self.batches = 0
        self.store_bytes = 0

    def store_room(self) -> int:
        """Bytes a further PUT batch may take: the largest free extent, within the stores' share."""
        return min(self.alloc.largest_free(), int(self.alloc.size * STORE_SHARE) - self.store_bytes)
