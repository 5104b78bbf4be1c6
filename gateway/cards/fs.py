"""The fs card: a directory on a local NVMe drive (or a mounted remote one).

Layout::

    DIR/adpkv-card.json          serial number and format of the card
    DIR/db007/<fragment key hex> one file per fragment: a 4 KiB header, then the payload

The header carries the fragment's key, payload length, the object's size (head
fragment) and xxh3 checksums of the payload and of itself, so a truncated,
corrupt or foreign file is a miss. Writes go to a temporary file that is renamed
into place (atomic against a crash of the gateway; with ``fsync`` the file and
then its directory are fsynced, so also against power loss). The index (object
→ its fragment files and sizes, in LRU order of objects) is rebuilt from the
directory at start, checking every file's header against its size. An object
lives and dies whole: eviction, delete and a failed read drop all its fragment
files (head first). With ``o_direct`` the page cache is bypassed and I/O goes
straight between the file and the ring. Files are 0600 and directories 0700
(0640/0750 and the ``card_group`` group when one is set).
"""

from __future__ import annotations

import collections
import grp
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from typing import Callable, Optional

from ..fragments import fragment_extents
from .. import progress
from ..quotas import TenantBook, TenantUsage, tenant_of
from adpkv_core.keys import KEY_BYTES

from . import objfmt
from .base import Card, CardError, CardUsage, is_head, object_key
from .objfile import (ALIGN, HEADER_BYTES, REGION_WRITE_FAILED, FdSlice, FileRead, Scratch, copy_object_file,
                      read_object_file, write_object_file)

logger = logging.getLogger("adpkv.gateway.fs")

FORMAT = 1
CARD_FILE = "adpkv-card.json"
CARD_FILE_TMP = ".adpkv-card.json.tmp"
LEFTOVERS = (CARD_FILE + ".tmp", CARD_FILE_TMP, ".odirect-probe")   # of the card's own atomic writes
HEAD_SUFFIX = b"\0\0"


class _Object:
    """The fragment files of one object in the index."""

    __slots__ = ("parts", "total")

    def __init__(self):
        self.parts: dict[bytes, tuple[int, int]] = {}   # fragment key -> (db, bytes on disk)
        self.total = 0                                   # object size its head records (0: unknown)


def _sizes_on_disk(n: int) -> tuple[int, int]:
    """The sizes a file of ``n`` payload bytes may have (page cache, O_DIRECT padding)."""
    return HEADER_BYTES + n, HEADER_BYTES + -(-n // ALIGN) * ALIGN


def _group_id(name: str) -> int:
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise CardError(f"card_group {name!r} is not a group of this host") from None


class FsCard(Card):
    """A card that is a directory of object files."""

    kind = "fs"
    direct_reads = True
    direct_writes = True

    def __init__(self, device: str, num_dbs: int = 16, capacity_bytes: int = 0,
                 eviction_watermark: float = 0.95, eviction_ratio: float = 0.10,
                 o_direct: bool = False, fsync: bool = False,
                 is_pinned: Callable[[bytes], bool] = lambda key: False, card_group: str = "",
                 quotas: Optional[dict[bytes, int]] = None):
        super().__init__(device)
        self.root = os.path.abspath(device)
        self.num_dbs = num_dbs
        self.capacity_bytes = capacity_bytes
        self.watermark = eviction_watermark
        self.ratio = eviction_ratio
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self.is_pinned = is_pinned
        self.card_group = card_group
        self.gid = -1                                  # -1: files keep the gateway's group
        self.file_mode, self.dir_mode = (0o640, 0o750) if card_group else (0o600, 0o700)
        self._lock = threading.Lock()
        self._objects: "collections.OrderedDict[bytes, _Object]" = collections.OrderedDict()
        self._files = 0
        self._used = 0
        self._tenants = TenantBook(quotas)             # bytes, LRU and quota of each namespace
        self._scratch = Scratch()
        self._tmp_seq = 0
        self._dir_fds: dict[int, int] = {}             # db -> directory fd (fsync: true)
        self._db_paths = [os.path.join(self.root, f"db{db:03d}", "") for db in range(num_dbs)]   # db -> "DIR/dbNNN/"
        self.evicted = 0

    # ------------------------------------------------------------------ setup
    def open(self) -> None:
        if self.card_group:
            self.gid = _group_id(self.card_group)
        try:
            os.makedirs(self.root, exist_ok=True)
            self._own_dir(self.root)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot create the directory: {exc}") from None
        self._remove_leftovers()
        meta_path = os.path.join(self.root, CARD_FILE)
        if os.path.exists(meta_path):
            try:
                with open(meta_path, encoding="utf-8") as fh:
                    meta = json.load(fh)
                    self._own_file(fh.fileno())
                self.serial = str(meta["serial"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CardError(f"fs card {self.root}: unreadable {CARD_FILE}: {exc}") from None
            if meta.get("format") != FORMAT:
                raise CardError(f"fs card {self.root}: format {meta.get('format')} is not {FORMAT}")
        else:
            if any(not n.startswith(".") for n in os.listdir(self.root)):
                raise CardError(f"fs card {self.root}: the directory holds other files and no {CARD_FILE}; "
                                "give the card an empty or new directory")
            self.serial = "FS" + uuid.uuid4().hex[:14].upper()
            self._write_card_file(meta_path)
        try:
            for db in range(self.num_dbs):
                os.makedirs(self._db_dir(db), exist_ok=True)
                self._own_dir(self._db_dir(db))
            if self.fsync:
                self._fsync_dir(self.root)
                for db in range(self.num_dbs):
                    self._dir_fds[db] = os.open(self._db_dir(db), os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot prepare its databases: {exc}") from None
        if self.o_direct and not self._probe_o_direct():
            logger.warning("fs card %s: the file system refuses O_DIRECT; using the page cache", self.root)
            self.o_direct = False
        self._rebuild_index()
        self._trim_to_quotas()
        if self.capacity_bytes <= 0:
            self.capacity_bytes = shutil.disk_usage(self.root).free + self._used
        logger.info("fs card %s (serial %s): capacity %.1f MiB", self.root, self.serial, self.capacity_bytes / 2**20)

    def _remove_leftovers(self) -> None:
        """Remove what an interrupted atomic write of the card itself left in its directory
        (a crash during the first start): never a reason to refuse the card."""
        for name in LEFTOVERS:
            try:
                os.unlink(os.path.join(self.root, name))
                logger.info("fs card %s: removed %s left by an interrupted start", self.root, name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CardError(f"fs card {self.root}: cannot remove the leftover {name}: {exc}") from None

    def _write_card_file(self, meta_path: str) -> None:
        """Create ``adpkv-card.json`` atomically and durably (file, then directory, fsynced)."""
        tmp = os.path.join(self.root, CARD_FILE_TMP)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.file_mode)
            try:
                self._own_file(fd)
                data = json.dumps({"serial": self.serial, "format": FORMAT, "created": time.time()}).encode()
                if os.write(fd, data) != len(data):
                    raise OSError("short write")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, meta_path)
            self._fsync_dir(self.root)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot write {CARD_FILE}: {exc}") from None

    def _own_file(self, fd: int) -> None:
        """Give a file of the card its mode (whatever the umask) and group."""
        st = os.fstat(fd)
        try:
            if stat.S_IMODE(st.st_mode) != self.file_mode:
                os.fchmod(fd, self.file_mode)
            if self.gid >= 0 and st.st_gid != self.gid:
                os.fchown(fd, -1, self.gid)
        except PermissionError as exc:
            logger.warning("fs card %s: cannot set the mode or group of a file: %s", self.root, exc)

    def _own_dir(self, path: str) -> None:
        st = os.stat(path)
        try:
            if stat.S_IMODE(st.st_mode) & 0o777 != self.dir_mode:
                os.chmod(path, self.dir_mode | (stat.S_IMODE(st.st_mode) & ~0o777 & 0o7000))
            if self.gid >= 0 and st.st_gid != self.gid:
                os.chown(path, -1, self.gid)
        except PermissionError as exc:
            logger.warning("fs card %s: cannot set the mode or group of %s: %s", self.root, path, exc)

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _db_dir(self, db: int) -> str:
        return os.path.join(self.root, f"db{db:03d}")

    def _path(self, db: int, fkey: bytes) -> str:
        dirs = self._db_paths           # a database past num_dbs: a card written with more of them
        return (dirs[db] if db < len(dirs) else os.path.join(self.root, f"db{db:03d}", "")) + fkey.hex()

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

    def _scan_file(self, path: str, fkey: bytes, header: memoryview):
        """(size on disk, mtime, payload length, recorded object size) of a sound object
        file, or what is wrong with it ("bad header", "truncated ..."); gives the file
        the card's mode."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            got = os.preadv(fd, [header], 0)
            if stat.S_ISREG(st.st_mode):
                self._own_file(fd)
        finally:
            os.close(fd)
        parsed = objfmt.read_header(header[:got], fkey) if stat.S_ISREG(st.st_mode) else None
        if parsed is None:
            return "bad header"
        if st.st_size not in _sizes_on_disk(parsed[0]):
            return f"truncated ({st.st_size} bytes for a payload of {parsed[0]})"
        return st.st_size, st.st_mtime, parsed[0], parsed[1]

    def _rebuild_index(self) -> None:
        """Index every object (oldest first). A file whose header does not match its size
        (truncated, corrupt) is removed, and so is every file of an object whose head
        records a size its fragments do not add up to, or that has no head (a fragmented write
        cut short). Leftovers of interrupted writes go."""
        t0 = time.monotonic()
        header = memoryview(bytearray(objfmt.HEADER_CORE))
        groups: dict[bytes, dict[bytes, tuple]] = collections.defaultdict(dict)
        bad = 0
        listing = [(int(name[2:]), os.path.join(self.root, name), os.listdir(os.path.join(self.root, name)))
                   for name in sorted(os.listdir(self.root)) if name.startswith("db") and name[2:].isdigit()]
        with progress.track(f"fs card {self.root}: indexing", sum(len(names) for _, _, names in listing),
                            "files", log=logger) as shown:
            for db, directory, names in listing:
                for name in names:
                    shown.advance()
                    path = os.path.join(directory, name)
                    if name.startswith("."):
                        self._unlink([path])  # a temp file of a write that never finished
                        continue
                    try:
                        fkey = bytes.fromhex(name)
                    except ValueError:
                        continue
                    if len(fkey) <= 2:
                        continue
                    try:
                        info = self._scan_file(path, fkey, header)
                    except OSError:
                        continue
                    if isinstance(info, str):
                        logger.warning("fs card %s: %s is %s; removing it", self.root, path, info)
                        self._unlink([path])
                        bad += 1
                        continue
                    groups[object_key(fkey)][fkey] = (db,) + info
        entries = []
        for okey, parts in groups.items():
            head = parts.get(okey + HEAD_SUFFIX)
            if head is None or (head[4] and not self._complete(okey, parts, head)):
                # no head: a fragmented write cut short (the head goes last); it can never be read
                logger.warning("fs card %s: object %s lacks fragments; removing it", self.root, okey.hex())
                self._unlink([self._path(p[0], fk) for fk, p in parts.items()])
                bad += 1
                continue
            entries.append((max(p[2] for p in parts.values()), okey, parts, head[4] if head else 0))
        entries.sort(key=lambda e: e[0])
        with self._lock:
            self._objects.clear()
            self._tenants.clear()
            self._used = self._files = 0
            for _, okey, parts, total in entries:
                obj = _Object()
                obj.total = total
                for fkey, (db, size, _, _, _) in parts.items():
                    obj.parts[fkey] = (db, size)
                    self._used += size
                    self._tenants.charge(okey, size)
                    self._files += 1
                self._objects[okey] = obj
                self._tenants.enter(okey)
        logger.info("fs card %s (serial %s): %d objects in %d files, %.1f MiB indexed in %.2f s%s",
                    self.root, self.serial, len(entries), self._files, self._used / 2**20,
                    time.monotonic() - t0, f"; {bad} broken removed" if bad else "")

    def _trim_to_quotas(self) -> None:
        """Bring every namespace within its quota (quotas lowered since the card was written):
        its own least recently used objects go."""
        victims: list[str] = []
        with self._lock:
            for tid in self._tenants.quotas:
                n = self._evict_own(tid, 0, b"", victims, pins=False)   # nothing is pinned before serving
                if n:
                    self.evicted += n
                    logger.info("fs card %s: namespace id %s was over its quota; %d objects evicted",
                                self.root, tid.hex(), n)
        self._unlink(victims)

    @staticmethod
    def _complete(okey: bytes, parts: dict, head: tuple) -> bool:
        """Whether the fragments of an object add up to the size its head records."""
        try:
            extents = fragment_extents(head[4], head[3])
        except ValueError:
            return False
        for i, (_, length) in enumerate(extents):
            p = parts.get(okey + i.to_bytes(2, "big"))
            if p is None or p[3] != length:
                return False
        return True

    # ------------------------------------------------------------------ data
    def read(self, db: int, fkey: bytes, buf: memoryview, tag: bytes = b"") -> bool:
        path = self.locate(fkey)
        if path is None:
            return False
        return self.read_result(fkey, path, read_object_file(path, fkey, buf, self.o_direct, self._scratch))

    def locate(self, fkey: bytes) -> Optional[str]:
        """The file of a stored fragment (refreshing its object's LRU place), or None."""
        okey = object_key(fkey)
        with self._lock:
            obj = self._objects.get(okey)
            entry = obj.parts.get(fkey) if obj is not None else None
            if entry is None:
                return None
            self._objects.move_to_end(okey)
            self._tenants.enter(okey)
        return self._path(entry[0], fkey)

    def process_reads(self, fkeys: list[bytes]) -> list:
        """``locate`` of many fragments under one lock (each object's LRU place refreshed once
        per fragment, as ``locate``), a ``FileRead`` each or False where it is not stored."""
        out: list = []
        path, o_direct = self._path, self.o_direct
        with self._lock:
            objects, enter = self._objects, self._tenants.enter
            for fkey in fkeys:
                okey = fkey[:-2]                            # object_key
                obj = objects.get(okey)
                entry = obj.parts.get(fkey) if obj is not None else None
                if entry is None:
                    out.append(False)
                    continue
                objects.move_to_end(okey)
                enter(okey)
                out.append(FileRead(path(entry[0], fkey), fkey, o_direct))
        return out

    def process_read_result(self, task, problem: Optional[str]) -> bool:
        return self.read_result(task.fkey, task.path, problem)

    def read_to_fd(self, db: int, fkey: bytes, length: int, out_fd: int, out_offset: int,
                   write_by: Optional[float] = None) -> bool:
        path = self.locate(fkey)
        if path is None:
            return False
        problem = copy_object_file(path, fkey, length, out_fd, out_offset, self._scratch, write_by)
        if problem == REGION_WRITE_FAILED:
            return False          # the client's buffer refused the bytes; the object is fine
        return self.read_result(fkey, path, problem)

    def read_result(self, fkey: bytes, path: str, problem: Optional[str]) -> bool:
        """Account for the outcome of ``read_object_file`` (here or in an I/O process): a
        missing or bad fragment drops its whole object, so the next PUT stores it again."""
        if problem is None:
            return True
        if problem.startswith("I/O error"):
            logger.warning("fs card %s: read of %s failed: %s", self.root, path, problem)
        else:
            logger.warning("fs card %s: %s is %s; the object is a miss and is removed", self.root, path, problem)
            self._drop_object(object_key(fkey))
        return False

    def write_from_fd(self, db: int, fkey: bytes, length: int, in_fd: int, in_offset: int,
                      object_bytes: int = 0, tag: bytes = b"", read_by: Optional[float] = None) -> bool:
        return self.write(db, fkey, FdSlice(in_fd, in_offset, length, read_by), object_bytes, tag)

    def write(self, db: int, fkey: bytes, buf, object_bytes: int = 0, tag: bytes = b"") -> bool:
        """``buf``: a memoryview, or an ``FdSlice`` of a client's region (``write_from_fd``)."""
        n = len(buf)
        on_disk = HEADER_BYTES + (-(-n // ALIGN) * ALIGN if self.o_direct else n)
        okey = object_key(fkey)
        head = is_head(fkey)
        if not self._reserve(okey, fkey, on_disk):
            return False
        final = self._path(db, fkey)
        with self._lock:
            self._tmp_seq += 1
            tmp = os.path.join(self._db_dir(db), f".{fkey.hex()}.{os.getpid()}.{self._tmp_seq}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.o_direct else 0),
                         self.file_mode)
            try:
                self._own_file(fd)
                write_object_file(fd, fkey, buf, object_bytes if head else 0, self.o_direct, self._scratch)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            if self.fsync:
                os.fsync(self._dir_fds[db])
        except OSError as exc:
            logger.warning("fs card %s: write of %s failed: %s", self.root, final, exc)
            self._unlink([tmp])
            self._unreserve(okey, on_disk)
            return False
        stale = None
        with self._lock:
            obj = self._objects.get(okey)
            if obj is None:
                obj = self._objects[okey] = _Object()
            else:
                self._objects.move_to_end(okey)
            self._tenants.enter(okey)
            old = obj.parts.pop(fkey, None)
            if old is not None:
                self._used -= old[1]
                self._tenants.charge(okey, -old[1])
                if old[0] != db:
                    stale = self._path(old[0], fkey)
            else:
                self._files += 1
            obj.parts[fkey] = (db, on_disk)
            if head:
                obj.total = object_bytes
        if stale:
            self._unlink([stale])
        return True

    def _drop_object(self, okey: bytes) -> bool:
        """Forget every fragment of an object and remove its files (head first)."""
        with self._lock:
            paths = self._take(okey)
        if paths is None:
            return False
        self._unlink(paths)
        return True

    def _take(self, okey: bytes) -> Optional[list[str]]:
        """(lock held) Take an object out of the index; its files, head first."""
        obj = self._objects.pop(okey, None)
        if obj is None:
            return None
        self._tenants.forget(okey, sum(size for _, size in obj.parts.values()))
        paths = []
        for fkey, (db, size) in obj.parts.items():
            self._used -= size
            self._files -= 1
            path = self._path(db, fkey)
            if is_head(fkey):
                paths.insert(0, path)
            else:
                paths.append(path)
        return paths

    @staticmethod
    def _unlink(paths) -> None:
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    # ------------------------------------------------------------------ capacity
    def _reserve(self, okey: bytes, fkey: bytes, nbytes: int) -> bool:
        """Account ``nbytes`` for a new file, evicting least recently used objects (whole)
        if needed; never the object being written nor a pinned one. A namespace over its
        quota evicts its own objects first (its own LRU) and is refused if that is not enough."""
        victims: list[str] = []
        evicted = 0
        with self._lock:
            obj = self._objects.get(okey)
            old = obj.parts.get(fkey) if obj is not None else None
            freed_by_overwrite = old[1] if old else 0
            tid = tenant_of(okey)
            evicted += self._evict_own(tid, nbytes - freed_by_overwrite, okey, victims)
            if self._tenants.over_by(tid, nbytes - freed_by_overwrite):
                self.evicted += evicted
                logger.warning("fs card %s: namespace id %s is at its quota (the rest pinned): not storing",
                               self.root, tid.hex())
                ok = False
            else:
                ok = self._reserve_capacity(okey, nbytes, freed_by_overwrite, victims, evicted)
        self._unlink(victims)
        return ok

    def _evict_own(self, tid: bytes, nbytes: int, keep: bytes, victims: list[str], pins: bool = True) -> int:
        """(lock held) Evict namespace ``tid``'s least recently used objects (never ``keep``
        nor a pinned one) until it can take ``nbytes`` more within its quota; their files go
        to ``victims``. How many objects were evicted."""
        evicted = 0
        if not self._tenants.over_by(tid, nbytes):
            return 0
        for key in self._tenants.oldest(tid):
            if not self._tenants.over_by(tid, nbytes):
                break
            if key == keep or (pins and self.is_pinned(key[:KEY_BYTES])):
                continue
            paths = self._take(key)
            if paths is not None:
                victims.extend(paths)
                self._tenants.count_eviction(tid)
                evicted += 1
        return evicted

    def _reserve_capacity(self, okey: bytes, nbytes: int, freed_by_overwrite: int, victims: list[str],
                          evicted: int) -> bool:
        """(lock held) The card's own capacity: evict least recently used objects of any
        namespace past the watermark, down to (watermark - ratio)."""
        high = self.capacity_bytes * self.watermark
        ok = True
        if self._used + nbytes - freed_by_overwrite > high:
            target = self.capacity_bytes * (self.watermark - self.ratio) - nbytes + freed_by_overwrite
            for key in list(self._objects.keys()):
                if self._used <= target:
                    break
                if key == okey or self.is_pinned(key[:KEY_BYTES]):
                    continue
                victims.extend(self._take(key))
                self._tenants.count_eviction(tenant_of(key), over_quota=False)
                evicted += 1
            if self._used + nbytes - freed_by_overwrite > self.capacity_bytes:
                logger.warning("fs card %s is full (%d of %d bytes, the rest pinned): not storing",
                               self.root, self._used, self.capacity_bytes)
                ok = False
        if ok:
            self._used += nbytes
            self._tenants.charge(okey, nbytes)
        self.evicted += evicted
        return ok

    def _unreserve(self, okey: bytes, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            self._tenants.charge(okey, -nbytes)

    # ------------------------------------------------------------------ admin
    def contains_many(self, items, lengths=None, tags=None):
        out = []
        with self._lock:
            for k, (_, fkey) in enumerate(items):
                obj = self._objects.get(object_key(fkey))
                entry = obj.parts.get(fkey) if obj is not None else None
                n = lengths[k] if lengths is not None else None
                out.append(entry is not None and (n is None or entry[1] in _sizes_on_disk(n)))
        return out

    def object_sizes(self, heads, tags=None):
        out: list[Optional[int]] = []
        with self._lock:
            for _, fkey in heads:
                obj = self._objects.get(object_key(fkey))
                out.append(obj.total if obj is not None and fkey in obj.parts else None)
        return out

    def delete(self, db: int, fkey: bytes, tag: bytes = b"") -> bool:
        """Remove the fragment's whole object; True if any of it was stored."""
        return self._drop_object(object_key(fkey))

    def clean(self) -> int:
        with self._lock:
            paths = [self._path(db, fkey) for obj in self._objects.values() for fkey, (db, _) in obj.parts.items()]
            self._objects.clear()
            self._tenants.clear()
            self._used = self._files = 0
        with progress.track(f"fs card {self.root}: cleaning", len(paths), "files", log=logger) as shown:
            for path in paths:
                self._unlink((path,))
                shown.advance()
        logger.info("fs card %s: cleaned, %d objects removed", self.root, len(paths))
        return len(paths)

    def usage(self) -> CardUsage:
        with self._lock:
            return CardUsage(self._used, self.capacity_bytes, self._files)

    def details(self) -> dict:
        return {"path": self.root}

    def tenant_usage(self) -> list[TenantUsage]:
        with self._lock:
            return self._tenants.usage()

    def check(self) -> bool:
        try:
            with open(os.path.join(self.root, CARD_FILE), encoding="utf-8") as fh:
                return json.load(fh).get("serial") == self.serial and os.access(self.root, os.W_OK)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        fds, self._dir_fds = self._dir_fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
