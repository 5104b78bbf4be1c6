"""Registered regions: an engine's own shared-memory buffers, mapped by the gateway.

Some engines keep their host-side KV buffers in a shared-memory file already
(LMCache's server allocates its L1 pool in ``/dev/shm``). A rank may register
such a file (``REGION path offset size``); GET and PUT requests that name the
region and an offset per object then move data between the card and that
buffer directly, with no ring slot and no copy on the engine side: one copy in
all, as when the engine reads a file itself.

Only regular files directly in ``/dev/shm`` are accepted (never a symlink, never
the gateway's own ring): the gateway writes into what a client names, so it
must be memory shared for that purpose, not an arbitrary file. A region lives
until its rank detaches; the mapping stays until the last I/O on it ends.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import Sequence

from adpkv_core import protocol as P
from adpkv_core.ring import SHM_DIR

MAX_REGIONS_PER_PEER = 8
_PAGE = mmap.PAGESIZE


class Region:
    """One mapped range ``[offset, offset+size)`` of a shared-memory file."""

    __slots__ = ("path", "size", "buf")

    def __init__(self, path: str, offset: int, size: int):
        self.path = path
        self.size = size
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise P.ProtocolError(P.BAD_REGION, f"{path} is not a regular file")
            if offset + size > st.st_size:
                raise P.ProtocolError(P.BAD_REGION, f"[{offset}, {offset + size}) is beyond the end of "
                                      f"{path} ({st.st_size} bytes)")
            start = offset - offset % _PAGE
            mm = mmap.mmap(fd, offset + size - start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=start)
        finally:
            os.close(fd)
        # The views handed to I/O keep the mapping alive: it is unmapped when the
        # region is dropped and the last read or write into it has finished.
        self.buf = memoryview(mm)[offset - start:]

    def views(self, at: Sequence[int], nbytes: int) -> list[memoryview]:
        """One view of ``nbytes`` at each offset; BAD_REGION for a range outside the region."""
        out = []
        for off in at:
            if not isinstance(off, int) or isinstance(off, bool) or off < 0 or off + nbytes > self.size:
                raise P.ProtocolError(P.BAD_REGION, f"offset {off!r} + {nbytes} bytes is outside the region "
                                      f"of {self.size} bytes")
            out.append(self.buf[off:off + nbytes])
        return out


class RegionTable:
    """The regions each attached rank registered."""

    def __init__(self, ring_path: str, shm_dir: str = SHM_DIR):
        self.ring_path = os.path.realpath(ring_path)
        self.shm_dir = os.path.realpath(shm_dir)
        self._by_peer: dict[bytes, list[Region]] = {}

    def register(self, identity: bytes, path: str, offset: int, size: int) -> int:
        """Map a region for ``identity``; its id (an index) for later requests."""
        if offset < 0 or size <= 0:
            raise P.ProtocolError(P.BAD_REGION, f"offset {offset} / size {size} is not a region")
        real = os.path.realpath(path)
        if os.path.dirname(real) != self.shm_dir or real != os.path.normpath(path):
            raise P.ProtocolError(P.BAD_REGION, f"{path}: a region must be a file directly in {self.shm_dir} "
                                  "(no links)")
        if real == self.ring_path:
            raise P.ProtocolError(P.BAD_REGION, "the gateway's own ring cannot be a region")
        regions = self._by_peer.setdefault(identity, [])
        if len(regions) >= MAX_REGIONS_PER_PEER:
            raise P.ProtocolError(P.BAD_REGION, f"at most {MAX_REGIONS_PER_PEER} regions per rank")
        try:
            regions.append(Region(real, offset, size))
        except OSError as exc:
            raise P.ProtocolError(P.BAD_REGION, f"cannot map {path}: {exc.strerror or exc}") from None
        return len(regions) - 1

    def views(self, identity: bytes, region: int, at: Sequence[int], nbytes: int) -> list[memoryview]:
        regions = self._by_peer.get(identity, [])
        if not 0 <= region < len(regions):
            raise P.ProtocolError(P.BAD_REGION, f"region {region} is not registered by this rank")
        return regions[region].views(at, nbytes)

    def drop(self, identity: bytes) -> int:
        """Forget the regions of a rank that left; how many it had."""
        return len(self._by_peer.pop(identity, []))

    def count(self) -> int:
        return sum(len(r) for r in self._by_peer.values())
