"""One object file of the fs card: writing it (from the ring or straight from a client's
region), reading it, checked, and copying it into a client's region.

A file is a 4 KiB header (``objfmt``, padded to one aligned block), then the payload. A
file is named by its directory's descriptor and its name (``fs_files``: opened with
``O_NOFOLLOW``, never by a path). A read answers a ``Read`` verdict: ``HIT`` when the
bytes are right (and of the expected write), else what is wrong; a failed open or read is
judged by its errno (``fs_files.verdict_of``: only ENOENT says the file is gone). The card
turns that into a miss and its bookkeeping. These functions run in the gateway's I/O
threads and in its I/O processes (``FileRead``) alike, each with its per-thread
``Scratch`` buffers.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from typing import Optional

from adpkv_gateway.cards.checksum import Xxh3Stream, xxh3_64
from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.base import Read
from adpkv_gateway.cards.fs.files import READ_FLAGS, verdict_of

HEADER_BYTES = 4096          # the object header (objfmt), padded to one aligned block
ALIGN = 4096
READ_PIECE = 256 << 10       # page-cache reads are read and hashed this much at a time (cache-hot hashing)

def _address(buf: memoryview) -> Optional[int]:
    """Address of a writable buffer (None for read-only ones)."""
    if buf.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Scratch(threading.local):
    """Page-aligned per-thread buffers: the header block and an O_DIRECT bounce buffer."""

    def __init__(self):
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.bounce = mmap.mmap(-1, ALIGN * 2)
        self.hasher = Xxh3Stream()

    def bounce_of(self, nbytes: int) -> memoryview:
        if len(self.bounce) < nbytes:
            self.bounce = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
        return memoryview(self.bounce)[:nbytes]


def payload_iov(buf: memoryview, n: int, o_direct: bool, scratch: Scratch, for_write: bool = False):
    """The iovecs of the payload, and (bounce view, offset, length) of a tail copied apart.

    Without O_DIRECT the payload goes straight to/from ``buf``. With O_DIRECT every
    iovec must be aligned: the aligned body of ``buf`` goes direct and the unaligned
    tail (or all of an unaligned buffer) through a bounce buffer.
    """
    if not o_direct:
        return [buf], None
    addr = _address(buf)
    body = (n // ALIGN) * ALIGN if addr is not None and addr % ALIGN == 0 else 0
    rest = n - body
    iov = [buf[:body]] if body else []
    if rest == 0:
        return iov, None
    bounce = scratch.bounce_of(-(-rest // ALIGN) * ALIGN)
    if for_write:
        bounce[:rest] = buf[body:]
        bounce[rest:] = bytes(len(bounce) - rest)
    iov.append(bounce)
    return iov, (bounce, body, rest)


def _read_hashed(fd: int, header: memoryview, buf: memoryview, hasher: Xxh3Stream) -> tuple[int, int]:
    """Read header and payload through the page cache, hashing each piece of the payload
    right after its read, while it is still in the CPU cache (one pass over the bytes
    instead of a read and a second checksum pass). Returns (bytes read, payload xxh3)."""
    n = len(buf)
    hasher.reset()
    got = os.preadv(fd, [header, buf[:min(n, READ_PIECE)]], 0)
    pos = max(0, got - HEADER_BYTES)
    if pos:
        hasher.update(buf[:pos])
    while 0 < pos < n and got > 0:
        got = os.preadv(fd, [buf[pos:pos + READ_PIECE]], HEADER_BYTES + pos)
        if got > 0:
            hasher.update(buf[pos:pos + got])
            pos += got
    return (HEADER_BYTES + pos if pos else min(got, HEADER_BYTES)), hasher.digest()


def read_object_file(dir_fd: int, name: str, fkey: bytes, buf: memoryview, o_direct: bool, scratch: Scratch,
                     write_id: Optional[int] = None, shared: bool = True) -> Read:
    """Read the payload of object file ``name`` (in the directory ``dir_fd``) into ``buf``
    (exactly its length), checking header (with ``write_id``: of that write) and
    checksum: its verdict. Runs in the gateway's I/O threads and in its I/O processes
    alike. ``shared``: ``buf`` is memory others may write (a ring slot): a checksum that
    fails there is checked again on a private read of the file before the object is
    called corrupt."""
    n = len(buf)
    try:
        fd = os.open(name, READ_FLAGS | (os.O_DIRECT if o_direct else 0), dir_fd=dir_fd)
    except OSError as exc:
        return verdict_of(exc)
    header = memoryview(scratch.header)
    digest = tail = None
    try:
        if o_direct:
            iov, tail = payload_iov(buf, n, o_direct, scratch)
            got = os.preadv(fd, [header] + iov, 0)
        else:
            got, digest = _read_hashed(fd, header, buf, scratch.hasher)
    except OSError as exc:
        return verdict_of(exc)
    finally:
        os.close(fd)
    if got < HEADER_BYTES + n:
        return Read.TRUNCATED
    verdict = objfmt.check_header(header, fkey, n, write_id)
    if verdict is not Read.HIT:
        return verdict
    if tail is not None:
        src, dst_off, length = tail
        buf[dst_off:dst_off + length] = src[:length]
    if digest is None:
        digest_ok = objfmt.payload_ok(header, buf)
    else:
        digest_ok = digest == objfmt.payload_checksum(header)
    if not digest_ok and shared:
        # ``buf`` is a ring slot the engine's ranks map too: its bytes may have changed since
        # they were read. Only the file's own bytes, checked in private memory, can say the
        # object is corrupt; when they check, they are what lands in ``buf``.
        private = scratch.bounce_of(n)
        verdict = read_object_file(dir_fd, name, fkey, private, False, scratch, write_id, shared=False)
        if verdict is Read.HIT:
            buf[:] = private
        return verdict
    return Read.HIT if digest_ok else Read.BAD_CHECKSUM


def copy_object_file(dir_fd: int, name: str, fkey: bytes, n: int, out_fd: int, out_offset: int,
                     scratch: Scratch, write_by: Optional[float] = None, write_id: Optional[int] = None) -> Read:
    """Copy the payload of object file ``name`` (in ``dir_fd``) to ``out_fd`` at
    ``out_offset`` (a client's region) with ``pwrite``, checking header (with ``write_id``:
    of that write) and checksum on the way: the verdict as ``read_object_file``'s
    (``UNDELIVERED`` when the destination took less than it was given, or when ``write_by``
    (monotonic: the client gave up on the request) came before one of the writes into it;
    nothing more is written then).

    A cached file of up to ``WHOLE_CACHED`` bytes is read whole into a per-thread buffer that
    stays in the CPU cache, checked there and written with one ``pwrite`` (``_copy_whole``):
    nothing lands before the checksum is known, and a change to the card file after the
    check cannot reach the destination (it is written from the checked buffer). Larger ones
    go piece by piece through that buffer: read, hash, write; their bytes land before the
    checksum is known, as with any read into a buffer: a mismatch reports the object missing
    and the engine does not use them. The destination is touched only by the kernel: a
    client that shrinks its buffer makes ``pwrite`` come back short, it cannot make the
    gateway fault.

    A file whose header is not in the page cache (``cachestat`` says so: dropped, or never
    read since the gateway started) is read with O_DIRECT instead (``_copy_uncached``): one
    disk read of the whole file, not the page cache's readahead piece by piece."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        return verdict_of(exc)
    header = memoryview(scratch.header)
    piece = scratch.bounce_of(READ_PIECE)
    hasher = scratch.hasher
    try:
        if n <= WHOLE_MAX and page_cached(fd) is False:
            verdict = _copy_uncached(dir_fd, name, fkey, n, out_fd, out_offset, scratch, write_by, write_id)
            if verdict is not None:
                return verdict
        if n <= WHOLE_CACHED:
            return _copy_whole(fd, fkey, n, out_fd, out_offset, scratch, write_by, write_id)
        if os.preadv(fd, [header], 0) < HEADER_BYTES:
            return Read.TRUNCATED
        verdict = objfmt.check_header(header, fkey, n, write_id)
        if verdict is not Read.HIT:
            return verdict
        hasher.reset()
        for pos in range(0, n, READ_PIECE):
            k = min(READ_PIECE, n - pos)
            if os.preadv(fd, [piece[:k]], HEADER_BYTES + pos) != k:
                return Read.TRUNCATED
            hasher.update(piece[:k])
            if write_by is not None and time.monotonic() >= write_by:
                return Read.UNDELIVERED
            try:
                written = os.pwrite(out_fd, piece[:k], out_offset + pos)
            except OSError:
                written = -1
            if written != k:
                return Read.UNDELIVERED
    except OSError as exc:
        return verdict_of(exc)
    finally:
        os.close(fd)
    return Read.HIT if hasher.digest() == objfmt.payload_checksum(header) else Read.BAD_CHECKSUM


WHOLE_CACHED = 2 << 20          # cached objects up to this size are read, checked and written whole


def _copy_whole(fd: int, fkey: bytes, n: int, out_fd: int, out_offset: int, scratch: Scratch,
                write_by: Optional[float], write_id: Optional[int]) -> Read:
    """``copy_object_file`` of a cached file of up to ``WHOLE_CACHED`` bytes: header and payload
    in one read into the per-thread buffer (it stays in the CPU cache), checked there, then
    one ``pwrite``: nothing lands before the checksum is known, and three system calls an
    object instead of two a piece."""
    buf = scratch.bounce_of(HEADER_BYTES + n)
    if os.preadv(fd, [buf], 0) < HEADER_BYTES + n:
        return Read.TRUNCATED
    return _check_and_land(buf[:HEADER_BYTES], buf[HEADER_BYTES:], fkey, n, out_fd, out_offset, write_by, write_id)


WHOLE_MAX = 16 << 20            # objects up to this size move in one I/O: an uncached read, a store from a region


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


_SYS_CACHESTAT = 451 if os.uname().machine in ("x86_64", "aarch64") else None     # Linux 6.5+
_libc = ctypes.CDLL(None, use_errno=True) if _SYS_CACHESTAT is not None else None


def page_cached(fd: int) -> Optional[bool]:
    """Whether the first page of a file is in the page cache (Linux ``cachestat``: it only
    looks, it starts no readahead, unlike a probing ``RWF_NOWAIT`` read); None where the
    kernel cannot tell."""
    global _SYS_CACHESTAT
    if _SYS_CACHESTAT is None or _libc is None:    # _libc is None only where _SYS_CACHESTAT is
        return None
    rng, stat = _CachestatRange(0, ALIGN), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _SYS_CACHESTAT = None          # an older kernel: never ask again
        return None
    return stat.nr_cache > 0


def _copy_uncached(dir_fd: int, name: str, fkey: bytes, n: int, out_fd: int, out_offset: int, scratch: Scratch,
                   write_by: Optional[float], write_id: Optional[int]) -> Optional[Read]:
    """``copy_object_file`` of a file that is not in the page cache: header and payload in one
    O_DIRECT read into the per-thread bounce buffer (the disk's DMA, no page-cache copy),
    checked there, then one ``pwrite`` to the destination: nothing lands before the checksum
    is known. None when the file system refuses O_DIRECT (read it through the page cache)."""
    try:
        fd = os.open(name, READ_FLAGS | os.O_DIRECT, dir_fd=dir_fd)
    except OSError as exc:
        return None if exc.errno == errno.EINVAL else verdict_of(exc)
    buf = scratch.bounce_of(HEADER_BYTES + -(-n // ALIGN) * ALIGN)
    try:
        got = os.preadv(fd, [buf], 0)
    except OSError as exc:
        return None if exc.errno == errno.EINVAL else verdict_of(exc)
    finally:
        os.close(fd)
    if got < HEADER_BYTES + n:
        return Read.TRUNCATED
    return _check_and_land(buf[:HEADER_BYTES], buf[HEADER_BYTES:HEADER_BYTES + n], fkey, n, out_fd, out_offset,
                           write_by, write_id)


def _check_and_land(header: memoryview, payload: memoryview, fkey: bytes, n: int, out_fd: int, out_offset: int,
                    write_by: Optional[float], write_id: Optional[int]) -> Read:
    """Check a whole object read into a buffer (its header names ``fkey``, ``n`` bytes and
    ``write_id``, the payload matches its checksum), then write the payload into the
    client's buffer in one ``pwrite``, unless the client gave up (``write_by``): the
    verdict (``HIT`` when it landed). Nothing lands before the whole object is checked."""
    verdict = objfmt.check_header(header, fkey, n, write_id)
    if verdict is not Read.HIT:
        return verdict
    if not objfmt.payload_ok(header, payload):
        return Read.BAD_CHECKSUM
    if write_by is not None and time.monotonic() >= write_by:
        return Read.UNDELIVERED
    try:
        written = os.pwrite(out_fd, payload, out_offset)
    except OSError:
        written = -1
    return Read.HIT if written == n else Read.UNDELIVERED


class FdSlice:
    """``length`` bytes at ``offset`` of an open descriptor (a client's region): what a card
    writes from, read by the gateway with ``pread`` (never mapped, see ``copy_object_file``).
    ``read_by``: the moment (monotonic) the client gives up; bytes read later are not stored."""

    __slots__ = ("fd", "offset", "length", "read_by")

    def __init__(self, fd: int, offset: int, length: int, read_by: Optional[float] = None):
        self.fd, self.offset, self.length, self.read_by = fd, offset, length, read_by

    def __len__(self) -> int:
        return self.length


def write_object_file(fd: int, fkey: bytes, payload, object_bytes: int, o_direct: bool,
                      scratch: Scratch, write_id: int = 0, tag: Optional[bytes] = None) -> None:
    """Write one object file (header, then the payload; the header carries ``write_id`` and
    the slot ``tag``, ``objfmt``)
    into ``fd``, a new file opened for writing (with O_DIRECT when ``o_direct``; its payload
    then padded to ``ALIGN``). Raises
    ``OSError`` when the file is not whole.

    ``payload`` is a memoryview (the ring: one ``pwritev`` of header and payload) or an
    ``FdSlice`` (a client's region): read into a per-thread buffer, hashed there and written
    from there, the header carrying the checksum of exactly the bytes written. One copy of
    the payload, no ring. Up to ``WHOLE_MAX`` the payload is read whole and written
    with its header in one ``pwritev`` (one I/O, which is what counts with O_DIRECT); larger
    ones piece by piece (``READ_PIECE``, cache-resident), the header last. A region
    shorter than the slice (the client truncated it) fails the write, and so does a last
    read that ended at or after the slice's ``read_by`` (by then the engine may have put
    other bytes there: they must not be stored under this key)."""
    header = memoryview(scratch.header)
    if not isinstance(payload, FdSlice):
        n = len(payload)
        objfmt.fill_header(header, fkey, payload, object_bytes, write_id, tag)
        iov, _ = payload_iov(payload, n, o_direct, scratch, for_write=True)
        if os.pwritev(fd, [header] + iov, 0) != HEADER_BYTES + sum(len(v) for v in iov):
            raise OSError("short write")
        return
    n = payload.length
    if n <= WHOLE_MAX:
        # the whole payload into the per-thread buffer (one read, one hash), then header and
        # payload in one write: one I/O per object, also with O_DIRECT
        out = -(-n // ALIGN) * ALIGN if o_direct else n
        buf = scratch.bounce_of(out)
        if os.preadv(payload.fd, [buf[:n]], payload.offset) != n:
            raise OSError("the region is shorter than the object (truncated by its client)")
        if payload.read_by is not None and time.monotonic() >= payload.read_by:
            raise OSError("read from the region after its client gave up on the store")
        if out > n:
            buf[n:out] = bytes(out - n)
        objfmt.fill_header_of(header, fkey, n, xxh3_64(buf[:n]), object_bytes, write_id, tag)
        if os.pwritev(fd, [header, buf[:out]], 0) != HEADER_BYTES + out:
            raise OSError("short write")
        return
    piece = scratch.bounce_of(READ_PIECE)
    hasher = scratch.hasher
    hasher.reset()
    for pos in range(0, n, READ_PIECE):
        k = min(READ_PIECE, n - pos)
        if os.preadv(payload.fd, [piece[:k]], payload.offset + pos) != k:
            raise OSError("the region is shorter than the object (truncated by its client)")
        hasher.update(piece[:k])
        out = k
        if o_direct and k % ALIGN:
            out = -(-k // ALIGN) * ALIGN
            piece[k:out] = bytes(out - k)
        if os.pwrite(fd, piece[:out], HEADER_BYTES + pos) != out:
            raise OSError("short write")
    if payload.read_by is not None and time.monotonic() >= payload.read_by:
        raise OSError("read from the region after its client gave up on the store")
    objfmt.fill_header_of(header, fkey, n, hasher.digest(), object_bytes, write_id, tag)
    if os.pwrite(fd, header, 0) != HEADER_BYTES:
        raise OSError("short write")


