"""The shared-memory ring: the transfer window between engine ranks and the gateway.

The gateway creates a ring for each engine that attaches, as a fresh memfd
(``adpkv-ring-<port>``) sealed against shrinking and growing, and hands it as a
descriptor through its door (``adpkv_core.wire.door``, RING) only to the attached ranks of
that engine's owner: no other session ever maps memory that carries the engine's data.
There is no ring file anyone could replace, truncate or link to, so no process can make
the gateway fault on the ring. A slot lives for
one transfer only; the ring is not a cache. Objects sit in the ring at a stride
rounded up to ``RING_ALIGN`` so card I/O can use O_DIRECT straight into the
mapped slots.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

RING_ALIGN = 4096
RING_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MEMFD_NAME_PREFIX = "adpkv-ring-"
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def align_up(n: int, align: int = RING_ALIGN) -> int:
    return -(-n // align) * align


def object_stride(object_bytes: int) -> int:
    """Bytes between consecutive objects of one batch in the ring."""
    return align_up(object_bytes)


def max_parallel_ios(shared_memory_size: int, io_size: int) -> int:
    """How many objects of ``io_size`` can be in flight: half the ring per direction."""
    return max(1, (shared_memory_size // 2) // object_stride(max(1, io_size)))


class Ring:
    """A mapping of the ring. ``buf`` is a writable memoryview of all of it."""

    def __init__(self, name: str, size: int, fd: int, owner: bool, populate: bool = True):
        self.name = name
        self.size = size
        self.fd = fd
        self._owner = owner
        # ``populate``: the pages are allocated and mapped now, not faulted in one by one
        # during the first transfers (the ring is held for the engine's lifetime). Not by
        # MAP_POPULATE: Python's mmap() holds the GIL for all of it (seconds for a GiB ring on
        # a loaded host), and a client's I/O thread, which sends the heartbeats, would stall
        # until the gateway detached the rank. The gateway maps a new ring unpopulated (an
        # engine's first RING must not wait for it) and populates it on its I/O pool.
        self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self._mmap)
        if populate:
            self.populate()

    def populate(self) -> None:
        """Allocate and map every page of the ring now (``MADV_POPULATE_WRITE``, Linux 5.14+;
        through ctypes, which releases the GIL: other threads run meanwhile); a no-op where the
        kernel lacks it (the pages are then faulted in by the first transfers)."""
        export = (ctypes.c_char * self.size).from_buffer(self._mmap)
        try:
            _libc.madvise(ctypes.addressof(export), self.size, _MADV_POPULATE_WRITE)
        finally:
            del export

    @classmethod
    def create(cls, port: int, size: int) -> "Ring":
        """A ring of the gateway (one per engine): a fresh sealed memfd of ``size`` bytes
        (rounded up to the alignment), mapped but not populated yet (``populate``)."""
        size = align_up(size)
        name = f"{MEMFD_NAME_PREFIX}{port}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RING_SEALS)
            return cls(name, size, fd, owner=True, populate=False)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, size: int, populate: bool = True) -> "Ring":
        """Map a ring received from the gateway (takes ``fd``). ``ValueError`` when it is not
        a sealed ring of the size the gateway announced: the caller turns the cache off.
        ``populate``: as ``Ring``'s."""
        try:
            actual = os.fstat(fd).st_size
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if actual != size:
                raise ValueError(f"the ring is {actual} bytes, the gateway announced {size}")
            if seals & RING_SEALS != RING_SEALS:
                raise ValueError("the ring is not sealed against resizing")
            return cls(os.readlink(f"/proc/self/fd/{fd}"), size, fd, owner=False, populate=populate)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, path: str, size: int) -> "Ring":
        """Map a ring by a path to its descriptor (``/proc/<gateway pid>/fd/<n>``); used by
        the gateway's own I/O processes, on the first read task that names the ring. Not
        populated: each reader maps only the pages it writes, as it writes them (the gateway
        populated the ring's memory already). Populating all of it there, in every reader,
        was the first restore of every engine: 0.36 s per GiB of ring on a 2-core VM, 1.3 s
        for an 8 GiB ring on an H100 host (benchmarks/first_restore.py)."""
        return cls.from_fd(os.open(path, os.O_RDWR | os.O_CLOEXEC), size, populate=False)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        """A view of ``nbytes`` at ``offset``; raises on a range outside the ring."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"ring range [{offset}, {offset + nbytes}) outside [0, {self.size})")
        return self.buf[offset:offset + nbytes]

    def discard(self) -> bool:
        """The gateway's end of a ring no engine uses any more: its memory freed now (a hole
        punched through all of it: the memfd's size and seals stay), then ``close``. Other
        processes may still map it (the I/O processes drop a ring on their next task, the
        engine when it goes): their mappings then hold no memory, and dropping them is cheap.
        Freeing an 8 GiB ring there instead made the next engine's first restore wait for it.
        False where the kernel refused the hole (the memory then goes with the last mapping)."""
        freed = _libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, self.size) == 0
        self.close()
        return freed

    def close(self) -> None:
        """Stop using the ring.

        The gateway (owner) unmaps it. An engine rank only drops its references:
        tensors made over ``buf`` (``torch.frombuffer``) may still view the mapping,
        and unmapping under them would crash the engine; the mapping goes away with
        its last user.
        """
        os.close(self.fd)
        if not self._owner:
            # dropped, not closed (see above); a closed ring is never used again
            self.buf = None  # type: ignore[assignment]  # only the references go: nothing reads them after close
            self._mmap = None  # type: ignore[assignment]  # (as buf)
            return
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass


def is_ring_fd(fd: int) -> bool:
    """Whether ``fd`` is an adpkv ring (any gateway's): such a descriptor is never a region."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return target.startswith("/memfd:" + MEMFD_NAME_PREFIX) or \
        os.path.basename(target).startswith(MEMFD_NAME_PREFIX)
