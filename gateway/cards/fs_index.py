"""The fs card's index: which objects the card holds, in which files, and which go first.

Contract (``FsIndex``):

- **What it holds.** One entry per object: its fragment files (fragment key -> database,
  bytes on disk) and the object size its head records (0: unknown). Objects are kept in
  least-recently-used order, card-wide and per namespace (``TenantBook``: bytes, LRU and
  quota of each namespace).
- **Accounting.** ``used`` is the bytes on disk of every indexed file plus the bytes reserved
  by writes in flight; ``files`` counts indexed files. A write ``reserve``s its bytes first
  (which may evict whole objects), then ``commit``s its file once it is renamed into place,
  or ``unreserve``s them when it failed.
- **Eviction.** Whole objects only, least recently used first, never the object being
  written nor a pinned one (``is_pinned(object key[:KEY_BYTES])``). A namespace over its
  quota evicts its own objects first and is refused when that is not enough; the card past
  ``watermark`` of its capacity evicts any namespace's objects down to
  ``watermark - ratio``.
- **Locking and I/O.** Every method takes the index's own lock; none touches a file except
  ``rebuild`` (the scan of the directory at start, before the card serves). A method that
  drops objects returns their files' paths (head first) and the caller unlinks them after
  the lock is released: an object leaves the index before its files go, so a reader that
  still holds a path finds the file gone ("missing", a miss), never another object's bytes.
- **Verdicts.** ``locate`` hands out a fragment's entry (a tuple made by each ``commit``,
  compared by identity); a failed read drops the object with ``drop_if(fkey, entry)``, which
  does nothing once the fragment was stored again (evicted and re-stored, or moved to another
  database): a stale verdict never removes a newer, acknowledged store.
- **Files.** The index stores databases, not paths: ``path_of(db, fragment key)`` is the
  card's reference of a file (``fs_files.FileRef``: its database's descriptor and name),
  what the methods that drop objects return, for ``fs_files.unlink_all``.
- **Writes.** Each object records its head's write id (``commit``; ``heads``), and
  ``rebuild`` removes an object whose fragments carry different write ids (an overwrite
  cut short by a crash: a torn object).
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import threading
import time
from typing import Callable, Optional

from adpkv_core.keys import KEY_BYTES

from .. import progress
from ..fragments import fragment_extents
from ..quotas import TenantBook, TenantUsage, tenant_of
from . import objfmt
from .base import Head, is_head, object_key
from .fs_files import READ_FLAGS, FileRef, unlink_all
from .objfile import ALIGN, HEADER_BYTES

logger = logging.getLogger("adpkv.gateway.fs")

HEAD_SUFFIX = b"\0\0"


def sizes_on_disk(n: int) -> tuple[int, int]:
    """The sizes a file of ``n`` payload bytes may have (page cache, O_DIRECT padding)."""
    return HEADER_BYTES + n, HEADER_BYTES + -(-n // ALIGN) * ALIGN


Entry = tuple[int, int]      # a fragment's file: (database, bytes on disk); a new tuple each commit


class _Object:
    """The fragment files of one object in the index."""

    __slots__ = ("parts", "total", "write_id")

    def __init__(self):
        self.parts: dict[bytes, Entry] = {}               # fragment key -> (db, bytes on disk)
        self.total = 0                                   # object size its head records (0: unknown)
        self.write_id = 0                                # the write id its head carries


class FsIndex:
    """The in-memory index of one fs card (see the module's contract)."""

    def __init__(self, root: str, path_of: Callable[[int, bytes], str], capacity_bytes: int = 0,
                 watermark: float = 0.95, ratio: float = 0.10,
                 is_pinned: Callable[[bytes], bool] = lambda key: False,
                 quotas: Optional[dict[bytes, int]] = None):
        self.root = root                       # for log lines
        self.path_of = path_of
        self.capacity_bytes = capacity_bytes
        self.watermark = watermark
        self.ratio = ratio
        self.is_pinned = is_pinned
        self.evicted = 0                       # objects evicted (quota or capacity) since start
        self._lock = threading.Lock()
        self._objects: "collections.OrderedDict[bytes, _Object]" = collections.OrderedDict()
        self._files = 0
        self._used = 0
        self._tenants = TenantBook(quotas)

    # ------------------------------------------------------------------ lookups
    def locate(self, fkey: bytes) -> Optional[Entry]:
        """The index entry of a stored fragment, ``(database, bytes on disk)`` (refreshing its
        object's LRU place), or None. The entry is the file the caller is handed: its failed
        read's verdict goes to ``drop_if`` with it."""
        okey = object_key(fkey)
        with self._lock:
            obj = self._objects.get(okey)
            entry = obj.parts.get(fkey) if obj is not None else None
            if entry is None:
                return None
            self._objects.move_to_end(okey)
            self._tenants.enter(okey)
        return entry

    def locate_many(self, fkeys: list[bytes]) -> list[Optional[Entry]]:
        """``locate`` of many fragments under one lock."""
        out: list[Optional[Entry]] = []
        with self._lock:
            objects, enter = self._objects, self._tenants.enter
            for fkey in fkeys:
                okey = fkey[:-2]                            # object_key
                obj = objects.get(okey)
                entry = obj.parts.get(fkey) if obj is not None else None
                if entry is None:
                    out.append(None)
                    continue
                objects.move_to_end(okey)
                enter(okey)
                out.append(entry)
        return out

    def contains_many(self, fkeys: list[bytes], lengths: Optional[list[Optional[int]]] = None) -> list[bool]:
        """Whether each fragment is indexed (with ``lengths``: holding that many payload bytes)."""
        out = []
        with self._lock:
            for k, fkey in enumerate(fkeys):
                obj = self._objects.get(object_key(fkey))
                entry = obj.parts.get(fkey) if obj is not None else None
                n = lengths[k] if lengths is not None else None
                out.append(entry is not None and (n is None or entry[1] in sizes_on_disk(n)))
        return out

    def heads(self, heads: list[bytes]) -> list[Optional[Head]]:
        """What each head fragment records (object size, write id), None where it is not indexed."""
        out: list[Optional[Head]] = []
        with self._lock:
            for fkey in heads:
                obj = self._objects.get(object_key(fkey))
                out.append(Head(obj.total, obj.write_id) if obj is not None and fkey in obj.parts else None)
        return out

    def usage(self) -> tuple[int, int]:
        """(bytes used, files)."""
        with self._lock:
            return self._used, self._files

    def tenant_usage(self) -> list[TenantUsage]:
        with self._lock:
            return self._tenants.usage()

    # ------------------------------------------------------------------ writes
    def reserve(self, okey: bytes, fkey: bytes, nbytes: int) -> tuple[bool, list[str]]:
        """Account ``nbytes`` for a new file of ``fkey``, evicting least recently used objects
        (whole) if needed. (whether it may be written, files of the evicted objects)."""
        victims: list[str] = []
        with self._lock:
            obj = self._objects.get(okey)
            old = obj.parts.get(fkey) if obj is not None else None
            freed_by_overwrite = old[1] if old else 0
            tid = tenant_of(okey)
            evicted = self._evict_own(tid, nbytes - freed_by_overwrite, okey, victims)
            if self._tenants.over_by(tid, nbytes - freed_by_overwrite):
                self.evicted += evicted
                logger.warning("fs card %s: namespace id %s is at its quota (the rest pinned): not storing",
                               self.root, tid.hex())
                return False, victims
            return self._reserve_capacity(okey, nbytes, freed_by_overwrite, victims, evicted), victims

    def unreserve(self, okey: bytes, nbytes: int) -> None:
        """A reserved write did not happen."""
        with self._lock:
            self._used -= nbytes
            self._tenants.charge(okey, -nbytes)

    def commit(self, fkey: bytes, db: int, on_disk: int, object_bytes: int, write_id: int = 0) -> Optional[FileRef]:
        """A reserved file of ``on_disk`` bytes is in place in database ``db``: index it (its
        object last in the LRU). ``object_bytes`` and ``write_id``: what a head records. The
        fragment's previous file when it was in another database (to be removed), else None."""
        okey = object_key(fkey)
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
                    stale = self.path_of(old[0], fkey)
            else:
                self._files += 1
            obj.parts[fkey] = (db, on_disk)
            if is_head(fkey):
                obj.total = object_bytes
                obj.write_id = write_id
        return stale

    # ------------------------------------------------------------------ removal
    def drop(self, okey: bytes) -> Optional[list[str]]:
        """Take an object out of the index; its files (head first), or None if not indexed."""
        with self._lock:
            return self._take(okey)

    def drop_if(self, fkey: bytes, entry: Entry) -> Optional[list[str]]:
        """``drop`` of the fragment's object only while the index still holds ``entry`` (what
        ``locate`` handed a reader) for it: a read's verdict is about that file. None when the
        object is gone or the fragment was stored again since (a newer, acknowledged file:
        the object stays)."""
        okey = object_key(fkey)
        with self._lock:
            obj = self._objects.get(okey)
            if obj is None or obj.parts.get(fkey) is not entry:
                return None
            return self._take(okey)

    def drop_all(self) -> list[str]:
        """Empty the index (quotas and eviction counts stay); every file it held."""
        with self._lock:
            paths = [self.path_of(db, fkey) for obj in self._objects.values() for fkey, (db, _) in obj.parts.items()]
            self._objects.clear()
            self._tenants.clear()
            self._used = self._files = 0
        return paths

    def trim_to_quotas(self) -> list[str]:
        """Bring every namespace within its quota (quotas lowered since the card was written):
        its own least recently used objects go (nothing is pinned before serving). Their files."""
        victims: list[str] = []
        with self._lock:
            for tid in self._tenants.quotas:
                n = self._evict_own(tid, 0, b"", victims, pins=False)
                if n:
                    self.evicted += n
                    logger.info("fs card %s: namespace id %s was over its quota; %d objects evicted",
                                self.root, tid.hex(), n)
        return victims

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
            path = self.path_of(db, fkey)
            if is_head(fkey):
                paths.insert(0, path)
            else:
                paths.append(path)
        return paths

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

    # ------------------------------------------------------------------ rebuild at start
    def rebuild(self, db_dirs: dict[int, tuple[int, str]], own_file: Callable[[int], None]) -> None:
        """Index every object file of the databases ``db_dirs`` (db -> its directory's
        descriptor, checked by the card, and its path for messages; oldest first), checking
        each file's header against its size. A file that does not match (truncated, corrupt,
        not a regular file) is removed, and so is every file of an object whose head records
        a size its fragments do not add up to, whose fragments carry other write ids than
        its head (an overwrite cut short), or that has no head (a fragmented write cut
        short). Leftovers of interrupted writes (dot files) go. Every file is opened and
        removed relative to its directory's descriptor, without following a symlink.
        ``own_file(fd)`` gives each file the card's mode and group."""
        t0 = time.monotonic()
        header = memoryview(bytearray(objfmt.HEADER_CORE))
        groups: dict[bytes, dict[bytes, tuple]] = collections.defaultdict(dict)
        bad = 0
        listing = [(db, fd, directory, os.listdir(fd)) for db, (fd, directory) in sorted(db_dirs.items())]
        with progress.track(f"fs card {self.root}: indexing", sum(len(names) for *_, names in listing),
                            "files", log=logger) as shown:
            for db, dir_fd, directory, names in listing:
                for name in names:
                    shown.advance()
                    path = os.path.join(directory, name)
                    if name.startswith("."):
                        unlink_all([FileRef(dir_fd, name)])  # a temp file of a write that never finished
                        continue
                    try:
                        fkey = bytes.fromhex(name)
                    except ValueError:
                        continue
                    if len(fkey) <= 2:
                        continue
                    try:
                        info = _scan_file(dir_fd, name, fkey, header, own_file)
                    except OSError:
                        info = "not a file of the card (a symlink?)"
                    if isinstance(info, str):
                        logger.warning("fs card %s: %s is %s; removing it", self.root, path, info)
                        unlink_all([FileRef(dir_fd, name)])
                        bad += 1
                        continue
                    groups[object_key(fkey)][fkey] = (db,) + info
        entries = []
        for okey, parts in groups.items():
            head = parts.get(okey + HEAD_SUFFIX)
            torn = head is not None and any(p[5] != head[5] for p in parts.values())
            if head is None or torn or (head[4] and not _complete(okey, parts, head)):
                # no head: a fragmented write cut short (the head goes last); it can never be read
                logger.warning("fs card %s: object %s %s; removing it", self.root, okey.hex(),
                               "is torn (fragments of different writes)" if torn else "lacks fragments")
                unlink_all([self.path_of(p[0], fk) for fk, p in parts.items()])
                bad += 1
                continue
            entries.append((max(p[2] for p in parts.values()), okey, parts, head[4], head[5]))
        entries.sort(key=lambda e: e[0])
        with self._lock:
            self._objects.clear()
            self._tenants.clear()
            self._used = self._files = 0
            for _, okey, parts, total, write_id in entries:
                obj = _Object()
                obj.total, obj.write_id = total, write_id
                for fkey, (db, size, *_) in parts.items():
                    obj.parts[fkey] = (db, size)
                    self._used += size
                    self._tenants.charge(okey, size)
                    self._files += 1
                self._objects[okey] = obj
                self._tenants.enter(okey)
        logger.info("fs card %s: %d objects in %d files, %.1f MiB indexed in %.2f s%s",
                    self.root, len(entries), self._files, self._used / 2**20,
                    time.monotonic() - t0, f"; {bad} broken removed" if bad else "")


def _scan_file(dir_fd: int, name: str, fkey: bytes, header: memoryview, own_file: Callable[[int], None]):
    """(size on disk, mtime, payload length, recorded object size, write id) of a sound
    object file, or what is wrong with it ("bad header", "truncated ..."); gives the file
    the card's mode. Raises ``OSError`` for a name that is no file (a symlink: ELOOP)."""
    fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        got = os.preadv(fd, [header], 0)
        if stat.S_ISREG(st.st_mode):
            own_file(fd)
    finally:
        os.close(fd)
    parsed = objfmt.read_header(header[:got], fkey) if stat.S_ISREG(st.st_mode) else None
    if parsed is None:
        return "bad header"
    if st.st_size not in sizes_on_disk(parsed[0]):
        return f"truncated ({st.st_size} bytes for a payload of {parsed[0]})"
    return st.st_size, st.st_mtime, parsed.payload_len, parsed.object_bytes, parsed.write_id


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
