"""The fs card's index: which objects the card holds, in which files, and which go first.

Contract (``FsIndex``):

- **What it holds.** One row per whole object (its head is in place) in a compact table of
  numpy columns (``fs_rows.Rows``: the 28-byte key, bytes on disk, the size its head records, the
  head's payload length, fragment count, databases, write generation, the head's write id,
  last use, namespace: 72 bytes) found through an open-addressing hash table of row numbers
  (``fs_rows.key_hash``; linear probing, at most half full: 8 to 16 bytes an object). A row
  is exact: the full key is compared, so a lookup never hits another object. Fragments are
  not rows: fragment ``i`` of an object has the length ``fragment_extents(size, head
  length)`` gives it and lives in database ``db0`` (or ``(db0 + i) % dbmod`` when its fragments are spread). Fragments written
  before their head (a write in flight) are kept apart (``_pending``) until the head
  commits them; they are not found by lookups.
- **Accounting.** ``used`` is the bytes on disk of every indexed file plus the bytes reserved
  by writes in flight; ``files`` counts indexed files. A write ``reserve``s its bytes first
  (which may evict whole objects), then ``commit``s its file once it is renamed into place,
  or ``unreserve``s them when it failed.
- **Eviction.** Whole objects only, least recently used first, never the object being
  written (the caller's, or one with fragments in flight: ``_pending``) nor a pinned one
  (``is_pinned(object key)``). Each use stamps the object's row
  with a clock (``tick``, one step per lookup batch or write); the victims are taken from
  a queue of the oldest rows, refilled by one ``argpartition`` of the ticks when it runs
  dry (a queue of at least 1/32 of the objects: O(victims) amortised). A queued row used
  since it was queued is skipped, and any row not queued is newer than every queued one,
  so victims go in exact LRU order (ties: the same batch). A namespace over its quota
  evicts its own objects first (its own queue) and is refused when that is not enough;
  the card past ``watermark`` of its capacity evicts any namespace's objects down to
  ``watermark - ratio``.
- **The scan at start.** ``fs_scan`` judges the files already on the card (or checks a
  snapshot's rows against them) on a thread while the card serves (``FsCard.open``), and
  indexes each whole object with ``index_scanned``; a lookup of an object it has not reached
  is a miss. Between ``begin_scan`` and ``end_scan`` the index never indexes a scanned
  object that was committed, deleted or evicted since the card opened (``index_scanned``
  checks under the lock; deletions and evictions during the scan are remembered in
  ``_gone`` until it ends), so a PUT racing the scan is counted once and a deleted object
  does not come back. Once the scan has indexed everything, ``trim`` brings the card within
  its capacity and every namespace within its quota.
- **Locking and I/O.** Every method takes the index's own lock; none touches an object
  file (``save`` and ``load`` write and read the snapshot's, through ``fs_snapshot``). A
  method that drops objects returns their files (``FileOf``: database and fragment key,
  head first) and the caller removes them after the lock is released: an object leaves the
  index before its files go, so a reader that still holds a reference finds the file gone
  ("missing", a miss), never another object's bytes.
- **Removals (issue 40).** The caller removes such a file only under its object's lock
  (``FsCard._remove``), and only when ``holds`` says the index does not hold that file at
  that moment; a write renames its file into place and ``commit``s it under the same lock.
  So between the choice of a removal and its unlink a new write of that key either has not
  renamed yet (its rename replaces nothing the removal still wants) or is committed, and
  then held and kept: a removal removes the write it chose, never a later one's file.
- **Verdicts.** ``locate`` hands out ``(database, generation)``; a failed read drops the
  object with ``drop_if(fkey, entry)``, which does nothing once any fragment of the object
  was stored again (a new generation): a stale verdict never removes a newer,
  acknowledged store.
- **Writes.** Each row records its head's write id (``commit``): the id every fragment read
  is checked against (``heads``).
- **Snapshot.** ``save`` writes the table (write ids too) at a clean stop (``FsCard.close``,
  once the scan had ended; none while writes are in flight) and ``load`` takes it instead of
  a scan, both through ``fs_snapshot`` (its contract says when a snapshot is taken: never
  one older than the files). A snapshot not taken is ignored with one line, and the card
  scans. After ``load`` the card checks each object's files against it (``fs_scan.verify``,
  through ``held``, ``age`` and ``forget``).
- **Files.** The index stores databases, not paths: the methods that drop objects return
  ``FileOf`` (database, fragment key); ``path_of(db, fragment key)`` is the card's reference
  of a file (``fs_files.FileRef``: its database's checked descriptor and the name): the
  scan and the snapshot's check reach every file relative to those descriptors, following
  no symlink.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Optional

import numpy as np

from adpkv_core.keys import KEY_BYTES

from adpkv_gateway.cards.fragments import INDEX_BYTES, fragment_extents, fragment_index, fragment_key, is_head, object_key
from adpkv_gateway.cards.quotas import TenantUsage, tenant_of
from adpkv_gateway.cards.fs import snapshot as fs_snapshot
from adpkv_gateway.cards.base import FirstExtent, Head, HeadsFound
from adpkv_gateway.cards.fs.files import FileRef
from adpkv_gateway.cards.fs.rows import Rows, give_back_heap, key_hash, key_hashes, mapped
from adpkv_gateway.cards.fs.snapshot import EMPTY_SLOT, Snapshot
from adpkv_gateway.cards.objfile import ALIGN, HEADER_BYTES

logger = logging.getLogger("adpkv.gateway.fs")

FKEY_BYTES = KEY_BYTES + INDEX_BYTES
EMPTY = EMPTY_SLOT             # a free slot of the hash table
START_TICK = 1 << 31           # the clock at start; scanned objects get older ticks (by file age)
MIN_QUEUE = 256                # eviction queue: at least this many rows, or 1/32 of them
TRIM_CHUNK = 2048              # objects one step of the trim at start evicts under the lock

Entry = tuple[int, int]        # what ``locate`` hands out: (database, write generation)


class FileOf(NamedTuple):
    """One object file as the index names it: its database and its fragment key."""

    db: int
    fkey: bytes


class Commit(NamedTuple):
    """What ``commit`` made of a file put in place: ``whole`` False when the write's object
    cannot be whole (its head found fragments missing: a DELETE or CLEAN took them while it
    was written), then not indexed; ``remove``, the files to remove (an earlier version's the
    new one does not reuse, or, when not whole, the write's own)."""

    whole: bool
    remove: list[FileOf]


class Held(NamedTuple):
    """What the index holds of an object (``FsIndex.held``): its files as (database, bytes on
    disk), head first; its write generation; its LRU tick."""

    files: list[tuple[int, int]]
    gen: int
    tick: int


def sizes_on_disk(n: int) -> tuple[int, int]:
    """The sizes a file of ``n`` payload bytes may have (page cache, O_DIRECT padding)."""
    return HEADER_BYTES + n, HEADER_BYTES + -(-n // ALIGN) * ALIGN


def _free_slots(size: int) -> np.ndarray:
    slots = mapped((size,), np.int32)
    slots.fill(EMPTY)
    return slots


class _Namespace:
    """What one namespace holds on the card."""

    __slots__ = ("tid", "used", "objects", "quota", "evicted", "capacity_evicted")

    def __init__(self, tid: bytes, quota: int):
        self.tid = tid
        self.used = 0
        self.objects = 0
        self.quota = quota
        self.evicted = 0
        self.capacity_evicted = 0

    def over_by(self, nbytes: int) -> int:
        """How many bytes it must free to take ``nbytes`` more (0: none, or no quota)."""
        return max(0, self.used + nbytes - self.quota) if self.quota else 0


class FsIndex:
    """The in-memory index of one fs card (see the module's contract)."""

    def __init__(self, root: str, path_of: Callable[[int, bytes], FileRef], capacity_bytes: int = 0,
                 watermark: float = 0.95, ratio: float = 0.10,
                 is_pinned: Callable[[bytes], bool] = lambda key: False,
                 quotas: Optional[dict[bytes, int]] = None, num_dbs: int = 16):
        self.root = root                       # for log lines
        self.path_of = path_of
        self.capacity_bytes = capacity_bytes
        self.watermark = watermark
        self.ratio = ratio
        self.is_pinned = is_pinned
        self.num_dbs = num_dbs
        self.evicted = 0                       # objects evicted (quota or capacity) since start
        self._lock = threading.Lock()
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._rows = Rows()
        self._slots = _free_slots(2048)
        self._mask = len(self._slots) - 1
        self._clock = START_TICK
        self._gen = 0
        self._files = 0
        self._used = 0
        self._pending: dict[bytes, dict[bytes, tuple[int, int]]] = {}   # okey -> fkey -> (db, on disk)
        self._queues: dict[int, collections.deque] = {}                # namespace (-1: all) -> oldest rows
        self._scanning = False
        self.saved_at = 0.0                    # when the snapshot ``load`` took was saved (wall clock)
        self.listed = 0                        # entries the scan found in the databases
        self._gone: set[bytes] = set()         # objects deleted or evicted while the scan runs
        self._ns: list[_Namespace] = []
        self._ns_of: dict[bytes, int] = {}
        self.quotas = dict(quotas or {})
        for tid in self.quotas:
            self._namespace(tid)

    # ------------------------------------------------------------------ the table
    def _namespace(self, tid: bytes) -> int:
        i = self._ns_of.get(tid)
        if i is None:
            i = self._ns_of[tid] = len(self._ns)
            self._ns.append(_Namespace(tid, self.quotas.get(tid, 0)))
        return i

    def _row(self, okey: bytes) -> int:
        """(lock held) The row of an object, or -1."""
        if len(okey) != KEY_BYTES:
            return -1
        slots, keys, mask = self._slots, self._rows.key, self._mask
        pos = key_hash(okey, self._seed) & mask
        while True:
            r = int(slots[pos])
            if r == EMPTY:
                return -1
            if keys[r].tobytes() == okey:
                return r
            pos = (pos + 1) & mask

    def _rows_of(self, okeys: np.ndarray) -> np.ndarray:
        """(lock held) The row of each key (``uint8`` (n, 28)), -1 where it is not indexed."""
        n = len(okeys)
        out = np.full(n, -1, np.int64)
        if n == 0 or self._rows.n == 0:
            return out
        slots, keys, mask = self._slots, self._rows.key, self._mask
        pos = (key_hashes(okeys, self._seed) & np.uint64(mask)).astype(np.int64)
        todo = np.arange(n)
        while todo.size:
            r = slots[pos[todo]]
            occupied = r != EMPTY
            todo, r = todo[occupied], r[occupied]
            same = (keys[r] == okeys[todo]).all(axis=1)
            out[todo[same]] = r[same]
            todo = todo[~same]
            pos[todo] = (pos[todo] + 1) & mask
        return out

    def _insert(self, okey: bytes) -> int:
        """(lock held) A new row for an object not indexed; its key and hash set."""
        rows = self._rows
        if rows.n == rows.capacity:
            rows.grow()
        if 2 * (rows.n + 1) > len(self._slots):
            self._rehash(len(self._slots) * 2)
        r = rows.n
        rows.n += 1
        rows.key[r] = np.frombuffer(okey, np.uint8)
        pos = key_hash(okey, self._seed) & self._mask
        while self._slots[pos] != EMPTY:
            pos = (pos + 1) & self._mask
        self._slots[pos] = r
        return r

    def _rehash(self, size: int) -> None:
        """(lock held) A hash table of ``size`` slots for the rows."""
        rows = self._rows
        slots = _free_slots(size)
        mask = size - 1
        home = (key_hashes(rows.key[:rows.n], self._seed) & np.uint64(mask)).astype(np.int64)
        pending = np.arange(rows.n)
        pos = home.copy()
        while pending.size:
            # place every row whose slot is free and claimed by it alone; the rest probe on
            p = pos[pending]
            free = slots[p] == EMPTY
            cand, cp = pending[free], p[free]
            _, first = np.unique(cp, return_index=True)
            won = cand[first]
            slots[pos[won]] = won
            placed = np.zeros(rows.n, bool)
            placed[won] = True
            pending = pending[~placed[pending]]
            lost = pending[slots[pos[pending]] != EMPTY]
            pos[lost] = (pos[lost] + 1) & mask
        self._slots, self._mask = slots, mask
        del home, pending, pos
        give_back_heap()

    def _remove_row(self, r: int) -> None:
        """(lock held) Take row ``r`` out of the table (its slot freed by backward shift, the
        last row moved into its place)."""
        rows, slots, mask = self._rows, self._slots, self._mask
        i = self._slot_of(r)
        j = i
        while True:                                  # backward-shift deletion (linear probing)
            j = (j + 1) & mask
            s = int(slots[j])
            if s == EMPTY:
                break
            home = self._home(s)
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                slots[i] = s
                i = j
        slots[i] = EMPTY
        last = rows.n - 1
        if r != last:
            slots[self._slot_of(last)] = r
            rows.move(last, r)
        rows.n -= 1

    def _home(self, r: int) -> int:
        """(lock held) Row ``r``'s own slot (where its probe starts)."""
        return key_hash(self._rows.key[r].tobytes(), self._seed) & self._mask

    def _slot_of(self, r: int) -> int:
        pos = self._home(r)
        while int(self._slots[pos]) != r:
            pos = (pos + 1) & self._mask
        return pos

    def _tick(self) -> int:
        self._clock = min(self._clock + 1, 0xFFFFFFFF)
        return self._clock

    def _next_gen(self) -> int:
        self._gen = (self._gen + 1) & 0xFFFFFFFF
        return self._gen

    # ------------------------------------------------------------------ a row's fragments
    def _fragment_db(self, r: int, i: int) -> int:
        rows = self._rows
        dbmod = int(rows.dbmod[r])
        return int(rows.db0[r]) if dbmod == 0 else (int(rows.db0[r]) + i) % dbmod

    def _fragment_size(self, r: int, i: int) -> int:
        """(lock held) The bytes on disk of fragment ``i`` of row ``r`` (O_DIRECT padding as
        the object's files have it)."""
        rows = self._rows
        nfrag, flen, total, disk = int(rows.nfrag[r]), int(rows.flen[r]), int(rows.total[r]), int(rows.disk[r])
        if nfrag == 1:
            return disk
        payload = flen if i < nfrag - 1 else total - flen * (nfrag - 1)
        padded = disk != nfrag * HEADER_BYTES + total
        return sizes_on_disk(payload)[1 if padded else 0]

    def _paths(self, r: int) -> list[FileOf]:
        """(lock held) The files of row ``r``, head first."""
        okey = self._rows.key[r].tobytes()
        return [FileOf(self._fragment_db(r, i), fragment_key(okey, i)) for i in range(int(self._rows.nfrag[r]))]

    @staticmethod
    def _fkeys_array(fkeys: list[bytes]) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(object keys (n, 28), fragment indices) of fragment keys, None unless each is 30 bytes."""
        if set(map(len, fkeys)) != {FKEY_BYTES}:
            return None
        raw = np.frombuffer(b"".join(fkeys), np.uint8).reshape(len(fkeys), FKEY_BYTES)
        index = raw[:, KEY_BYTES].astype(np.int64) * 256 + raw[:, KEY_BYTES + 1]
        return np.ascontiguousarray(raw[:, :KEY_BYTES]), index

    def _found(self, fkeys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(lock held) (row of each fragment's object or -1, fragment index), -1 also where the
        object has no such fragment."""
        arrays = self._fkeys_array(fkeys)
        if arrays is None:
            rows = np.array([self._row(object_key(f)) if len(f) == FKEY_BYTES else -1 for f in fkeys], np.int64)
            index = np.array([fragment_index(f) for f in fkeys], np.int64)
        else:
            okeys, index = arrays
            rows = self._rows_of(okeys)
        hit = rows >= 0
        hit[hit] = index[hit] < self._rows.nfrag[rows[hit]]
        rows[~hit] = -1
        return rows, index

    # ------------------------------------------------------------------ lookups
    def locate(self, fkey: bytes) -> Optional[Entry]:
        """The entry of a stored fragment, ``(database, generation)`` (refreshing its object's
        LRU place), or None. Its failed read's verdict goes to ``drop_if`` with it."""
        i = fragment_index(fkey)
        with self._lock:
            r = self._row(object_key(fkey))
            if r < 0 or i >= int(self._rows.nfrag[r]):
                return None
            self._rows.tick[r] = self._tick()
            return self._fragment_db(r, i), int(self._rows.gen[r])

    def locate_many(self, fkeys: list[bytes]) -> list[Optional[Entry]]:
        """``locate`` of many fragments under one lock."""
        if not fkeys:
            return []
        with self._lock:
            rows, index = self._found(fkeys)
            hit = rows >= 0
            if not hit.any():
                return [None] * len(fkeys)
            r = rows[hit]
            first = self._tick()                   # one tick a key, in the batch's order
            self._clock = min(first + len(r) - 1, 0xFFFFFFFF)
            self._rows.tick[r] = np.minimum(first + np.arange(len(r), dtype=np.int64), 0xFFFFFFFF)
            dbmod = self._rows.dbmod[r].astype(np.int64)
            db = self._rows.db0[r].astype(np.int64)
            spread = dbmod > 0
            db[spread] = (db[spread] + index[hit][spread]) % dbmod[spread]
            gens = self._rows.gen[r]
        out: list[Optional[Entry]] = [None] * len(fkeys)
        for k, d, g in zip(np.flatnonzero(hit).tolist(), db.tolist(), gens.tolist()):
            out[k] = (d, g)
        return out

    def contains_many(self, fkeys: list[bytes], lengths: Optional[list[Optional[int]]] = None) -> list[bool]:
        """Whether each fragment is indexed (with ``lengths``: holding that many payload bytes)."""
        if not fkeys:
            return []
        with self._lock:
            rows, index = self._found(fkeys)
            hit = rows >= 0
            if lengths is not None and hit.any():
                r, i = rows[hit], index[hit]
                nfrag = self._rows.nfrag[r].astype(np.int64)
                flen = self._rows.flen[r].astype(np.int64)
                total = self._rows.total[r].astype(np.int64)
                payload = np.where((nfrag == 1) | (i < nfrag - 1), flen, total - flen * (nfrag - 1))
                want = np.array([-1 if n is None else n for n in lengths], np.int64)[hit]
                hit[hit] = (want < 0) | (want == payload)
        return hit.tolist()

    def heads(self, heads: list[bytes]) -> list[Optional[Head]]:
        """What each head fragment records (object size, write id), None where it is not indexed."""
        if not heads:
            return []
        with self._lock:
            rows, index = self._found(heads)
            hit = (rows >= 0) & (index == 0)
            totals = self._rows.total[rows[hit]].tolist()
            wids = self._rows.wid[rows[hit]].tolist()
        out: list[Optional[Head]] = [None] * len(heads)
        for k, t, w in zip(np.flatnonzero(hit).tolist(), totals, wids):
            out[k] = Head(t, w)
        return out

    def heads_found(self, okeys: list[bytes], first: FirstExtent) -> HeadsFound:
        """``heads`` and ``contains_many`` of many objects' heads at once (object keys of
        ``KEY_BYTES`` each): what each stored head records where it holds the payload
        ``first`` asks of it (a head's payload is its object's first fragment, ``flen``)."""
        n = len(okeys)
        size, wid, flen = np.zeros(n, np.int64), np.zeros(n, np.uint64), np.zeros(n, np.int64)
        with self._lock:
            rows = self._rows_of(np.frombuffer(b"".join(okeys), np.uint8).reshape(n, KEY_BYTES))
            hit = rows >= 0
            r = rows[hit]
            size[hit], wid[hit], flen[hit] = self._rows.total[r], self._rows.wid[r], self._rows.flen[r]
        want = first.lengths(size)
        hit &= want == flen
        size[~hit], wid[~hit] = 0, 0
        return HeadsFound(hit, size, wid)

    def object_heads(self) -> list[tuple[bytes, int]]:
        """(object key, its head's database) of every indexed object, as the index holds them
        now (a copy taken under the lock; no use is stamped)."""
        with self._lock:
            n = self._rows.n
            keys = self._rows.key[:n].tobytes()
            dbs = self._rows.db0[:n].tolist()
        return [(keys[i * KEY_BYTES:(i + 1) * KEY_BYTES], db) for i, db in enumerate(dbs)]

    def holds(self, files: list[FileOf]) -> list[bool]:
        """Whether the index holds each file now: a fragment of an indexed object in that
        database, or a fragment in flight (``_pending``) there. A removal unlinks only files
        it does not hold (``FsCard._remove``)."""
        if not files:
            return []
        with self._lock:
            rows, index = self._found([f.fkey for f in files])
            hit = rows >= 0
            out = np.zeros(len(files), bool)
            if hit.any():
                r, i = rows[hit], index[hit]
                dbmod = self._rows.dbmod[r].astype(np.int64)
                db = self._rows.db0[r].astype(np.int64)
                spread = dbmod > 0
                db[spread] = (db[spread] + i[spread]) % dbmod[spread]
                want = np.array([f.db for f in files], np.int64)[hit]
                out[hit] = db == want
            held = out.tolist()
            if self._pending:
                for k, (db_, fkey) in enumerate(files):
                    part = self._pending.get(fkey[:KEY_BYTES], {}).get(fkey)
                    held[k] = held[k] or (part is not None and part[0] == db_)
        return held

    def usage(self) -> tuple[int, int]:
        """(bytes used, files)."""
        with self._lock:
            return self._used, self._files

    def objects(self) -> int:
        with self._lock:
            return self._rows.n

    def tenant_usage(self) -> list[TenantUsage]:
        with self._lock:
            return sorted((TenantUsage(t.tid.hex(), t.used, t.objects, t.quota, t.evicted, t.capacity_evicted)
                           for t in self._ns if t.tid in self.quotas or t.used or t.objects or t.evicted
                           or t.capacity_evicted), key=lambda u: u.tenant)

    # ------------------------------------------------------------------ writes
    def reserve(self, okey: bytes, fkey: bytes, nbytes: int) -> tuple[bool, list[FileOf]]:
        """Account ``nbytes`` for a new file of ``fkey``, evicting least recently used objects
        (whole) if needed. (whether it may be written, files of the evicted objects)."""
        victims: list[FileOf] = []
        with self._lock:
            freed = self._file_size(okey, fkey)
            ns = self._ns[self._namespace(tenant_of(okey))]
            evicted = 0
            if ns.over_by(nbytes - freed):
                evicted = self._evict(self._ns_of[ns.tid], lambda: ns.over_by(nbytes - freed) > 0, okey, victims)
            if ns.over_by(nbytes - freed):
                self.evicted += evicted
                logger.warning("fs card %s: namespace id %s is at its quota (the rest pinned): not storing",
                               self.root, ns.tid.hex())
                return False, victims
            high = self.capacity_bytes * self.watermark
            if self._used + nbytes - freed > high:
                target = self.capacity_bytes * (self.watermark - self.ratio) - nbytes + freed
                evicted += self._evict(-1, lambda: self._used > target, okey, victims)
            self.evicted += evicted
            if self._used + nbytes - freed > self.capacity_bytes:
                logger.warning("fs card %s is full (%d of %d bytes, the rest pinned): not storing",
                               self.root, self._used, self.capacity_bytes)
                return False, victims
            self._used += nbytes
            ns.used += nbytes
        return True, victims

    def _file_size(self, okey: bytes, fkey: bytes) -> int:
        """(lock held) The bytes on disk of the fragment's indexed file (0: none)."""
        part = self._pending.get(okey, {}).get(fkey)
        if part is not None:
            return part[1]
        r = self._row(okey)
        i = fragment_index(fkey)
        return self._fragment_size(r, i) if r >= 0 and i < int(self._rows.nfrag[r]) else 0

    def unreserve(self, okey: bytes, nbytes: int) -> None:
        """A reserved write did not happen."""
        with self._lock:
            self._used -= nbytes
            self._ns[self._namespace(tenant_of(okey))].used -= nbytes

    def commit(self, fkey: bytes, db: int, payload: int, on_disk: int, object_bytes: int,
               write_id: int = 0) -> Commit:
        """A reserved file of ``on_disk`` bytes holding ``payload`` bytes is in place in
        database ``db``. A fragment other than the head waits for its head; the head makes
        the object whole: indexed (last in the LRU), with ``object_bytes`` the size it
        records and ``write_id`` its write's id. Returns the files to remove: an earlier
        version's files the new one does not reuse (another database, fragments past the new
        count), or, when the head finds fragments missing (the object cannot be read whole),
        the object's own files (``Commit``). The caller renamed the file into place under its
        object's lock and holds it until this returned (the contract's removals)."""
        okey = object_key(fkey)
        with self._lock:
            if self._scanning:
                self._gone.discard(okey)
            r = self._row(okey)
            if not is_head(fkey):
                parts = self._pending.setdefault(okey, {})
                old = parts.get(fkey)
                parts[fkey] = (db, on_disk)
                if r >= 0:
                    self._rows.gen[r] = self._next_gen()    # a fragment of the indexed object changed
                if old is None:
                    return Commit(True, [])
                self._used -= old[1]
                self._ns[self._namespace(tenant_of(okey))].used -= old[1]
                return Commit(True, [FileOf(old[0], fkey)] if old[0] != db else [])
            return self._commit_head(okey, fkey, r, db, payload, on_disk, object_bytes, write_id)

    def _commit_head(self, okey: bytes, fkey: bytes, r: int, db: int, payload: int, on_disk: int,
                     object_bytes: int, write_id: int) -> Commit:
        parts = self._pending.pop(okey, {})
        parts[fkey] = (db, on_disk)
        nfrag = len(fragment_extents(object_bytes, payload)) if object_bytes > payload else 1
        ns_index = self._namespace(tenant_of(okey))
        ns = self._ns[ns_index]
        stale: list[FileOf] = []
        kept = 0
        if r >= 0:                                   # an earlier version of the object
            for i in range(int(self._rows.nfrag[r])):
                fk = fragment_key(okey, i)
                old_db = self._fragment_db(r, i)
                if fk in parts:
                    if parts[fk][0] != old_db:
                        stale.append(FileOf(old_db, fk))
                elif i < nfrag:
                    parts[fk] = (old_db, self._fragment_size(r, i))
                    kept += parts[fk][1]
                else:
                    stale.append(FileOf(old_db, fk))
            old_disk = int(self._rows.disk[r])
            self._used -= old_disk - kept
            ns.used -= old_disk - kept
            self._files -= int(self._rows.nfrag[r])
            ns.objects -= 1
            self._remove_row(r)
        disk = sum(size for _, size in parts.values())
        found = [parts.get(fragment_key(okey, i), (None,))[0] for i in range(nfrag)]
        dbs = [d for d in found if d is not None]
        dbmod = self._layout(dbs) if len(dbs) == len(found) else None     # None: one is missing
        if dbmod is None or len(parts) != nfrag:
            logger.warning("fs card %s: object %s lacks fragments or has them out of place; removing it",
                           self.root, okey.hex())
            self._used -= disk
            ns.used -= disk
            return Commit(False, stale + [FileOf(d, fk) for fk, (d, _) in parts.items()])
        r = self._insert(okey)
        self._set_row(r, disk, object_bytes, payload, nfrag, dbs[0], dbmod, write_id, self._tick(), ns_index)
        return Commit(True, stale)

    def _layout(self, dbs: list[int]) -> Optional[int]:
        """The ``dbmod`` of an object whose fragments are in ``dbs`` (0: all in the first),
        or None when they are not where a gateway puts them."""
        if all(d == dbs[0] for d in dbs):
            return 0
        for mod in (self.num_dbs, max(dbs) + 1):
            if all(d == (dbs[0] + i) % mod for i, d in enumerate(dbs)):
                return mod
        return None

    def _set_row(self, r: int, disk: int, total: int, flen: int, nfrag: int, db0: int, dbmod: int,
                 write_id: int, tick: int, ns_index: int) -> None:
        rows = self._rows
        rows.disk[r], rows.total[r], rows.flen[r], rows.nfrag[r] = disk, total, flen, nfrag
        rows.wid[r] = write_id
        rows.db0[r], rows.dbmod[r], rows.gen[r], rows.tick[r], rows.ns[r] = db0, dbmod, self._next_gen(), tick, ns_index
        self._files += nfrag
        ns = self._ns[ns_index]
        ns.objects += 1

    # ------------------------------------------------------------------ removal
    def drop(self, okey: bytes) -> Optional[list[FileOf]]:
        """Take an object out of the index (and its fragments in flight); its files (head
        first), or None if none was indexed."""
        with self._lock:
            if self._scanning:
                self._gone.add(okey)
            return self._take(okey, self._row(okey))

    def drop_if(self, fkey: bytes, entry: Entry) -> Optional[list[FileOf]]:
        """``drop`` of the fragment's object only while it is still the generation ``entry``
        (what ``locate`` handed a reader) names: a read's verdict is about that file. None
        when the object is gone or was stored again since (a newer, acknowledged file: the
        object stays)."""
        okey = object_key(fkey)
        with self._lock:
            r = self._row(okey)
            if r < 0 or int(self._rows.gen[r]) != entry[1]:
                return None
            if self._scanning:
                self._gone.add(okey)
            return self._take(okey, r)

    def drop_all(self) -> int:
        """Empty the index (quotas and eviction counts stay); how many objects it held. The
        caller removes the files (``FsCard.clean`` walks the databases)."""
        with self._lock:
            n = self._rows.n
            self._rows = Rows()
            self._slots = _free_slots(2048)
            self._mask = len(self._slots) - 1
            self._pending.clear()
            self._queues.clear()
            for ns in self._ns:
                ns.used = ns.objects = 0
            self._used = self._files = 0
        return n

    def _take(self, okey: bytes, r: int) -> Optional[list[FileOf]]:
        """(lock held) Take an object (row ``r``, -1: none) and its fragments in flight out of
        the index; its files, head first, or None when neither was there."""
        parts = self._pending.pop(okey, None)
        if r < 0 and parts is None:
            return None
        ns = self._ns[self._namespace(tenant_of(okey))]
        paths: list[FileOf] = []
        if r >= 0:
            paths = self._paths(r)
            disk = int(self._rows.disk[r])
            self._used -= disk
            ns.used -= disk
            ns.objects -= 1
            self._files -= int(self._rows.nfrag[r])
            self._remove_row(r)
        for fk, (d, size) in (parts or {}).items():
            self._used -= size
            ns.used -= size
            path = FileOf(d, fk)
            if path not in paths:
                paths.append(path)
        return paths

    def _evict(self, ns_index: int, more: Callable[[], bool], keep: bytes, victims: list[FileOf],
               pins: bool = True, limit: Optional[int] = None) -> int:
        """(lock held) Evict least recently used objects (of namespace ``ns_index``; -1: any)
        while ``more()`` (and at most ``limit``), never ``keep``, one with a write in flight
        (``_pending``: a new write of it is rewriting its files), nor (with ``pins``) a pinned
        one; their files go to ``victims``. How many were evicted."""
        queue = self._queues.setdefault(ns_index, collections.deque())
        skipped: list[tuple[bytes, int]] = []
        evicted = 0
        size = 0                                   # the last refill's size (0: none yet)
        fruitful = True                            # the last refill gave victims (or there was none)
        rows = self._rows
        while more() and (limit is None or evicted < limit):
            if not queue:
                count = rows.n if ns_index < 0 else self._ns[ns_index].objects
                if not fruitful and size >= count:
                    break                          # every row was queued and none could go: pinned
                size = min(count, max(MIN_QUEUE, rows.n // 32) if fruitful else 2 * size)
                queue.extend(self._oldest(ns_index, size))
                skipped.clear()                    # the refill queued them again
                fruitful = False
                if not queue:
                    break
            okey, tick = queue.popleft()
            r = self._row(okey)
            if r < 0 or int(rows.tick[r]) != tick:
                continue                           # gone, or used since it was queued
            if okey == keep or okey in self._pending or (pins and self.is_pinned(okey)):
                skipped.append((okey, tick))
                continue
            ns = self._ns[int(rows.ns[r])]
            taken = self._take(okey, r)
            assert taken is not None                # r >= 0 (checked above): the row was there
            victims.extend(taken)
            fruitful = True
            if self._scanning:
                self._gone.add(okey)
            if ns_index < 0:
                ns.capacity_evicted += 1
            else:
                ns.evicted += 1
            evicted += 1
        queue.extendleft(reversed(skipped))        # still the oldest
        return evicted

    def _oldest(self, ns_index: int, k: int) -> list[tuple[bytes, int]]:
        """(lock held) The ``k`` least recently used rows (of a namespace; -1: any), oldest
        first, as (key, tick)."""
        rows = self._rows
        ticks = rows.tick[:rows.n]
        if ns_index < 0:
            idx = np.arange(rows.n)
        else:
            idx = np.flatnonzero(rows.ns[:rows.n] == ns_index)
            ticks = ticks[idx]
        if len(idx) > k:
            part = np.argpartition(ticks, k - 1)[:k]
            idx, ticks = idx[part], ticks[part]
        order = np.argsort(ticks, kind="stable")
        idx, ticks = idx[order], ticks[order]
        keys = rows.key[idx]
        return [(keys[j].tobytes(), t) for j, t in enumerate(ticks.tolist())]

    def trim(self, limit: int = TRIM_CHUNK, pins: bool = True) -> list[FileOf]:
        """One step of bringing every namespace within its quota and the card within its
        watermark (after the scan, or quotas lowered since the card was written): at most
        ``limit`` least recently used objects go, so that the lock is held for one chunk of
        victims only and requests are answered between steps; the caller repeats it until
        it returns nothing (``over``: how far there is to go). Their files."""
        victims: list[FileOf] = []
        with self._lock:
            left = limit
            for i, ns in enumerate(self._ns):
                if left and ns.quota and ns.over_by(0):
                    n = self._evict(i, lambda: ns.over_by(0) > 0, b"", victims, pins, left)
                    self.evicted += n
                    left -= n
            if left and self.capacity_bytes and self._used > self.capacity_bytes * self.watermark:
                target = self.capacity_bytes * (self.watermark - self.ratio)
                self.evicted += self._evict(-1, lambda: self._used > target, b"", victims, pins, left)
        return victims

    def over(self) -> int:
        """The bytes a trim has to free (over the quotas, and the card over its watermark down
        to ``watermark - ratio``): for its progress."""
        with self._lock:
            quota = sum(ns.over_by(0) for ns in self._ns if ns.quota)
            card = 0
            if self.capacity_bytes and self._used > self.capacity_bytes * self.watermark:
                card = int(self._used - self.capacity_bytes * (self.watermark - self.ratio))
            return max(quota, card)

    # ------------------------------------------------------------------ snapshot
    def save(self, dir_fd: int, name: str, serial: str, stamps: dict[str, int],
             own_file: Callable[[int], None]) -> None:
        """Write the table to file ``name`` of the directory ``dir_fd`` (``fs_snapshot.write``,
        under the lock): ``serial`` the card's, ``stamps`` each database directory's
        modification time (ns). Nothing while writes are in flight or the scan unfinished."""
        with self._lock:
            if self._pending or self._scanning:
                logger.info("fs card %s: writes in flight or a scan unfinished: no index snapshot", self.root)
                return
            rows = self._rows
            fs_snapshot.write(dir_fd, name, serial, stamps, self.num_dbs,
                              Snapshot(rows, [ns.tid for ns in self._ns], self._gen, self._clock, self._seed,
                                       time.time(), self._slots), own_file)
        logger.info("fs card %s: index of %d objects saved", self.root, rows.n)

    def load(self, dir_fd: int, name: str, serial: str, stamps: dict[str, int]) -> Optional[str]:
        """Take the table from a snapshot ``save`` wrote (``fs_snapshot.read``: file ``name`` of
        the directory ``dir_fd``, when it may be taken). None when it did; else why not (no
        snapshot, not whole, another card's, older than the files), the index unchanged."""
        snapshot = fs_snapshot.read(dir_fd, name, serial, stamps, self.num_dbs)
        if isinstance(snapshot, str):
            return snapshot
        rows = snapshot.rows
        n = rows.n
        with self._lock:
            self._rows = rows
            self._ns, self._ns_of = [], {}
            for tid in snapshot.namespaces:
                self._namespace(tid)
            for tid in self.quotas:
                self._namespace(tid)
            ns = rows.ns[:n]
            used = np.bincount(ns, weights=rows.disk[:n], minlength=len(self._ns))
            count = np.bincount(ns, minlength=len(self._ns))
            for i, t in enumerate(self._ns):
                t.used, t.objects = int(used[i]), int(count[i])
            self._used = int(rows.disk[:n].sum())
            self._files = int(rows.nfrag[:n].sum())
            self._seed = snapshot.seed             # the rows' hashes were made with it
            self._gen = snapshot.gen
            self._clock = max(snapshot.clock, START_TICK)
            self._queues.clear()
            self.saved_at = snapshot.saved
            if snapshot.slots is not None:     # the table as it was saved (fs_snapshot checked it whole)
                self._slots, self._mask = snapshot.slots, len(snapshot.slots) - 1
                give_back_heap()               # that check's temporaries
            else:
                size = 2048
                while 2 * n > size:
                    size *= 2
                self._rehash(size)
        return None

    # ------------------------------------------------------------------ the scan at start
    def index_scanned(self, okey: bytes, parts: dict[bytes, tuple[int, int]], total: int, flen: int,
                      write_id: int, mtime: float, now: float) -> bool:
        """Index an object the scan found whole: ``parts`` fragment key -> (db, bytes on disk),
        ``total`` the size its head records, ``flen`` its head's payload length, ``write_id``
        the write id of all its fragments, ``mtime`` its newest file's. Nothing when the object was committed, deleted or evicted since
        the card opened. Whether it was indexed."""
        dbs = [parts[fragment_key(okey, i)][0] for i in range(len(parts))]
        with self._lock:
            if okey in self._gone or okey in self._pending or self._row(okey) >= 0:
                return False
            dbmod = self._layout(dbs)
            if dbmod is None:
                return False
            disk = sum(size for _, size in parts.values())
            ns_index = self._namespace(tenant_of(okey))
            r = self._insert(okey)
            self._set_row(r, disk, total, flen, len(parts), dbs[0], dbmod, write_id, _tick_of_age(now - mtime),
                          ns_index)
            self._used += disk
            self._ns[ns_index].used += disk
        return True

    def begin_scan(self) -> None:
        with self._lock:
            self._scanning = True

    def end_scan(self) -> None:
        with self._lock:
            self._scanning = False
            self._gone.clear()

    def in_flight(self, okey: bytes) -> bool:
        """Whether fragments of a write of the object wait for their head (``commit``)."""
        with self._lock:
            return okey in self._pending

    def object_keys(self) -> np.ndarray:
        """A copy of every indexed object's key (``uint8`` (n, 28), in its own mapping)."""
        with self._lock:
            n = self._rows.n
            keys = mapped((n, KEY_BYTES), np.uint8)
            keys[:] = self._rows.key[:n]
        return keys

    def held(self, okey: bytes) -> Optional[Held]:
        """What the index holds of an object now (None: not indexed); no use is stamped."""
        with self._lock:
            r = self._row(okey)
            if r < 0:
                return None
            files = [(self._fragment_db(r, i), self._fragment_size(r, i)) for i in range(int(self._rows.nfrag[r]))]
            return Held(files, int(self._rows.gen[r]), int(self._rows.tick[r]))

    def age(self, okey: bytes, held: Held, mtime: float) -> None:
        """Give an object the LRU place of files last written at ``mtime`` (as the scan gives
        it), unless it was stored or used since ``held`` was taken."""
        with self._lock:
            r = self._row(okey)
            if r >= 0 and int(self._rows.gen[r]) == held.gen and int(self._rows.tick[r]) == held.tick:
                self._rows.tick[r] = _tick_of_age(time.time() - mtime)

    def forget(self, okey: bytes, held: Held) -> bool:
        """Take an object out of the index, its files left to the caller to judge, unless it
        was stored or dropped since ``held`` was taken; whether it was taken out."""
        with self._lock:
            r = self._row(okey)
            if r < 0 or int(self._rows.gen[r]) != held.gen:
                return False
            self._take(okey, r)
            return True

def _tick_of_age(age_s: float) -> int:
    """The LRU tick of a file last written ``age_s`` ago: older than any use since the start,
    by milliseconds for 12 days, then by seconds."""
    ms = int(max(age_s, 0.0) * 1000)
    fine = 1 << 30
    return START_TICK - 1 - (ms if ms < fine else min(fine + (ms - fine) // 1000, START_TICK - 2))
