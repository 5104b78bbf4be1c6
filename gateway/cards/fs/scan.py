"""The fs card's scan at start: the card's files judged and indexed (``scan``), or the index
a snapshot gave checked against them (``verify``), on a thread while the card serves.

Contract:

- **What it judges.** Every file is reached relative to its database's checked descriptor
  (``FsIndex.path_of``), following no symlink. A head is sound when its header
  (``objfmt``) names it and its size on disk fits the payload it records; an object is
  whole when every fragment its head's size calls for is where a gateway puts it (the
  head's database, or when spread the ``i``-th database on for fragment ``i``), sound, of
  the length ``fragment_extents`` gives it, and of the same write id as its head. Each file judged
  gets the card's mode and group (``own_file``).
- **What it removes.** Only files older than ``started`` (the card's open, wall clock): a
  newer file is one of this gateway's writes. Those go when broken (a bad header,
  truncated, a symlink), when a fragment's head is missing (a fragmented write cut short:
  the head goes last), and with every file of their object when it lacks fragments or is
  torn (fragments of other writes than its head's: an overwrite cut short by a crash);
  leftovers of interrupted writes (dot files) go too. A fragment without its head, or an
  object lacking fragments or torn, stays while a write of that object is in flight
  (``FsIndex.in_flight``). An object file goes through the card's ``remove``
  (``FsCard._remove``: under its object's lock, only while the index does not hold it), so
  the scan never removes a file a write put in place since the start. A file that cannot be
  read now (EMFILE, EIO, ...) is no evidence: its object is left as it is, unjudged.
- **What it leaves.** Nothing it does not index (issue 40): once the walk (or the snapshot's
  check) is done, ``sweep`` walks the databases again and every object file older than the
  start that the index does not hold is judged: a head is judged as the walk judges it (and
  indexed, or removed with its object's every file), any other file goes unless its head is
  there and could not be judged; so an incomplete object's every file goes, whatever order
  the walk met them in, and files a start from the snapshot does not know (left by an older
  start) are indexed or removed. ``used_bytes`` then equals the bytes of the card's object
  files.
- **What it indexes.** Each whole object, through ``FsIndex.index_scanned``, which refuses
  an object committed, deleted or evicted since the card opened (the index's side of the
  race: ``begin_scan`` / ``end_scan``, called by the card around the scan), so a PUT racing
  the scan is counted once and a deleted object does not come back. A lookup of an object
  not reached yet is a miss.
- **Stopping.** Both return None once ``stop`` is set (the card closes); the card ends the
  scan and trims the index only after one returned a count.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from typing import Callable, Iterator, Optional, Union

from adpkv_gateway.observe import progress
from adpkv_gateway.cards.fragments import fragment_extents, fragment_index, fragment_key, is_head, object_key
from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.fs.files import READ_FLAGS, FileRef, object_name, unlink_all
from adpkv_gateway.cards.fs.index import FKEY_BYTES, FileOf, FsIndex, sizes_on_disk

logger = logging.getLogger("adpkv.gateway.fs")

# a whole object found: (fragment key -> (database, bytes on disk), the size its head records,
# the head's payload length, its write id, its newest file's mtime): ``FsIndex.index_scanned``'s
Found = tuple[dict[bytes, tuple[int, int]], int, int, int, float]
# a sound file: (size on disk, mtime, payload length, recorded object size, write id)
FileInfo = tuple[int, float, int, int, int]
# the card's removal of object files (``FsCard._remove``): how many it unlinked
Remove = Callable[[list[FileOf]], int]
SWEEP_BATCH = 4096             # files the sweep asks the index about at once


def verify(index: FsIndex, own_file: Callable[[int], None], remove: Remove, started: float,
           stop: threading.Event) -> Optional[int]:
    """After ``load``: check each indexed object's files against the snapshot (one
    ``lstat`` each: the size its row gives, not changed since the snapshot was saved).
    An object whose file differs is judged again from its files (its head's header, as
    the scan does): indexed anew when sound, removed when broken, dropped from the index
    when gone. Runs while the card serves, as the scan (``begin_scan``). How many objects
    it changed, or None when ``stop`` was set first."""
    keys = index.object_keys()
    n = len(keys)
    header = memoryview(bytearray(objfmt.HEADER_CORE))
    changed = 0
    with progress.track(f"fs card {index.root}: checking the index snapshot", n, "objects", log=logger) as shown:
        for j in range(n):
            if stop.is_set():
                return None
            shown.advance()
            okey = keys[j].tobytes()
            held = index.held(okey)
            if held is None:
                continue
            mtime = _files_match(index, okey, held.files)
            if mtime is not None:
                index.age(okey, held, mtime)   # its LRU place by age, as a scan gives it (unless used since)
                continue
            changed += 1
            if not index.forget(okey, held):
                continue                       # stored or dropped since: not the snapshot's any more
            db = held.files[0][0]
            found = _scan_object(index, db, okey, header, own_file, remove, started)
            if found is not None and not isinstance(found, str):
                index.index_scanned(okey, *found, now=time.time())
    logger.info("fs card %s: index snapshot checked against the files, %d objects changed since", index.root,
                changed)
    return changed


def _files_match(index: FsIndex, okey: bytes, files: list[tuple[int, int]]) -> Optional[float]:
    """The newest mtime of an object's files when they are still as the snapshot has them
    (size, not changed since it was saved), else None."""
    newest = 0.0
    for i, (db, size) in enumerate(files):
        try:
            dir_fd, name = index.path_of(db, fragment_key(okey, i))
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None
        if st.st_size != size or st.st_mtime > index.saved_at or not stat.S_ISREG(st.st_mode):
            return None
        newest = max(newest, st.st_mtime)
    return newest


Walk = Callable[[], Iterator[tuple[int, int, str]]]


def scan(index: FsIndex, walk: Walk, own_file: Callable[[int], None], remove: Remove, started: float,
         stop: threading.Event) -> Optional[int]:
    """Index the files ``walk()`` yields as (database, its directory's descriptor, name) (walked twice: a
    count for the progress, ``listed``, then the work), checking each head's header
    against its size and its object's fragments against the size it records. A file older than ``started`` (the card's
    open, wall clock) that does not match (truncated, corrupt), or a fragment whose head
    is missing, is removed; so is every file of an object whose fragments do not add up
    to the size its head records, or whose fragments carry other write ids than its head
    (a torn object: an overwrite cut short). Every file is opened, checked and removed
    relative to its database's descriptor, following no symlink. Leftovers of interrupted writes (dot files) older than
    ``started`` go. ``own_file(fd)`` gives each file the card's mode and group. Returns
    how many objects it indexed, or None when ``stop`` was set first."""
    t0 = time.monotonic()
    header = memoryview(bytearray(objfmt.HEADER_CORE))
    indexed = bad = 0
    with progress.track(f"fs card {index.root}: indexing", 0, "files", log=logger) as shown:
        shown.total = index.listed = sum(1 for _ in walk())
        for db, dir_fd, name in walk():
            if stop.is_set():
                return None
            shown.advance()
            ref = FileRef(dir_fd, name)
            if name.startswith("."):
                if _older(ref, started):
                    unlink_all([ref])  # a temp file of a write that never finished
                continue
            try:
                fkey = bytes.fromhex(name)
            except ValueError:
                continue
            if len(fkey) != FKEY_BYTES:
                continue
            okey = object_key(fkey)
            if not is_head(fkey):
                if not _has_head(index, okey, fkey, db) and not index.in_flight(okey) and _older(ref, started):
                    # no head: a fragmented write cut short (the head goes last); it can never be read
                    logger.warning("fs card %s: %s has no head fragment; removing it", index.root,
                                   _where(index.root, db, object_name(fkey)))
                    remove([FileOf(db, fkey)])
                    bad += 1
                continue
            found = _scan_object(index, db, okey, header, own_file, remove, started)
            if found is None:
                continue
            if isinstance(found, str):
                bad += 1
                continue
            indexed += index.index_scanned(okey, *found, now=time.time())
    used, files = index.usage()
    logger.info("fs card %s: %d objects in %d files, %.1f MiB indexed in %.2f s%s",
                index.root, indexed, files, used / 2**20, time.monotonic() - t0,
                f"; {bad} broken removed" if bad else "")
    return indexed


def _has_head(index: FsIndex, okey: bytes, fkey: bytes, db: int) -> bool:
    """Whether the head of the object whose fragment ``fkey`` is in ``db`` is where a
    gateway puts it (spread: ``index`` databases back; else the same database)."""
    back = (db - fragment_index(fkey)) % index.num_dbs
    return any(_exists(index.path_of(d, fragment_key(okey, 0))) for d in {back, db})


def _where(root: str, db: int, name: str) -> str:
    """The path of a file of database ``db`` (``name`` relative to it: "ab/<hex>"), for messages."""
    return os.path.join(root, f"db{db:03d}", name)


def sweep(index: FsIndex, walk: Walk, own_file: Callable[[int], None], remove: Remove, started: float,
          stop: threading.Event) -> Optional[int]:
    """After ``scan`` or ``verify``: judge every object file older than ``started`` that the
    index does not hold (the contract's "What it leaves"): a head as the scan does (indexed
    when whole, else its object's every file removed), then any other such file removed
    unless its object's head is there, unheld, and could not be judged now. How many files
    were removed, or None when ``stop`` was set first."""
    unheld: list[FileOf] = []
    batch: list[FileOf] = []

    def flush() -> None:
        for f, held in zip(batch, index.holds(batch)):
            if not held and _older(index.path_of(f.db, f.fkey), started):
                unheld.append(f)
        batch.clear()

    with progress.track(f"fs card {index.root}: checking for files it did not index", index.listed, "files",
                        log=logger) as shown:
        for db, _, name in walk():
            if stop.is_set():
                return None
            shown.advance()
            if name.startswith(".") or len(name) != 2 * FKEY_BYTES:
                continue
            try:
                batch.append(FileOf(db, bytes.fromhex(name)))
            except ValueError:
                continue
            if len(batch) >= SWEEP_BATCH:
                flush()
        flush()
        return _judge_unheld(index, unheld, own_file, remove, started) if unheld else 0


def _judge_unheld(index: FsIndex, unheld: list[FileOf], own_file: Callable[[int], None], remove: Remove,
                  started: float) -> int:
    """``sweep``'s judgement of the files the index did not hold: how many it removed."""
    header = memoryview(bytearray(objfmt.HEADER_CORE))
    removed = indexed = broken = 0
    unjudged: set[bytes] = set()
    for db, fkey in unheld:
        if not is_head(fkey):
            continue
        okey = object_key(fkey)
        found = _scan_object(index, db, okey, header, own_file, remove, started)
        if found is None:
            unjudged.add(okey)
        elif isinstance(found, str):
            broken += 1
        else:
            if index.index_scanned(okey, *found, now=time.time()):
                indexed += 1
            else:                      # stored, deleted or evicted since the start: these files are no one's
                removed += remove([FileOf(d, fk) for fk, (d, _) in found[0].items()])
    rest = [f for f in unheld if not is_head(f.fkey) and object_key(f.fkey) not in unjudged]
    for f, held in zip(rest, index.holds(rest)):
        if not held:
            removed += remove([f])
    if removed or indexed or broken:
        logger.warning("fs card %s: files the index did not hold: %d removed, %d broken objects removed, %d objects "
                       "indexed after all", index.root, removed, broken, indexed)
    return removed + broken


def _scan_object(index: FsIndex, db: int, okey: bytes, header: memoryview, own_file: Callable[[int], None],
                 remove: Remove, started: float) -> Union[Found, str, None]:
    """(parts, total, head length, write id, newest mtime) of a whole object whose head is
    in database ``db``, None when it cannot be judged now (gone, unreadable now, newer than
    the start, a write in flight), or a string when it was broken (a bad head, missing
    fragments, fragments of another write than its head's: torn) and removed: every file of
    it there is (each fragment where a gateway may put it), through ``remove``."""
    head_ref = index.path_of(db, fragment_key(okey, 0))
    path = _where(index.root, db, head_ref.name)
    try:
        info = _scan_file(head_ref.dir_fd, head_ref.name, fragment_key(okey, 0), header, own_file)
    except OSError as exc:
        if exc.errno != errno.ELOOP or not _older(head_ref, started):
            return None
        info = "not a file of the card (a symlink)"
    if isinstance(info, str):
        if not _older(head_ref, started):
            return None
        logger.warning("fs card %s: %s is %s; removing it", index.root, path, info)
        remove([FileOf(db, fragment_key(okey, 0))])
        return info
    size, mtime, flen, total, write_id = info
    parts = {fragment_key(okey, 0): (db, size)}
    if total <= flen:
        return parts, total, flen, write_id, mtime
    try:
        extents = fragment_extents(total, flen)
    except ValueError:
        extents = []
    problem = None if extents else "a head of impossible size"
    spread_ok = True
    for i, (_, length) in enumerate(extents[1:], 1):
        fkey = fragment_key(okey, i)
        got: Union[FileInfo, str, None] = None
        for d in ((db + i) % index.num_dbs, db) if spread_ok else (db,):
            ref = index.path_of(d, fkey)
            try:
                got = _scan_file(ref.dir_fd, ref.name, fkey, header, own_file)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
                    continue               # not there, or no file of the card: evidence
                return None                # EMFILE, EIO, ...: no evidence, judged another time
            break
        if got is None or isinstance(got, str) or got[2] != length:
            problem = "missing fragments"
            break
        parts[fkey] = (d, got[0])
        mtime = max(mtime, got[1])
        if got[4] != write_id:
            problem = "torn (fragments of different writes)"
            break
    if problem is None:
        return parts, total, flen, write_id, mtime
    if mtime >= started or index.in_flight(okey):
        return None
    logger.warning("fs card %s: object %s is %s; removing it", index.root, okey.hex(),
                   problem if problem.startswith("torn") else f"lacking fragments ({problem})")
    files = [FileOf(d, fk) for fk, (d, _) in parts.items()]
    for i in range(1, len(extents)):           # the fragments the walk met or did not meet yet
        fkey = fragment_key(okey, i)
        files += [FileOf(d, fkey) for d in dict.fromkeys(((db + i) % index.num_dbs, db))
                  if FileOf(d, fkey) not in files]
    remove(files)
    return problem


def _older(ref: FileRef, started: float) -> bool:
    """Whether the file was last changed before ``started`` (wall clock): not a write of
    this gateway's."""
    try:
        return os.stat(ref.name, dir_fd=ref.dir_fd, follow_symlinks=False).st_mtime < started
    except OSError:
        return False


def _exists(ref: FileRef) -> bool:
    """Whether a name is in its directory (a symlink too)."""
    try:
        os.stat(ref.name, dir_fd=ref.dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def _scan_file(dir_fd: int, name: str, fkey: bytes, header: memoryview,
               own_file: Callable[[int], None]) -> Union[FileInfo, str]:
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
    if st.st_size not in sizes_on_disk(parsed.payload_len):
        return f"truncated ({st.st_size} bytes for a payload of {parsed.payload_len})"
    return st.st_size, st.st_mtime, parsed.payload_len, parsed.object_bytes, parsed.write_id
