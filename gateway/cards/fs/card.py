"""The fs card: a directory on a local NVMe drive (or a mounted remote one).

Layout::

    DIR/adpkv-card.json          serial number and format of the card
    DIR/db007/                   a database: up to 256 subdirectories "00" .. "ff" (each made
                                 at the first write into it)
    DIR/db007/3f/<fragment key hex>  one file per fragment (its subdirectory: byte 9 of the
                                 key, ``fs_files.subdir_of``): a 4 KiB header, then the payload
    DIR/namespaces/<16 hex>      the owner (uid) of a key namespace (``claim_namespace``)

The header carries the fragment's key, payload length, the object's size (head
fragment) and xxh3 checksums of the payload and of itself, so a truncated,
corrupt or foreign file is a miss. Writes go to a temporary file that is renamed
into place (atomic against a crash of the gateway; with ``fsync`` the file and
then its directory are fsynced, so also against power loss). The index (object
→ its fragment files and sizes, in LRU order of objects; ``fs_index``, with its
contract) is rebuilt from the directory at start by a scan that checks every
file's header against its size; the card serves while it runs (``SCAN_FOREGROUND_S``:
a small card is indexed whole before it serves), and leaves no object file it did not index
(``fs_scan.sweep``). An object lives and dies whole: eviction, delete and a failed read
drop all its fragment files (head first).

Removals (issue 40): every removal (eviction, the trim at start, quotas, DELETE and so the
mover, CLEAN, a read's verdict, the scan) unlinks a file through ``_remove``: under the
lock of the file's object (``_stripe``), only when the index does not hold that file at that
moment (``FsIndex.holds``). A write renames its file into place and commits it to the index
under that same lock, so a removal chosen before a new write of the key and run after it
never takes the new write's file: it removes the write it chose, and what a PUT answered
stored stays whole. With ``o_direct`` the page cache is bypassed and I/O goes
straight between the file and the ring. Files are 0600 and directories 0700
(0640/0750 and the ``card_group`` group when one is set).

Safety (``fs_files``): the card directory, every ``dbNNN`` and every subdirectory of one (checked at
open, or when the card makes it) must be the gateway's own
(owned by its uid, writable by nobody else) or the card is refused; every file is
reached relative to a checked directory descriptor with ``O_NOFOLLOW``, temporary files
are created with ``O_EXCL``, modes are set on descriptors. Only evidence about an object
(its file gone, a bad header, checksum or size) drops it; a transient failure (EMFILE,
ENOMEM, ...) or an I/O error is a miss that removes nothing (``base.Read``).
"""

from __future__ import annotations

import errno
import grp
import json
import logging
import os
import stat
import threading
import time
import uuid
import zlib
from typing import Callable, Iterator, Optional

from adpkv_core.keys import KEY_BYTES

from adpkv_gateway.observe import progress
from adpkv_gateway.cards.quotas import TenantUsage

from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.base import (
    Card, CardError, CardIOError, CardUsage, DirectReads, DirectWrites, DropsItself, FileRead, FirstExtent,
    HandsFiles, Head, HeadsFound, IOProcessReads, Listed, NoProcessRead, PlacedFile, ProcessRead, Read,
    claim_record, parse_claim
)
from adpkv_gateway.cards.fragments import is_head, object_key
from adpkv_gateway.cards.fs.files import (
    CREATE_FLAGS, DIR_FLAGS, READ_FLAGS, SUBDIR_NAMES, FileRef, check_file, object_name, open_dir, open_root,
    own_dir, subdir_of, unlink_all, verdict_of
)
from adpkv_gateway.cards.fs import scan as fs_scan
from adpkv_gateway.cards.fs.index import FKEY_BYTES, TRIM_CHUNK, Entry, FileOf, FsIndex
from adpkv_gateway.cards.fs.rows import give_back_heap
from adpkv_gateway.cards.objfile import (
    ALIGN, HEADER_BYTES, FdSlice, Scratch, copy_object_file, read_object_file, write_object_file
)

logger = logging.getLogger("adpkv.gateway.fs")

FORMAT = 3          # 3: files in 256 subdirectories of each database; 2: flat databases; 1: no write ids
CARD_FILE = "adpkv-card.json"
CARD_FILE_TMP = ".adpkv-card.json.tmp"


def read_only(root: str) -> CardError:
    """The one refusal of a card on a read-only file system (say, remounted read-only after an
    error): named as such, never as a file that cannot be removed or opened."""
    return CardError(f"fs card {root}: read-only file system (a card must be writable: remount it "
                     "read-write, or give the gateway another card)")
PROBE = ".odirect-probe"
SNAPSHOT_FILE = ".adpkv-index"   # the index at the last clean stop (FsIndex.save)
LEFTOVERS = (CARD_FILE + ".tmp", CARD_FILE_TMP, PROBE, SNAPSHOT_FILE + ".tmp")   # of the card's own atomic writes
TRANSIENT_LOG_S = 10.0       # transient read failures (EMFILE, ...) are logged at most this often
SCAN_FOREGROUND_S = 0.5      # open() waits this long for the scan: a small card serves whole
CLAIMS_DIR = "namespaces"      # one file per claimed key namespace (Card.claim_namespace)
CLAIM_LEFTOVER_S = 600         # a claim's temporary file older than this was left by a crash
STRIPES = 256                  # object locks (``_stripe``): a write's rename and commit, a removal's check and unlink


def _group_id(name: str) -> int:
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise CardError(f"card_group {name!r} is not a group of this host") from None


class FsCard(Card, DirectReads, DirectWrites, HandsFiles, IOProcessReads, DropsItself):
    """A card that is a directory of object files."""

    kind = "fs"

    def __init__(self, device: str, num_dbs: int = 16, capacity_bytes: int = 0,
                 eviction_watermark: float = 0.95, eviction_ratio: float = 0.10,
                 o_direct: bool = False, fsync: bool = False,
                 is_pinned: Callable[[bytes], bool] = lambda key: False, card_group: str = "",
                 quotas: Optional[dict[bytes, int]] = None):
        super().__init__(device)
        self.root = os.path.abspath(device)
        self.num_dbs = num_dbs
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self.card_group = card_group
        self.gid = -1                                  # -1: files keep the gateway's group
        self.file_mode, self.dir_mode = (0o640, 0o750) if card_group else (0o600, 0o700)
        self._lock = threading.Lock()                  # the temporary names' sequence
        self._stripes = [threading.RLock() for _ in range(STRIPES)]   # by object key (``_stripe``)
        self._scratch = Scratch()
        self._tmp_seq = 0
        self._tmp_tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._root_fd = -1                             # the card's directory, checked (fs_files)
        self._db_fds: dict[int, int] = {}              # db -> its directory's descriptor, checked
        self._db_refs: dict[int, str] = {}             # db -> that descriptor as an I/O process opens it
        self._subdirs: set[tuple[int, str]] = set()    # (db, subdirectory) checked (_check_subdir)
        self._subdirs_lock = threading.Lock()
        self._transient_logged = 0.0
        self._claims_fd: Optional[int] = None          # DIR/namespaces, opened at the first claim lookup
        self._claims_lock = threading.Lock()
        # objects, their files, LRU, bytes used and quotas (fs_index: its contract)
        self.index = FsIndex(self.root, self._ref, capacity_bytes, eviction_watermark, eviction_ratio,
                             is_pinned, quotas, num_dbs)
        self._auto_capacity = capacity_bytes <= 0      # the free space at start (learnt again after the scan)
        self._scan_thread: Optional[threading.Thread] = None
        self._scan_stop = threading.Event()
        self.scanned = threading.Event()               # the scan at start has indexed every file

    # ------------------------------------------------------------------ setup
    def open(self) -> None:
        """Open the card's directory and its databases, each checked to be the gateway's own
        (``fs_files.own_dir``; a ``CardError`` names one that is not) and reached by
        descriptor from then on; read or create ``adpkv-card.json``; index the objects."""
        if self.card_group:
            self.gid = _group_id(self.card_group)
        try:
            self._root_fd = open_root(self.root, self.dir_mode)
            own_dir(self._root_fd, self.root, self.dir_mode, self.gid)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot create the directory: {exc}") from None
        if os.fstatvfs(self._root_fd).f_flag & os.ST_RDONLY:
            raise read_only(self.root)
        self._remove_leftovers()
        names = os.listdir(self._root_fd)
        if CARD_FILE in names:
            meta = self._read_card_file(own=True)
            self.serial = str(meta["serial"])
            if meta.get("format") != FORMAT:
                raise CardError(f"fs card {self.root} was written in format {meta.get('format')}; this gateway "
                                f"reads format {FORMAT} only (files in 256 subdirectories of each database, object "
                                "headers with write ids). Its objects are a cache the engines store again: give "
                                "the card an empty directory, or remove this one's contents")
        else:
            if any(not n.startswith(".") for n in names):
                raise CardError(f"fs card {self.root}: the directory holds other files and no {CARD_FILE}; "
                                "give the card an empty or new directory")
            self.serial = "FS" + uuid.uuid4().hex[:14].upper()
            self._write_card_file()
        try:
            present = {int(n[2:]) for n in names if n.startswith("db") and n[2:].isdigit() and len(n) == 5}
            for db in sorted(present | set(range(self.num_dbs))):
                path = self._db_dir(db)
                fd = self._db_fds[db] = open_dir(self._root_fd, f"db{db:03d}", path, self.dir_mode, create=True)
                own_dir(fd, path, self.dir_mode, self.gid)
                for sub in sorted(set(os.listdir(fd)) & set(SUBDIR_NAMES)):
                    self._check_subdir(db, sub)
                self._db_refs[db] = f"/proc/{os.getpid()}/fd/{fd}"
            if self.fsync:
                os.fsync(self._root_fd)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot prepare its databases: {exc}") from None
        if self.o_direct and not self._probe_o_direct():
            logger.warning("fs card %s: the file system refuses O_DIRECT; using the page cache", self.root)
            self.o_direct = False
        if self._auto_capacity:
            self.index.capacity_bytes = self._free_bytes()
        self._start_scan(self._load_snapshot())
        logger.info("fs card %s (serial %s): capacity %.1f MiB", self.root, self.serial, self.capacity_bytes / 2**20)

    def _check_subdir(self, db: int, sub: str, create: bool = False) -> bool:
        """Make sure object subdirectory ``sub`` of database ``db`` is the gateway's own
        (``own_dir``, opened without following a symlink; ``create``: made first, mode as the
        databases', when missing) before any of its files is used (``fs_files``: why that
        holds). Every subdirectory present at open is checked there; a missing one is made at
        the first write into it, so a new card serves at once. Whether it is there (checked)."""
        if (db, sub) in self._subdirs:
            return True
        with self._subdirs_lock:
            if (db, sub) in self._subdirs:
                return True
            db_fd, where = self._db_fds[db], os.path.join(self._db_dir(db), sub)
            try:
                fd = open_dir(db_fd, sub, where, self.dir_mode, create=create)
            except FileNotFoundError:
                return False
            try:
                own_dir(fd, where, self.dir_mode, self.gid)
            finally:
                os.close(fd)
            if create and self.fsync:
                os.fsync(db_fd)
            self._subdirs.add((db, sub))
            return True

    def _stamps(self) -> dict[str, int]:
        """The modification time (ns) of each database directory and of each of its
        subdirectories (by the database's checked descriptor): what a snapshot is checked
        against (a file created, renamed or removed changes its directory's)."""
        stamps = {}
        for db, fd in sorted(self._db_fds.items()):
            stamps[f"db{db:03d}"] = os.fstat(fd).st_mtime_ns
            for sub in SUBDIR_NAMES:
                try:
                    stamps[f"db{db:03d}/{sub}"] = os.stat(sub, dir_fd=fd, follow_symlinks=False).st_mtime_ns
                except FileNotFoundError:           # none written yet (made at the first write)
                    continue
        return stamps

    def _free_bytes(self) -> int:
        """The bytes free for the gateway on the card's file system."""
        vfs = os.statvfs(self._root_fd)
        return vfs.f_bavail * vfs.f_frsize

    def _load_snapshot(self) -> bool:
        """The index from the snapshot of the last clean stop, when it still matches the
        files (``FsIndex.load``); the snapshot is removed either way (a crash after this start
        must not find it). Whether it was taken (then each object's files are checked against
        it in the background, ``fs_scan.verify``, instead of a scan)."""
        problem = self.index.load(self._root_fd, SNAPSHOT_FILE, self.serial, self._stamps())
        unlink_all([FileRef(self._root_fd, SNAPSHOT_FILE)])
        if problem is not None:
            if problem != "none":
                logger.warning("fs card %s: index snapshot ignored: %s; scanning the files", self.root, problem)
            return False
        used, files = self.index.usage()
        logger.info("fs card %s: %d objects in %d files, %.1f MiB from the index snapshot",
                    self.root, self.index.objects(), files, used / 2**20)
        return True

    def _start_scan(self, from_snapshot: bool) -> None:
        """Index the card's files on a thread (``fs_scan.scan``), or check the snapshot's
        index against them (``fs_scan.verify``); wait ``SCAN_FOREGROUND_S`` for it, then serve
        while it runs."""
        self.index.begin_scan()
        started = time.time()
        self._scan_thread = threading.Thread(target=self._scan, args=(started, from_snapshot), name="adpkv-fs-scan",
                                             daemon=True)
        self._scan_thread.start()
        self.scanned.wait(SCAN_FOREGROUND_S)
        if not self.scanned.is_set():
            logger.info("fs card %s: serving while its files are indexed", self.root)

    def _scan(self, started: float, from_snapshot: bool) -> None:
        try:
            if from_snapshot:
                done = fs_scan.verify(self.index, self._own_file, self._remove, started, self._scan_stop)
            else:
                done = fs_scan.scan(self.index, self._walk, self._own_file, self._remove, started, self._scan_stop)
            if done is None or fs_scan.sweep(self.index, self._walk, self._own_file, self._remove, started,
                                             self._scan_stop) is None:
                return
            self.index.end_scan()
            if self._auto_capacity:
                self.index.capacity_bytes = self._free_bytes() + self.index.usage()[0]
            self._trim()
            give_back_heap()
        except Exception:                              # the card serves on; what is not indexed is a miss
            logger.exception("fs card %s: the scan of its files failed", self.root)
        finally:
            self.scanned.set()

    def _trim(self) -> None:
        """Bring the card within its capacity and quotas after the scan, in steps of
        ``TRIM_CHUNK`` objects (``FsIndex.trim``: the index's lock is given up between steps,
        so requests are answered meanwhile), removing each step's files before the next."""
        before = self.index.evicted
        over = self.index.over()
        with progress.track(f"fs card {self.root}: trimming", over, "bytes", log=logger) as shown:
            while not self._scan_stop.is_set():
                victims = self.index.trim(TRIM_CHUNK)
                if not victims:
                    break
                self._remove(victims)        # out of the index already: a stop leaves them to a later scan
                shown.set(max(shown.done, over - self.index.over()))
        if self.index.evicted > before:
            # a warning: objects a client stored are gone (the capacity or a quota shrank, or,
            # with the capacity taken from the disk, other files filled the file system)
            logger.warning("fs card %s: trimmed to its capacity (%.1f MiB%s) and quotas, %d objects evicted",
                           self.root, self.index.capacity_bytes / 2**20,
                           f": the file system's free space, {self._free_bytes() / 2**20:.1f} MiB now, plus what "
                           "the card holds" if self._auto_capacity else "", self.index.evicted - before)

    def _walk(self):
        """(database, its subdirectory's descriptor, name) of every entry of the card's
        databases' subdirectories (each opened by its database's checked descriptor without
        following a symlink, listed, closed once its entries were handed out)."""
        for db, fd in sorted(self._db_fds.items()):
            for sub in SUBDIR_NAMES:
                try:
                    if not self._check_subdir(db, sub):
                        continue                    # none written yet
                    sub_fd = os.open(sub, DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    logger.warning("fs card %s: cannot open %s: %s", self.root, os.path.join(self._db_dir(db), sub),
                                   exc)
                    continue
                try:
                    names = os.listdir(sub_fd)
                    for name in names:
                        yield db, sub_fd, name
                except OSError as exc:
                    logger.warning("fs card %s: cannot list %s: %s", self.root, os.path.join(self._db_dir(db), sub),
                                   exc)
                finally:
                    os.close(sub_fd)

    def _remove_leftovers(self) -> None:
        """Remove what an interrupted atomic write of the card itself left in its directory
        (a crash during the first start; by descriptor, a symlink as a link): never a reason
        to refuse the card."""
        for name in LEFTOVERS:
            try:
                os.unlink(name, dir_fd=self._root_fd)
                logger.info("fs card %s: removed %s left by an interrupted start", self.root, name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CardError(f"fs card {self.root}: cannot remove the leftover {name}: {exc}") from None

    def _read_card_file(self, own: bool = False) -> dict:
        """``adpkv-card.json``, opened without following a symlink and checked to be the
        gateway's own file (``own``: given the card's mode and group, at open)."""
        path = os.path.join(self.root, CARD_FILE)
        try:
            fd = os.open(CARD_FILE, READ_FLAGS, dir_fd=self._root_fd)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: unreadable {CARD_FILE} (a symlink is refused): {exc}") from None
        try:
            check_file(fd, path)
            with os.fdopen(fd, encoding="utf-8", closefd=False) as fh:
                meta = json.load(fh)
            if own:
                self._own_file(fd)
            str(meta["serial"])
            return meta
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CardError(f"fs card {self.root}: unreadable {CARD_FILE}: {exc}") from None
        finally:
            os.close(fd)

    def _write_card_file(self) -> None:
        """Create ``adpkv-card.json`` atomically and durably (file, then directory, fsynced)."""
        try:
            fd = os.open(CARD_FILE_TMP, CREATE_FLAGS, self.file_mode, dir_fd=self._root_fd)
            try:
                self._own_file(fd)
                data = json.dumps({"serial": self.serial, "format": FORMAT, "created": time.time()}).encode()
                if os.write(fd, data) != len(data):
                    raise OSError("short write")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(CARD_FILE_TMP, CARD_FILE, src_dir_fd=self._root_fd, dst_dir_fd=self._root_fd)
            os.fsync(self._root_fd)
        except OSError as exc:
            raise CardError(f"fs card {self.root}: cannot write {CARD_FILE}: {exc}") from None

    def _own_file(self, fd: int) -> None:
        """Give a file of the card its mode (whatever the umask) and group, on its descriptor."""
        st = os.fstat(fd)
        try:
            if stat.S_IMODE(st.st_mode) != self.file_mode:
                os.fchmod(fd, self.file_mode)
            if self.gid >= 0 and st.st_gid != self.gid:
                os.fchown(fd, -1, self.gid)
        except PermissionError as exc:
            logger.warning("fs card %s: cannot set the mode or group of a file: %s", self.root, exc)

    def _db_dir(self, db: int) -> str:
        return os.path.join(self.root, f"db{db:03d}")

    def _ref(self, db: int, fkey: bytes) -> FileRef:
        """The file of a fragment: its database's descriptor and its name there ("ab/<hex>")."""
        return FileRef(self._db_fds[db], object_name(fkey))

    def _probe_o_direct(self) -> bool:
        try:
            fd = os.open(PROBE, CREATE_FLAGS | os.O_DIRECT, 0o600, dir_fd=self._root_fd)
            try:
                os.pwrite(fd, self._scratch.header, 0)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
        finally:
            unlink_all([FileRef(self._root_fd, PROBE)])

    # ------------------------------------------------------------------ data
    def read(self, db: int, fkey: bytes, buf: memoryview, tag: bytes = b"",
             write_id: Optional[int] = None) -> Read:
        entry = self.index.locate(fkey)
        if entry is None:
            return Read.ABSENT
        verdict = read_object_file(self._db_fds[entry[0]], object_name(fkey), fkey, buf, self.o_direct, self._scratch,
                                   write_id)
        return self.read_result(fkey, verdict, entry)

    def open_placed(self, fkey: bytes) -> Optional[PlacedFile]:
        """A read-only descriptor (``O_RDONLY | O_NOFOLLOW``, by the database's checked
        descriptor) of a stored fragment's file, with the index entry it was opened under (a
        failed check of it goes to ``read_result`` with that entry); None when it is not
        stored or does not open (that open's verdict applied). For MAP (``direct_reads``):
        placed files are never written again (``write``: a new file renamed into place), so
        what the descriptor reads stays that file's bytes whatever happens to its name."""
        entry = self.index.locate(fkey)
        if entry is None:
            return None
        try:
            fd = os.open(object_name(fkey), READ_FLAGS, dir_fd=self._db_fds[entry[0]])
        except OSError as exc:
            self.read_result(fkey, verdict_of(exc), entry)
            return None
        return PlacedFile(fd, entry)

    def placed_checked(self, fkey: bytes, placed: PlacedFile, verdict: Read) -> Read:
        return self.read_result(fkey, verdict, placed.entry)

    def process_reads(self, fkeys: list[bytes], write_ids: list[Optional[int]]) -> list[ProcessRead]:
        """The index entries of many fragments under one lock (``FsIndex.locate_many``: each
        object's LRU place refreshed once per fragment), a ``FileRead`` each (carrying the index entry it was
        handed, for ``read_result``) or ``NoProcessRead.ABSENT`` where it is not stored."""
        refs, o_direct = self._db_refs, self.o_direct
        return [NoProcessRead.ABSENT if e is None else FileRead(refs[e[0]], fkey, o_direct, w, e)
                for fkey, w, e in zip(fkeys, write_ids, self.index.locate_many(fkeys))]

    def process_read_result(self, task, verdict: Read) -> Read:
        return self.read_result(task.fkey, verdict, task.entry)

    def read_to_fd(self, db: int, fkey: bytes, length: int, out_fd: int, out_offset: int,
                   write_by: Optional[float] = None, write_id: Optional[int] = None) -> Read:
        entry = self.index.locate(fkey)
        if entry is None:
            return Read.ABSENT
        verdict = copy_object_file(self._db_fds[entry[0]], object_name(fkey), fkey, length, out_fd, out_offset,
                                   self._scratch, write_by, write_id)
        return self.read_result(fkey, verdict, entry)

    def read_result(self, fkey: bytes, verdict: Read, entry: Entry) -> Read:
        """Account for the verdict of a read (here or in an I/O process) of the file the index
        handed out as ``entry``: evidence about the object (``Read.drops``: a missing or bad
        fragment) drops its whole object, so the next PUT stores it again, unless the
        fragment was stored again since (the verdict is stale: the newer, acknowledged
        object stays; ``CHANGED``). Any other miss (transient, I/O error, another write's
        fragment, a client that did not take the bytes) drops nothing."""
        if verdict is Read.HIT or verdict is Read.UNDELIVERED or verdict is Read.CHANGED:
            return verdict
        path = os.path.join(self._db_dir(entry[0]), object_name(fkey))
        if not verdict.drops:
            now = time.monotonic()
            if verdict.strike or now - self._transient_logged >= TRANSIENT_LOG_S:
                self._transient_logged = now
                logger.warning("fs card %s: %s is %s: a miss, nothing removed", self.root, path, verdict.value)
            return verdict
        refs = self.index.drop_if(fkey, entry)
        if refs is None:
            logger.debug("fs card %s: %s was %s, but its object is gone or stored again since; "
                         "the stale verdict is ignored", self.root, path, verdict.value)
            return Read.CHANGED
        logger.warning("fs card %s: %s is %s; the object is a miss and is removed", self.root, path, verdict.value)
        self._remove(refs)
        return verdict

    def write_from_fd(self, db: int, fkey: bytes, length: int, in_fd: int, in_offset: int,
                      object_bytes: int = 0, tag: Optional[bytes] = b"", read_by: Optional[float] = None,
                      write_id: int = 0) -> bool:
        return self.write(db, fkey, FdSlice(in_fd, in_offset, length, read_by), object_bytes, tag, write_id)

    def write(self, db: int, fkey: bytes, buf, object_bytes: int = 0, tag: Optional[bytes] = b"", write_id: int = 0) -> bool:
        """``buf``: a memoryview, or an ``FdSlice`` of a client's region (``write_from_fd``).
        The file is created under a new temporary name (``O_EXCL | O_NOFOLLOW``: nothing
        placed there is followed or reused) in the database's directory, by descriptor, and
        renamed into place there."""
        n = len(buf)
        if len(fkey) != FKEY_BYTES:
            logger.warning("fs card %s: %r is no fragment key (%d bytes, not %d); not storing",
                           self.root, fkey[:8], len(fkey), FKEY_BYTES)
            return False
        on_disk = HEADER_BYTES + (-(-n // ALIGN) * ALIGN if self.o_direct else n)
        okey = object_key(fkey)
        head = is_head(fkey)
        try:
            self._check_subdir(db, subdir_of(fkey), create=True)
        except (OSError, CardError) as exc:
            logger.warning("fs card %s: cannot make or check %s: %s", self.root,
                           os.path.join(self._db_dir(db), subdir_of(fkey)), exc)
            return False
        ok, victims = self.index.reserve(okey, fkey, on_disk)
        self._remove(victims)
        if not ok:
            return False
        dir_fd = self._db_fds[db]
        final = object_name(fkey)
        with self._lock:
            self._tmp_seq += 1
            tmp = f"{subdir_of(fkey)}/.{fkey.hex()}.{self._tmp_tag}.{self._tmp_seq}"
        try:
            fd = os.open(tmp, CREATE_FLAGS | (os.O_DIRECT if self.o_direct else 0), self.file_mode, dir_fd=dir_fd)
            try:
                self._own_file(fd)
                write_object_file(fd, fkey, buf, object_bytes if head else 0, self.o_direct, self._scratch, write_id,
                                  tag)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            return self._write_failed(db, okey, final, on_disk, exc, FileRef(dir_fd, tmp))
        except BaseException:
            unlink_all([FileRef(dir_fd, tmp)])
            self.index.unreserve(okey, on_disk)
            raise
        with self._stripe(okey):        # rename and commit as one against removals (``_remove``)
            try:
                os.rename(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError as exc:
                return self._write_failed(db, okey, final, on_disk, exc, FileRef(dir_fd, tmp))
            if self.fsync:                     # the rename is durable once its subdirectory is synced
                try:
                    sub_fd = os.open(subdir_of(fkey), DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        os.fsync(sub_fd)
                    finally:
                        os.close(sub_fd)
                except OSError as exc:         # in place but not durable: not acknowledged, so not kept
                    return self._write_failed(db, okey, final, on_disk, exc, FileRef(dir_fd, final))
            done = self.index.commit(fkey, db, n, on_disk, object_bytes, write_id)
            self._remove(done.remove)
        return done.whole

    def _write_failed(self, db: int, okey: bytes, final: str, on_disk: int, exc: OSError, leftover: FileRef) -> bool:
        """A write that failed: its file (``leftover``: the temporary one, or the one it put in
        place and may not keep; never indexed) removed, its reservation given back. False."""
        logger.warning("fs card %s: write of %s failed: %s", self.root, os.path.join(self._db_dir(db), final), exc)
        unlink_all([leftover])
        self.index.unreserve(okey, on_disk)
        return False

    def _stripe(self, okey: bytes) -> threading.RLock:
        """The lock of an object's files: a write holds it from its rename to its commit, a
        removal from its check (``FsIndex.holds``) to its unlink."""
        return self._stripes[zlib.crc32(okey) % STRIPES]

    def _remove(self, files: list[FileOf]) -> int:
        """Remove object files the index gave up (an eviction's, a DELETE's, ...; head first):
        each under its object's lock (``_stripe``), and only when the index does not hold it
        at that moment (``FsIndex.holds``): a file a later write put in place and committed
        under that lock stays (the module's Removals). How many were unlinked."""
        removed = 0
        k = 0
        while k < len(files):
            okey = object_key(files[k].fkey)
            j = k + 1
            while j < len(files) and object_key(files[j].fkey) == okey:
                j += 1
            group = files[k:j]
            k = j
            with self._stripe(okey):
                for (fdb, fkey), held in zip(group, self.index.holds(group)):
                    dir_fd = self._db_fds.get(fdb)
                    if held or dir_fd is None:
                        continue
                    try:
                        os.unlink(object_name(fkey), dir_fd=dir_fd)
                        removed += 1
                    except OSError:
                        pass
        return removed

    def _drop_object(self, okey: bytes) -> bool:
        """Forget every fragment of an object and remove its files (head first)."""
        refs = self.index.drop(okey)
        if refs is None:
            return False
        self._remove(refs)
        return True

    def _drop_unindexed(self, db: int, fkey: bytes) -> bool:
        """While the scan runs: remove a fragment's file the index does not know yet (the
        scan will not index its object: ``FsIndex.drop`` remembered it). Whether it was there."""
        return self._remove([FileOf(db, fkey)]) > 0

    # ------------------------------------------------------------------ admin
    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    @property
    def evicted(self) -> int:
        """Objects evicted since the card opened (quotas and capacity)."""
        return self.index.evicted

    def contains_many(self, items, lengths=None, tags=None):
        return self.index.contains_many([fkey for _, fkey in items], lengths)

    def heads(self, heads, tags=None) -> list[Optional[Head]]:
        return self.index.heads([fkey for _, fkey in heads])

    def heads_found(self, keys, dbs, first: FirstExtent, tags) -> HeadsFound:
        """All in the index at once (``FsIndex.heads_found``; the databases and tags are not
        needed: the index knows where each object is)."""
        if set(map(len, keys)) - {KEY_BYTES}:
            return super().heads_found(keys, dbs, first, tags)
        return self.index.heads_found(list(keys), first)

    def listed_heads(self) -> Iterator[Listed]:
        """Every indexed object with the slot tag its head file's header records (one header
        read per object, by descriptor; a file gone or unreadable since is left out: the next
        read judges it). ``CardIOError`` while the scan at start has not indexed every file (a
        listing then would miss objects)."""
        if not self.scanned.is_set():
            raise CardIOError(f"fs card {self.root}: its files are still being indexed")
        header = memoryview(bytearray(objfmt.HEADER_CORE))
        for okey, db in self.index.object_heads():
            fkey = okey + b"\0\0"
            ref = self._ref(db, fkey)
            try:
                fd = os.open(ref.name, READ_FLAGS, dir_fd=ref.dir_fd)
                try:
                    got = os.preadv(fd, [header], 0)
                finally:
                    os.close(fd)
            except OSError:
                continue
            parsed = objfmt.read_header(header[:got], fkey)
            if parsed is not None:
                yield Listed(db, okey, parsed.slot_tag)

    def delete(self, db: int, fkey: bytes, tag: bytes = b"") -> bool:
        """Remove the fragment's whole object; True if any of it was stored."""
        if self._drop_object(object_key(fkey)):
            return True
        return not self.scanned.is_set() and self._drop_unindexed(db, fkey)

    def clean(self) -> int:
        """Remove every object file (the scan at start stopped first: whatever it had not
        indexed goes too), each through ``_remove``: a write committed since the index was
        emptied stays; how many objects (head files) were removed."""
        whole = self.scanned.is_set()
        self._stop_scan()
        files = self.index.usage()[1] if whole else max(self.index.usage()[1], self.index.listed)
        self.index.drop_all()
        objects = 0
        with progress.track(f"fs card {self.root}: cleaning", files, "files", log=logger) as shown:
            for db, _, name in self._walk():
                if name.startswith(".") or len(name) != 2 * FKEY_BYTES:
                    continue
                try:
                    fkey = bytes.fromhex(name)
                except ValueError:
                    continue
                if not self._remove([FileOf(db, fkey)]):
                    continue
                objects += name.endswith("0000")
                shown.advance()
        self.index.end_scan()
        self.scanned.set()
        logger.info("fs card %s: cleaned, %d objects removed", self.root, objects)
        return objects

    def _stop_scan(self) -> None:
        thread, self._scan_thread = self._scan_thread, None
        if thread is not None:
            self._scan_stop.set()
            thread.join()
            self._scan_stop.clear()

    def usage(self) -> CardUsage:
        used, files = self.index.usage()
        return CardUsage(used, self.capacity_bytes, files)

    def details(self) -> dict:
        return {"path": self.root}

    def tenant_usage(self) -> list[TenantUsage]:
        return self.index.tenant_usage()

    def check(self) -> bool:
        """The card's directory (by its descriptor) still holds its own card file, and the
        gateway may write to it."""
        try:
            return self._read_card_file().get("serial") == self.serial and \
                os.access(".", os.W_OK, dir_fd=self._root_fd)
        except (CardError, OSError):
            return False

    # ------------------------------------------------------------------ namespace claims
    def _claims_dir(self) -> int:
        """The descriptor of ``DIR/namespaces`` (made on first use, mode as the databases'),
        checked to be a directory of the gateway's own user that nobody else may write;
        CardError when it is not (nothing in it is then believed), CardIOError when it cannot
        be opened or made now (a full or failing disk)."""
        with self._claims_lock:
            if self._claims_fd is not None:
                return self._claims_fd
            root = self._root_fd          # the card's own directory, checked at open (fs_files)
            try:
                try:
                    os.mkdir(CLAIMS_DIR, self.dir_mode, dir_fd=root)
                    made = True
                except FileExistsError:
                    made = False
                fd = os.open(CLAIMS_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
                if made:
                    os.fsync(root)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):      # a symlink or a file in its place
                    raise CardError(f"fs card {self.root}: {CLAIMS_DIR} is not a directory: {exc}") from None
                raise CardIOError(f"fs card {self.root}: cannot open {CLAIMS_DIR}/: {exc}") from None
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                os.close(fd)
                raise CardError(f"fs card {self.root}: {CLAIMS_DIR}/ belongs to uid {st.st_uid} or is writable by "
                                f"others (mode {stat.S_IMODE(st.st_mode):04o}); its claims are not believed")
            try:
                if stat.S_IMODE(st.st_mode) != self.dir_mode:
                    os.fchmod(fd, self.dir_mode)
                if self.gid >= 0 and st.st_gid != self.gid:
                    os.fchown(fd, -1, self.gid)
            except PermissionError as exc:
                logger.warning("fs card %s: cannot set the mode or group of %s/: %s", self.root, CLAIMS_DIR, exc)
            self._claims_fd = fd
            self._remove_claim_leftovers(fd)
            return fd

    def _remove_claim_leftovers(self, dfd: int) -> None:
        """Remove the temporary files of claims interrupted by a crash (hidden names; only old
        ones: a gateway on another host sharing the card may be writing a new one now)."""
        for name in os.listdir(dfd):
            if not name.startswith("."):
                continue
            try:
                if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime > CLAIM_LEFTOVER_S:
                    os.unlink(name, dir_fd=dfd)
            except OSError:
                pass

    def namespace_owner(self, nsid: bytes) -> Optional[int]:
        """``DIR/namespaces/<16 hex digits>``: the owner's uid in decimal, one line."""
        dfd = self._claims_dir()
        try:
            fd = os.open(nsid.hex(), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CardError(f"fs card {self.root}: the claim of namespace {nsid.hex()} is a symlink") from None
            raise CardIOError(f"fs card {self.root}: cannot read the claim of namespace {nsid.hex()}: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise CardError(f"fs card {self.root}: the claim of namespace {nsid.hex()} is not a file of the "
                                f"gateway's user")
            data = os.read(fd, 32)
        except OSError as exc:
            raise CardIOError(f"fs card {self.root}: cannot read the claim of namespace {nsid.hex()}: {exc}") from None
        finally:
            os.close(fd)
        return parse_claim(data, f"fs card {self.root}: namespace {nsid.hex()}")

    def claim_namespace(self, nsid: bytes, uid: int) -> int:
        """Written to a temporary file (``O_EXCL``, fsynced), then hard-linked to its name:
        ``link`` fails on a name that exists, so a claim appears whole or not at all and
        never replaces one; the directory is fsynced after."""
        owner = self.namespace_owner(nsid)
        if owner is not None:
            return owner
        dfd = self._claims_dir()
        name = nsid.hex()
        tmp = f".{name}.{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode,
                         dir_fd=dfd)
            try:
                self._own_file(fd)
                data = claim_record(uid)
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write")
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                os.fsync(dfd)
            except FileExistsError:
                pass                    # claimed meanwhile (another thread or gateway): theirs stands
            finally:
                os.unlink(tmp, dir_fd=dfd)
        except OSError as exc:
            raise CardIOError(f"fs card {self.root}: cannot record the claim of namespace {name}: {exc}") from None
        owner = self.namespace_owner(nsid)
        if owner is None:
            raise CardIOError(f"fs card {self.root}: the claim of namespace {name} vanished")
        return owner

    def close(self) -> None:
        """Close the claims directory, stop the scan; with the index whole, save its snapshot
        for the next start; close the directories."""
        with self._claims_lock:
            if self._claims_fd is not None:
                os.close(self._claims_fd)
                self._claims_fd = None
        self._stop_scan()
        if self.scanned.is_set() and self.serial and self._root_fd >= 0:
            try:
                self.index.save(self._root_fd, SNAPSHOT_FILE, self.serial, self._stamps(), self._own_file)
            except OSError as exc:
                logger.warning("fs card %s: cannot save the index snapshot: %s", self.root, exc)
        fds, self._db_fds, self._db_refs = list(self._db_fds.values()) + [self._root_fd], {}, {}
        self._subdirs = set()
        self._root_fd = -1
        for fd in fds:
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
