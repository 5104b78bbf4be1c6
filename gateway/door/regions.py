"""Regions: buffers of a client's own that it hands over at the door as open descriptors.

Contract:

- ``take_region(fd, offset, size)`` makes a ``Region`` of a descriptor passed at the door
  only when it is a shared-memory buffer (a regular file directly in ``SHM_DIR``, or a
  memfd; never a ring, never any other file, even one the client may write: a region is a
  buffer, not a way to have the gateway write arbitrary files), open for reading and
  writing, and ``[offset, offset + size)`` lies within it; else ``ProtocolError``
  BAD_REGION, the descriptor left to the caller to close. How many regions a session may
  hold is the door's (``door.DoorServer``).
- A ``Region`` owns its descriptor from then on (``close``). The gateway never maps it;
  ``places`` checks every offset a request names against the region's bounds, and
  ``size_now`` is the check made before every write into it (``region_io``).
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from typing import Optional

from adpkv_core.wire import door as D
from adpkv_core.wire import protocol as P
from adpkv_core.memory.ring import is_ring_fd


class Region:
    """A buffer of a client's own, as the open descriptor it handed over. The gateway never
    maps it: data moves with ``pread``/``pwrite`` on the descriptor, so a client that
    truncates its buffer makes those calls fail (its own objects miss), nothing else."""

    __slots__ = ("fd", "offset", "size")

    def __init__(self, fd: int, offset: int, size: int):
        self.fd = fd
        self.offset = offset
        self.size = size

    def places(self, at: list, nbytes: int) -> list[int]:
        """File offsets of ``nbytes`` at each region offset in ``at``; BAD_REGION outside it."""
        out = []
        for off in at:
            if not isinstance(off, int) or isinstance(off, bool) or off < 0 or off + nbytes > self.size:
                raise P.ProtocolError(P.BAD_REGION, f"offset {off!r} + {nbytes} bytes is outside the region "
                                      f"of {self.size} bytes")
            out.append(self.offset + off)
        return out

    def size_now(self, write_by: Optional[float]) -> Optional[int]:
        """The descriptor's size now, or None when nothing may be written into the region any
        more: the client gave up on the request (``write_by`` passed, on CLOCK_MONOTONIC: its
        engine may reuse the buffer) or the descriptor is gone. Checked before every write
        into a region: a write past the size now would grow the client's file."""
        if write_by is not None and time.monotonic() >= write_by:
            return None
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return None

    def close(self) -> None:
        os.close(self.fd)


def take_region(fd: int, offset: int, size: int) -> Region:
    """The region ``[offset, offset + size)`` of the buffer behind ``fd`` (the module's
    contract); ``ProtocolError`` BAD_REGION when ``fd`` may not be one."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise P.ProtocolError(P.BAD_REGION, "a region must be a regular file (a shared-memory buffer)")
    if is_ring_fd(fd):
        raise P.ProtocolError(P.BAD_REGION, "a ring cannot be a region")
    if not _is_shared_memory(fd):
        raise P.ProtocolError(P.BAD_REGION, f"a region must be a shared-memory buffer: a file directly "
                              f"in {D.SHM_DIR} or a memfd")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise P.ProtocolError(P.BAD_REGION, "the region's descriptor must be open for reading and writing")
    if offset + size > st.st_size:
        raise P.ProtocolError(P.BAD_REGION, f"[{offset}, {offset + size}) is beyond the end of the "
                              f"file ({st.st_size} bytes)")
    return Region(fd, offset, size)


def _is_shared_memory(fd: int) -> bool:
    """Whether a descriptor is a file directly in /dev/shm or a memfd (what engines share
    their host KV buffers as); anything else is refused as a region, even one the client
    may write (a region is a buffer, not a way to have the gateway write arbitrary files)."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    if target.endswith(" (deleted)"):
        target = target[:-len(" (deleted)")]
    return target.startswith("/memfd:") or os.path.dirname(target) == D.SHM_DIR

