"""Scattered region requests: each object of a GET/PUT is a few pieces of a client's regions.

A client names, for every object, ``len(pieces)`` offsets (``protocol.Piece``: the region
and length of piece k, the same for every object of the request), e.g. the K and V halves
of a page of an SGLang host pool in shared memory and its stamp in a small region of the
backend's own. ``Scatter`` is such a request's regions and the file offset of every piece
(each checked inside its region by ``door.Region.places``).

GET: an object is read whole into the ring first (``CardIO.read_many``: header and checksum
checked there), then its pieces are written into the regions (``Scatter.scatter``), so no
piece lands before the whole object is known good. PUT: the pieces are read into the ring
slot (``Scatter.gather``) and the object is stored from there. The gateway never maps a
region: ``pread``/``pwrite`` on the client's descriptors, each piece's region checked for
its size and the client's give-up moment (``write_by``) before each write.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from adpkv_core.memory.region_lock import holding

from adpkv_gateway.door.regions import Region
from adpkv_gateway.store.card_io import Outcome, PutSource, RegionBytes


class Scatter:
    """The regions of a scattered region request: piece k of every object is ``lengths[k]``
    bytes in ``regions[k]`` (``door.Region``)."""

    __slots__ = ("regions", "lengths")

    def __init__(self, regions: list[Region], lengths: list[int]):
        self.regions = regions
        self.lengths = lengths

    def places(self, at: list, count: int) -> list[tuple[int, ...]]:
        """The file offset of every piece of each of ``count`` objects (``at``: piece k of
        object i at ``at[i * len(pieces) + k]``); BAD_REGION when a piece lies outside its
        region."""
        k = len(self.regions)
        columns = [region.places(at[p::k], length)
                   for p, (region, length) in enumerate(zip(self.regions, self.lengths))]
        return list(zip(*columns)) if columns else [()] * count

    def gather(self, view: memoryview, place: tuple[int, ...]) -> bool:
        """Read one object's pieces into ``view``; False when a region gave less."""
        pos = 0
        for region, length, off in zip(self.regions, self.lengths, place):
            if os.preadv(region.fd, [view[pos:pos + length]], off) != length:
                return False
            pos += length
        return True

    def scatter(self, view: memoryview, place: tuple[int, ...], write_by: Optional[float]) -> bool:
        """Write one (checked) object from ``view`` into its pieces; False, writing nothing
        more, once the client gave up (``write_by``), a region is shorter now than the piece
        needs (a write would grow the client's file) or a write comes back short."""
        pos = 0
        for region, length, off in zip(self.regions, self.lengths, place):
            size_now = region.size_now(write_by)
            if size_now is None or off + length > size_now:
                return False
            try:
                if os.pwritev(region.fd, [view[pos:pos + length]], off) != length:
                    return False
            except OSError:
                return False
            pos += length
        return True


def to_scatter(scatter: Scatter, items: list, write_by: Optional[float]) -> list[Outcome]:
    """Copy ``(j, ring view, places)`` items (checked objects in the ring) into their pieces
    (runs on the gateway's I/O pool); an ``Outcome`` each. The task's writes happen under a
    shared lock on each piece's span (``region_lock.holding``: none once the client took its
    buffers back)."""
    spans = []
    for k, (region, length) in enumerate(zip(scatter.regions, scatter.lengths)):
        offs = [place[k] for _, _, place in items]
        if offs:
            spans.append((region.fd, min(offs), max(offs) + length))
    with holding(spans, write_by) as may_write:
        return [Outcome(j, may_write and scatter.scatter(view, place, write_by)) for j, view, place in items]


class ScatterSource(PutSource):
    """A PUT's object as pieces of a client's regions (``places``: each piece's file offset),
    gathered into its ring slot ``slot`` and stored from there (no card reads pieces itself)."""

    def __init__(self, scatter: Scatter, places: tuple[int, ...], slot: memoryview, read_by: Optional[float]):
        self._scatter, self._places, self._slot, self._read_by = scatter, places, slot, read_by

    def region(self) -> Optional[RegionBytes]:
        return None

    def view(self) -> Optional[memoryview]:
        """``Scatter.gather`` into the ring slot: nothing when a region gave less than its
        piece, nor when the read ended at or after ``read_by`` (the client had given up)."""
        try:
            ok = self._scatter.gather(self._slot, self._places)
        except OSError:
            ok = False
        return self._slot if ok and (self._read_by is None or time.monotonic() < self._read_by) else None
