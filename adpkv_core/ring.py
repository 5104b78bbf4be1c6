"""The shared-memory ring: the transfer window between engine ranks and the gateway.

The gateway creates a file in /dev/shm named after its port; every rank maps it.
A slot lives for one transfer only; the ring is not a cache. Objects sit in the
ring at a stride rounded up to ``RING_ALIGN`` so card I/O can use O_DIRECT
straight into the mapped slots.
"""

from __future__ import annotations

import mmap
import os

RING_ALIGN = 4096
SHM_DIR = "/dev/shm"


def ring_path(port: int, shm_dir: str = SHM_DIR) -> str:
    """The ring file of the gateway listening on ``port``."""
    return os.path.join(shm_dir, f"adpkv-ring-{port}")


def align_up(n: int, align: int = RING_ALIGN) -> int:
    return -(-n // align) * align


def object_stride(object_bytes: int) -> int:
    """Bytes between consecutive objects of one batch in the ring."""
    return align_up(object_bytes)


def max_parallel_ios(shared_memory_size: int, io_size: int) -> int:
    """How many objects of ``io_size`` can be in flight: half the ring per direction."""
    return max(1, (shared_memory_size // 2) // object_stride(max(1, io_size)))


class Ring:
    """A mapping of the ring file. ``buf`` is a writable memoryview of all of it."""

    def __init__(self, path: str, size: int, fd: int, owner: bool):
        self.path = path
        self.size = size
        self._fd = fd
        self._owner = owner
        # MAP_POPULATE: the pages are allocated and mapped now, not faulted in one by
        # one during the first transfers (the ring is held for the gateway's lifetime).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mmap = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, path: str, size: int) -> "Ring":
        """Create (or replace) the ring file; used by the gateway."""
        size = align_up(size)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        return cls(path, size, fd, owner=True)

    @classmethod
    def attach(cls, path: str, size: int | None = None) -> "Ring":
        """Map an existing ring file; used by the engine ranks."""
        fd = os.open(path, os.O_RDWR)
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            os.close(fd)
            raise ValueError(f"ring {path} is {actual} bytes, the gateway announced {size}")
        return cls(path, actual, fd, owner=False)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        """A view of ``nbytes`` at ``offset``; raises on a range outside the ring."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"ring range [{offset}, {offset + nbytes}) outside [0, {self.size})")
        return self.buf[offset:offset + nbytes]

    def close(self) -> None:
        """Stop using the ring.

        The gateway (owner) unmaps and removes the file. An engine rank only drops
        its references: tensors made over ``buf`` (``torch.frombuffer``) may still
        view the mapping, and unmapping under them would crash the engine; the
        mapping goes away with its last user.
        """
        os.close(self._fd)
        if not self._owner:
            self.buf = None
            self._mmap = None
            return
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
