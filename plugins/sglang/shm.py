"""Host pools in shared memory: the gateway reads and writes their pages in place.

With ``"allocator": "shm"`` in the extra config SGLang allocates its host pools with
``ShmHostTensorAllocator``: every buffer of a pool is a memfd mapped shared (the
allocator keeps the descriptors, ``allocator.fds``, and mappings, ``allocator.mms``).
The backend hands each such buffer to the gateway as a *region* (``register_region``
over ``/proc/self/fd/N``: this process reopens its own memfd read-write) and moves the
pages of the pool with region GET/PUT: the gateway copies between the card and the
pool's memory, the engine copies nothing (no ring).

One stored object is the same bytes as on the ring path (``pools``: the page's segments
in flat-page order, then the 16-byte stamp of a hybrid model), so either path reads what
the other wrote. Every request is a scattered one: an object is one or a few *pieces*
(``protocol.Piece``: an MLA page is one, an MHA page its K and V halves, a ``layer_first``
page one per layer, a Mamba state one per buffer; the stamp lives in a small memfd of the
backend's own, ``StampArena``). The gateway reads each object whole and checks it before
any piece lands (``gateway/datapath/scatter.py``), so a damaged or missing object never touches its
pool page (a plain region GET, ``get_into``, lets a corrupt page-cache-hot object's bytes
land before its checksum is known).

Pools whose pages have no segment description (``pools.FlatPages``), pools not in shared
memory, and sessions where the gateway refused a region move pages through the ring (the
reason logged once per pool).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from adpkv_core.attachment import Session

from .groups import STAMP_BYTES, Stamps

logger = logging.getLogger("adpkv.sglang")

STAMP_SLOTS = 16                 # requests with stamps in flight at once (one slot each)
STAMP_SLOT_ROWS = 4096           # pages of one request's stamps (more: that request uses the ring)


@dataclass(frozen=True)
class ShmBuffer:
    """One shared-memory buffer of a host pool: its memfd, the address it is mapped at, its size."""

    fd: int
    base: int
    size: int


def _mapped_address(mm) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)


def shm_buffers(pool) -> Optional[list[ShmBuffer]]:
    """The shared-memory buffers of a host pool built with SGLang's shm allocator; None when
    the pool's memory is not (all) shared memory."""
    alloc = getattr(pool, "allocator", None)
    fds, mms = getattr(alloc, "fds", None), getattr(alloc, "mms", None)
    if not fds or not mms or len(fds) != len(mms):
        return None
    out = []
    for fd, mm in zip(fds, mms):
        if fd is None or mm is None:
            return None
        out.append(ShmBuffer(int(fd), _mapped_address(mm), len(mm)))
    return out


class StampArena:
    """The backend's own memfd region for the stamps of hybrid objects: ``STAMP_SLOTS`` slots
    of ``STAMP_SLOT_ROWS`` rows of 16 bytes; a request takes one slot for its life."""

    def __init__(self):
        self.size = STAMP_SLOTS * STAMP_SLOT_ROWS * STAMP_BYTES
        self.fd = os.memfd_create("adpkv_sglang_stamps", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self._mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED)
        self.rows = np.frombuffer(self._mm, dtype=np.uint64).reshape(-1, 2)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for k in range(STAMP_SLOTS):
            self._free.put(k)

    def take(self, n: int, timeout_s: float) -> Optional[int]:
        """A free slot for ``n`` stamps (its first row), or None (too many, or none free in time)."""
        if n > STAMP_SLOT_ROWS:
            return None
        try:
            return self._free.get(timeout=timeout_s) * STAMP_SLOT_ROWS
        except queue.Empty:
            return None

    def give(self, first_row: int) -> None:
        self._free.put(first_row // STAMP_SLOT_ROWS)

    def close(self) -> None:
        """Unmap and close (once no request can use it: the backend is closed)."""
        self.rows = None
        try:
            self._mm.close()
        except BufferError:       # a view still held somewhere: the mapping goes with it
            pass
        os.close(self.fd)


class RegionPages:
    """How the pages of one pool (with page segments, ``pages.PageGeometry``) are pieces of
    its shared-memory buffers: for each piece, the buffer and the offset/coefficient of its
    start in it (affine in the page's first token, as the segments), and its length.
    Adjacent segments of one buffer that stay adjacent on every page are one piece."""

    def __init__(self, geo, buffers: list[ShmBuffer]):
        self.buffers = buffers
        seg_buf = []
        for addr, coef, size in zip(geo.seg_addr0.tolist(), geo.seg_coef.tolist(), geo.seg_size.tolist()):
            last = addr + (geo.pages - 1) * geo.page_size * coef
            for b, buf in enumerate(buffers):
                if buf.base <= min(addr, last) and max(addr, last) + size <= buf.base + buf.size:
                    seg_buf.append(b)
                    break
            else:
                raise ValueError("a page segment lies outside the pool's shared-memory buffers")
        pieces: list[list[int]] = []        # [buffer, offset0, coef, length]
        for b, addr, coef, size in zip(seg_buf, geo.seg_addr0.tolist(), geo.seg_coef.tolist(),
                                       geo.seg_size.tolist()):
            off = addr - buffers[b].base
            if pieces and pieces[-1][0] == b and pieces[-1][2] == coef and pieces[-1][1] + pieces[-1][3] == off:
                pieces[-1][3] += size
            else:
                pieces.append([b, off, coef, size])
        self.piece_buffer = [p[0] for p in pieces]
        self.piece_off0 = np.array([p[1] for p in pieces], dtype=np.int64)
        self.piece_coef = np.array([p[2] for p in pieces], dtype=np.int64)
        self.piece_len = [p[3] for p in pieces]

    def offsets(self, starts: np.ndarray) -> np.ndarray:
        """(pages, pieces) offsets of each piece in its buffer."""
        return self.piece_off0[None, :] + starts[:, None].astype(np.int64) * self.piece_coef[None, :]


class Route:
    """One request's region placement: ``pieces`` (``(region id, length)``) and one offset a
    piece of every object; ``stamp_row``: the stamp arena slot it holds."""

    __slots__ = ("pieces", "at", "stamp_row")

    def __init__(self, pieces, at, stamp_row):
        self.pieces, self.at, self.stamp_row = pieces, at, stamp_row


class ShmRegions:
    """The backend's regions: every registered pool's buffers and the stamp arena, registered
    with each session (at attach, and lazily for pools registered later) and kept in the
    session's state; which pools move through regions."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pools: dict[int, RegionPages] = {}      # id(HostPool) -> its pieces
        self._arena: Optional[StampArena] = None
        self._told: set[str] = set()

    def _once(self, what: str, msg: str, *args) -> None:
        if what not in self._told:
            self._told.add(what)
            logger.info(msg, *args)

    def add_pool(self, hp) -> bool:
        """Whether ``hp``'s pages can move through regions (its memory is shared memory and its
        pages have segments); the reason logged once where not."""
        bufs = shm_buffers(hp.pool)
        if bufs is None:
            self._once(hp.name, "adpkv: host pool %s (%s) is not in shared memory (extra config "
                       "\"allocator\": \"shm\" puts it there): its pages move through the ring",
                       hp.name, type(hp.pool).__name__)
            return False
        geo = getattr(hp.io, "geo", None)
        if geo is None:
            self._once(hp.name, "adpkv: host pool %s has no page segments: its pages move through the ring "
                       "(flat data pages)", hp.name)
            return False
        try:
            rp = RegionPages(geo, bufs)
        except ValueError as exc:
            self._once(hp.name, "adpkv: host pool %s: %s; its pages move through the ring", hp.name, exc)
            return False
        with self._lock:
            self._pools[id(hp)] = rp
            if hp.stamped and self._arena is None:
                self._arena = StampArena()
        logger.info("adpkv: host pool %s is in shared memory: the gateway moves its pages in place "
                    "(%d piece(s) a page%s)", hp.name, len(rp.piece_len), " + stamp" if hp.stamped else "")
        return True

    def close(self) -> None:
        """The stamp arena goes (the backend is closed: its attachment, and so every region, went)."""
        with self._lock:
            arena, self._arena = self._arena, None
            self._pools.clear()
        if arena is not None:
            arena.close()

    def forget(self, hp) -> None:
        with self._lock:
            self._pools.pop(id(hp), None)

    def _ids(self, s: Session, key, fd: int, size: int) -> Optional[int]:
        """The session's region id of a buffer (registered on first use; None: refused)."""
        regions = s.state.setdefault("sgl_regions", {})
        if key in regions:
            return regions[key]
        with self._lock:
            if key in regions:
                return regions[key]
            rid = s.client.register_region(f"/proc/self/fd/{fd}", 0, size).result()
            regions[key] = rid
        if rid is None:
            self._once(f"refused:{key}", "adpkv: the gateway refused a host pool buffer as a region; "
                       "the pages of that buffer move through the ring")
        return rid

    def register_all(self, s: Session) -> None:
        """Register every known buffer with a new session (``Attachment``'s ``on_attach``)."""
        with self._lock:
            pools = list(self._pools.values())
            arena = self._arena
        for rp in pools:
            for buf in rp.buffers:
                self._ids(s, ("pool", buf.fd), buf.fd, buf.size)
        if arena is not None:
            self._ids(s, "stamps", arena.fd, arena.size)

    def route(self, s: Session, hp, starts: np.ndarray, stamps: Optional[Stamps]) -> Optional[Route]:
        """The region placement of ``hp``'s pages at ``starts`` (and their stamps), or None: the
        ring. A route with a stamp row must be ``release``d."""
        rp = self._pools.get(id(hp))
        if rp is None:
            return None
        ids = [self._ids(s, ("pool", buf.fd), buf.fd, buf.size) for buf in rp.buffers]
        if any(ids[b] is None for b in rp.piece_buffer):
            return None
        offs = rp.offsets(starts)
        pieces = [(ids[b], n) for b, n in zip(rp.piece_buffer, rp.piece_len)]
        row = None
        if stamps is not None:
            arena = self._arena
            if arena is None:
                return None
            sid = self._ids(s, "stamps", arena.fd, arena.size)
            if sid is None:
                return None
            row = arena.take(len(starts), timeout_s=1.0)
            if row is None:
                return None
            arena.rows[row:row + len(starts)] = stamps.array
            col = (row + np.arange(len(starts), dtype=np.int64)) * STAMP_BYTES
            offs = np.hstack([offs, col[:, None]])
            pieces.append((sid, STAMP_BYTES))
        return Route(pieces, offs.ravel().tolist(), row)

    def read_stamps(self, route: Route, stamps: Stamps) -> None:
        """The stamps a GET wrote into the arena, into ``stamps``."""
        n = len(stamps.array)
        arena, row = self._arena, route.stamp_row
        # a route made with stamps holds a row of the arena (route() gives None without one) until
        # release, and the caller reads before release; the arena goes only at close()
        assert arena is not None and row is not None, "read_stamps on a route without a stamp row"
        stamps.array[:] = arena.rows[row:row + n]

    def release(self, route: Route) -> None:
        arena = self._arena
        if route.stamp_row is not None and arena is not None:
            arena.give(route.stamp_row)
        route.stamp_row = None
