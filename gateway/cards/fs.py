"""The fs card: a directory on a local NVMe drive (or a mounted remote one).

Layout::

    DIR/adpkv-card.json          serial number and format of the card
    DIR/db007/<fragment key hex> one file per fragment: a 4 KiB header, then the payload

The header carries the fragment's key, payload length and xxh3 checksums of the
payload and of itself, so a truncated, corrupt or foreign file is a miss. Writes
go to a temporary file that is renamed into place (atomic against a crash of
the gateway; with ``fsync`` also against power loss). The index (key → size, in
LRU order) is rebuilt from the directory at start. With ``o_direct`` the page
cache is bypassed and I/O goes straight between the file and the ring.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import mmap
import os
import shutil
import threading
import time
import uuid
from typing import Callable, Optional

from adpkv_core.checksum import Xxh3Stream
from adpkv_core.keys import KEY_BYTES

from . import objfmt
from .base import Card, CardError, CardUsage

logger = logging.getLogger("adpkv.gateway.fs")

HEADER_BYTES = 4096          # the object header (objfmt), padded to one aligned block
ALIGN = 4096
READ_PIECE = 256 << 10       # page-cache reads are read and hashed this much at a time (cache-hot hashing)
FORMAT = 1
CARD_FILE = "adpkv-card.json"


def _address(buf: memoryview) -> Optional[int]:
    """Address of a writable buffer (None for read-only ones)."""
    if buf.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _Scratch(threading.local):
    """Page-aligned per-thread buffers: the header block and an O_DIRECT bounce buffer."""

    def __init__(self):
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.bounce = mmap.mmap(-1, ALIGN * 2)
        self.hasher = Xxh3Stream()

    def bounce_of(self, nbytes: int) -> memoryview:
        if len(self.bounce) < nbytes:
            self.bounce = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
        return memoryview(self.bounce)[:nbytes]


def _payload_iov(buf: memoryview, n: int, o_direct: bool, scratch: _Scratch, for_write: bool = False):
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


def read_object_file(path: str, fkey: bytes, buf: memoryview, o_direct: bool, scratch: _Scratch) -> Optional[str]:
    """Read the payload of one object file into ``buf`` (exactly its length), checking
    header and checksum. None when the bytes are right, else what is wrong: "missing",
    "truncated", "bad header", "checksum mismatch" or "I/O error: ...". Runs in the
    gateway's I/O threads and in its I/O processes alike."""
    n = len(buf)
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    except OSError:
        return "missing"
    header = memoryview(scratch.header)
    digest = tail = None
    try:
        if o_direct:
            iov, tail = _payload_iov(buf, n, o_direct, scratch)
            got = os.preadv(fd, [header] + iov, 0)
        else:
            got, digest = _read_hashed(fd, header, buf, scratch.hasher)
    except OSError as exc:
        return f"I/O error: {exc}"
    finally:
        os.close(fd)
    if got < HEADER_BYTES + n:
        return "truncated"
    if not objfmt.check_header(header, fkey, n):
        return "bad header"
    if tail is not None:
        src, dst_off, length = tail
        buf[dst_off:dst_off + length] = src[:length]
    if digest is None:
        digest_ok = objfmt.payload_ok(header, buf)
    else:
        digest_ok = digest == objfmt.payload_checksum(header)
    if not digest_ok:
        return "checksum mismatch"
    return None


class FsCard(Card):
    """A card that is a directory of object files."""

    kind = "fs"

    def __init__(self, device: str, num_dbs: int = 16, capacity_bytes: int = 0,
                 eviction_watermark: float = 0.95, eviction_ratio: float = 0.10,
                 o_direct: bool = False, fsync: bool = False,
                 is_pinned: Callable[[bytes], bool] = lambda key: False):
        super().__init__(device)
        self.root = os.path.abspath(device)
        self.num_dbs = num_dbs
        self.capacity_bytes = capacity_bytes
        self.watermark = eviction_watermark
        self.ratio = eviction_ratio
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self.is_pinned = is_pinned
        self._lock = threading.Lock()
        self._index: "collections.OrderedDict[bytes, tuple[int, int]]" = collections.OrderedDict()
        self._used = 0
        self._scratch = _Scratch()
        self._tmp_seq = 0
        self.evicted = 0

    # ------------------------------------------------------------------ setup
    def open(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot create the directory: {exc}") from None
        meta_path = os.path.join(self.root, CARD_FILE)
        if os.path.exists(meta_path):
            try:
                with open(meta_path, encoding="utf-8") as fh:
                    meta = json.load(fh)
                self.serial = str(meta["serial"])
            except (OSError, ValueError, KeyError) as exc:
                raise CardError(f"fs card {self.root}: unreadable {CARD_FILE}: {exc}") from None
            if meta.get("format") != FORMAT:
                raise CardError(f"fs card {self.root}: format {meta.get('format')} is not {FORMAT}")
        else:
            if any(not n.startswith(".") for n in os.listdir(self.root)):
                raise CardError(f"fs card {self.root}: the directory holds other files and no {CARD_FILE}; "
                                "give the card an empty or new directory")
            self.serial = "FS" + uuid.uuid4().hex[:14].upper()
            tmp = meta_path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"serial": self.serial, "format": FORMAT, "created": time.time()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, meta_path)
        for db in range(self.num_dbs):
            os.makedirs(self._db_dir(db), exist_ok=True)
        if self.o_direct and not self._probe_o_direct():
            logger.warning("fs card %s: the file system refuses O_DIRECT; using the page cache", self.root)
            self.o_direct = False
        self._rebuild_index()
        if self.capacity_bytes <= 0:
            self.capacity_bytes = shutil.disk_usage(self.root).free + self._used
        logger.info("fs card %s (serial %s): capacity %.1f MiB", self.root, self.serial, self.capacity_bytes / 2**20)

    def _db_dir(self, db: int) -> str:
        return os.path.join(self.root, f"db{db:03d}")

    def _path(self, db: int, fkey: bytes) -> str:
        return os.path.join(self.root, f"db{db:03d}", fkey.hex())

    def _probe_o_direct(self) -> bool:
        probe = os.path.join(self.root, ".odirect-probe")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                os.pwrite(fd, self._scratch.header, 0)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass

    def _rebuild_index(self) -> None:
        """Index every object file (oldest first); drop leftovers of interrupted writes."""
        t0 = time.monotonic()
        entries = []
        for name in sorted(os.listdir(self.root)):
            if not (name.startswith("db") and name[2:].isdigit()):
                continue
            db = int(name[2:])
            with os.scandir(os.path.join(self.root, name)) as it:
                for e in it:
                    if e.name.startswith("."):
                        try:
                            os.unlink(e.path)  # a temp file of a write that never finished
                        except OSError:
                            pass
                        continue
                    try:
                        fkey = bytes.fromhex(e.name)
                        st = e.stat()
                    except (ValueError, OSError):
                        continue
                    entries.append((st.st_mtime, fkey, db, st.st_size))
        entries.sort()
        with self._lock:
            self._index.clear()
            self._used = 0
            for _, fkey, db, size in entries:
                self._index[fkey] = (db, size)
                self._used += size
        logger.info("fs card %s (serial %s): %d objects, %.1f MiB indexed in %.2f s",
                    self.root, self.serial, len(entries), self._used / 2**20, time.monotonic() - t0)

    # ------------------------------------------------------------------ data
    def read(self, db: int, fkey: bytes, buf: memoryview) -> bool:
        path = self.locate(fkey)
        if path is None:
            return False
        return self.read_result(fkey, path, read_object_file(path, fkey, buf, self.o_direct, self._scratch))

    def locate(self, fkey: bytes) -> Optional[str]:
        """The file of a stored fragment (refreshing its LRU place), or None."""
        with self._lock:
            entry = self._index.get(fkey)
            if entry is None:
                return None
            self._index.move_to_end(fkey)
        return self._path(entry[0], fkey)

    def read_result(self, fkey: bytes, path: str, problem: Optional[str]) -> bool:
        """Account for the outcome of ``read_object_file`` (here or in an I/O process)."""
        if problem is None:
            return True
        if problem == "missing":
            self._forget(fkey)
        elif problem.startswith("I/O error"):
            logger.warning("fs card %s: read of %s failed: %s", self.root, path, problem)
        else:
            self._corrupt(path, fkey, problem)
        return False

    def write(self, db: int, fkey: bytes, buf: memoryview) -> bool:
        n = len(buf)
        on_disk = HEADER_BYTES + (-(-n // ALIGN) * ALIGN if self.o_direct else n)
        if not self._reserve(fkey, on_disk):
            return False
        header = memoryview(self._scratch.header)
        objfmt.fill_header(header, fkey, buf)
        final = self._path(db, fkey)
        with self._lock:
            self._tmp_seq += 1
            tmp = os.path.join(self._db_dir(db), f".{fkey.hex()}.{os.getpid()}.{self._tmp_seq}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.o_direct else 0), 0o644)
            try:
                iov, tail = _payload_iov(buf, n, self.o_direct, self._scratch, for_write=True)
                want = HEADER_BYTES + sum(len(v) for v in iov)
                if os.pwritev(fd, [header] + iov, 0) != want:
                    raise OSError("short write")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError as exc:
            logger.warning("fs card %s: write of %s failed: %s", self.root, final, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._unreserve(on_disk)
            return False
        with self._lock:
            old = self._index.pop(fkey, None)
            if old is not None:
                self._used -= old[1]
            self._index[fkey] = (db, on_disk)
        return True

    def _corrupt(self, path: str, fkey: bytes, why: str) -> bool:
        logger.warning("fs card %s: %s is %s; treating it as a miss and removing it", self.root, path, why)
        self._forget(fkey)
        try:
            os.unlink(path)
        except OSError:
            pass
        return False

    def _forget(self, fkey: bytes) -> None:
        with self._lock:
            old = self._index.pop(fkey, None)
            if old is not None:
                self._used -= old[1]

    # ------------------------------------------------------------------ capacity
    def _reserve(self, fkey: bytes, nbytes: int) -> bool:
        """Account ``nbytes`` for a new file, evicting least recently used objects if needed."""
        victims = []
        with self._lock:
            old = self._index.get(fkey)
            freed_by_overwrite = old[1] if old else 0
            high = self.capacity_bytes * self.watermark
            if self._used + nbytes - freed_by_overwrite > high:
                target = self.capacity_bytes * (self.watermark - self.ratio) - nbytes + freed_by_overwrite
                for key in list(self._index.keys()):
                    if self._used <= target:
                        break
                    if key == fkey or self.is_pinned(key[:KEY_BYTES]):
                        continue
                    db, size = self._index.pop(key)
                    self._used -= size
                    victims.append((db, key))
                if self._used + nbytes - freed_by_overwrite > self.capacity_bytes:
                    logger.warning("fs card %s is full (%d of %d bytes, the rest pinned): not storing",
                                   self.root, self._used, self.capacity_bytes)
                    ok = False
                else:
                    ok = True
            else:
                ok = True
            if ok:
                self._used += nbytes
        for db, key in victims:
            try:
                os.unlink(self._path(db, key))
            except OSError:
                pass
        self.evicted += len(victims)
        return ok

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    # ------------------------------------------------------------------ admin
    def contains(self, db: int, fkey: bytes) -> bool:
        with self._lock:
            return fkey in self._index

    def contains_many(self, items, lengths=None):
        with self._lock:
            if lengths is None:
                return [fkey in self._index for _, fkey in items]
            out = []
            for (_, fkey), n in zip(items, lengths):
                entry = self._index.get(fkey)
                out.append(entry is not None and entry[1] in (HEADER_BYTES + n, HEADER_BYTES + -(-n // ALIGN) * ALIGN))
            return out

    def delete(self, db: int, fkey: bytes) -> bool:
        with self._lock:
            entry = self._index.pop(fkey, None)
            if entry is None:
                return False
            self._used -= entry[1]
        try:
            os.unlink(self._path(entry[0], fkey))
        except OSError:
            pass
        return True

    def clean(self) -> int:
        with self._lock:
            items = list(self._index.items())
            self._index.clear()
            self._used = 0
        for fkey, (db, _) in items:
            try:
                os.unlink(self._path(db, fkey))
            except OSError:
                pass
        logger.info("fs card %s: cleaned, %d objects removed", self.root, len(items))
        return len(items)

    def usage(self) -> CardUsage:
        with self._lock:
            return CardUsage(self._used, self.capacity_bytes, len(self._index))

    def check(self) -> bool:
        try:
            with open(os.path.join(self.root, CARD_FILE), encoding="utf-8") as fh:
                return json.load(fh).get("serial") == self.serial and os.access(self.root, os.W_OK)
        except (OSError, ValueError):
            return False
