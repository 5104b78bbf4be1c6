"""Region copies of GET and PUT batches: bytes between the cards or the ring and a client's
region, on the region's descriptor (``door.Region``: the client's file, passed at the door).

Contract (every function runs on the I/O pool, takes a batch's items and returns a
``store.Outcome`` per item, ``j`` the object's index in its batch, as ``Transfers._io_done``
expects; a PUT's sources, ``RingSource`` and ``RegionSource``, are read by ``ObjectStore.put``
there):

- The gateway never maps a region: ``pwritev``/``preadv`` on its descriptor only, so a
  region the client shrank or closed fails a call, it cannot fault the gateway.
- Nothing is written into a region once the client gave up on the request (``write_by``
  passed: its engine may reuse the buffer), nor past the region's size now (a write would
  grow the client's file); ``door.Region.size_now`` is that check, made again before every
  write, and those checks and the writes of a task happen under a lock the client waits for
  before it takes its buffer back (``adpkv_core.memory.region_lock.holding``).
- Nothing read from a region is stored once the client gave up on a PUT (``read_by``), nor
  from a region shorter than the object.

A scattered request's copies (an object as pieces of several regions) are ``scatter.py``'s.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from adpkv_core.memory.region_lock import holding

from adpkv_gateway.door.regions import Region
from adpkv_gateway.store.card_io import Outcome, PutSource, ReadToFd, RegionBytes
from adpkv_gateway.store.object_store import ObjectStore


def direct_reads(store: ObjectStore, region: Region, items: list, write_by: Optional[float]) -> list[Outcome]:
    """Read ``(j, fragment, file offset)`` items from their cards straight into a client's
    region (runs on the pool), each only while the client still waits for it (checked again
    before every write into the region) and only where the region is still as large as
    registered. A fragment that misses on its card is read from the object's next replica
    whose card reads into regions (one without ``direct_reads`` is passed over: the
    fragment misses on this path)."""
    out = []
    with holding(_span(region, [(place, frag.length) for _, frag, place in items]), write_by) as may_write:
        for j, frag, place in items:
            ok = False
            for replica in store.io.direct_replicas(frag) if may_write else ():
                size_now = region.size_now(write_by)
                if size_now is None or place + frag.length > size_now:
                    break
                ok = store.io.read_to_fds([ReadToFd(j, replica, region.fd, place)], write_by)[0].ok
                if ok:
                    break
            out.append(Outcome(j, ok))
    return out


def to_region(region: Region, items: list, write_by: Optional[float]) -> list[Outcome]:
    """Copy ``(j, ring view, file offset)`` items from the ring into a client's region with
    ``pwritev`` on its descriptor (runs on the pool). The gateway never maps a region: a
    region the client shrank fails these calls, it cannot fault the gateway. A region
    shorter now than registered takes nothing (a write would grow the client's file), and
    nothing is written once the client gave up on the request (``write_by``)."""
    out = []
    with holding(_span(region, [(place, len(view)) for _, view, place in items]), write_by) as may_write:
        for j, view, place in items:
            size_now = region.size_now(write_by) if may_write else None
            ok = False
            if size_now is not None and place + len(view) <= size_now:
                try:
                    ok = os.pwritev(region.fd, [view], place) == len(view)
                except OSError:
                    pass
            out.append(Outcome(j, ok))
    return out


def _span(region: Region, places: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The byte span of a task's writes (file offset, length) in ``region``, as ``holding`` takes it."""
    if not places:
        return []
    return [(region.fd, min(p for p, _ in places), max(p + n for p, n in places))]


class RingSource(PutSource):
    """A PUT's object in the ring (its ranks filled it)."""

    def __init__(self, view: memoryview):
        self._view = view

    def region(self) -> Optional[RegionBytes]:
        return None

    def view(self) -> Optional[memoryview]:
        return self._view


class RegionSource(PutSource):
    """A PUT's object in a client's region at file offset ``place``; ``slot`` its ring slot,
    for cards that cannot read the region themselves."""

    def __init__(self, region: Region, place: int, slot: memoryview, read_by: Optional[float]):
        self._region, self._place, self._slot, self._read_by = region, place, slot, read_by

    def region(self) -> Optional[RegionBytes]:
        return RegionBytes(self._region.fd, self._place, self._read_by)

    def view(self) -> Optional[memoryview]:
        """``preadv`` into the ring slot: nothing when the region is shorter than the object,
        nor when the read ended at or after ``read_by`` (the client had given up: its engine
        may have put other bytes there)."""
        view = self._slot
        try:
            ok = os.preadv(self._region.fd, [view], self._place) == len(view)
        except OSError:
            ok = False
        return view if ok and (self._read_by is None or time.monotonic() < self._read_by) else None
