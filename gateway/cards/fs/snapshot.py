"""The fs card's index snapshot: the index's table (``fs_rows.Rows``) in one file, written at
a clean stop and taken at the next start instead of a scan when it still matches the files.

Contract:

- ``write`` puts a ``Snapshot`` in file ``name`` of a directory (a temporary file created
  there with ``O_EXCL | O_NOFOLLOW``, fsynced, renamed into place), with the card's serial,
  the number of databases and the modification time of each database directory
  (``stamps``). The caller holds its index's lock throughout (the rows do not change while
  they are written).
- The file: ``SNAPSHOT_MAGIC``, ``SNAPSHOT_FORMAT`` and the length of a JSON head (4 bytes
  each, little-endian), the head (serial, rows, databases, stamps, namespaces, generation,
  clock, seed, hash name, when saved, column names, the size of the hash table or 0), each
  column's first ``rows`` entries in ``Rows.COLUMNS`` order, the index's hash table (``int32``
  slots, ``EMPTY`` or a row: the index takes it as it is instead of hashing every key again,
  which at millions of objects was most of a restart), then the xxh3-64 of everything before it.
  ``read`` takes a table only when its size is a power of two of at least twice the rows and
  it holds every row exactly once (a damaged table must not make a row unreachable or point
  past the rows); otherwise the snapshot comes without one and the index hashes its keys.
- ``read`` gives the ``Snapshot`` only when the file is the gateway's own (its uid), whole
  (its checksum), of this format, this card's (serial), of the same databases whose
  directories' times are still the recorded ones (a file created, renamed or removed in a
  directory since changes its time: a snapshot older than the files is never taken), and
  of these columns and this hash (``fs_rows.HASH_NAME``). Otherwise it says why not, as a
  short phrase ("none" when there is no snapshot); it changes nothing either way (the card
  removes the file).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import xxhash

from adpkv_gateway.cards.fs.files import READ_FLAGS, FileRef, unlink_all
from adpkv_gateway.cards.fs.rows import HASH_NAME, Rows, bytes_of, mapped

SNAPSHOT_MAGIC = b"ADPKVIDX"
SNAPSHOT_FORMAT = 3            # 3: the hash table too; 2: rows carry write ids. Others are ignored (the card scans)
EMPTY_SLOT = -1                # a free slot of the hash table (``fs_index.EMPTY``)


@dataclass(frozen=True)
class Snapshot:
    """An index as its snapshot holds it: the rows (``rows.n`` objects), the namespace ids in
    the index's order (a row's ``ns`` is a position in it), the index's write generation and
    LRU clock, the seed its keys were hashed with, when it was saved (wall clock), and the
    hash table built with that seed (``int32`` slots) when it has one."""

    rows: Rows
    namespaces: list[bytes]
    gen: int
    clock: int
    seed: int
    saved: float
    slots: Optional[np.ndarray] = None      # the hash table of ``rows`` under ``seed`` (None: hash again)


def _whole_table(slots: np.ndarray, n: int) -> bool:
    """Whether a hash table holds rows ``0 .. n-1`` each exactly once and nothing else."""
    used = slots[slots != EMPTY_SLOT]
    if len(used) != n or (n and (used.min() < 0 or used.max() >= n)):
        return False
    return bool(n == 0 or (np.bincount(used, minlength=n) == 1).all())


def _columns() -> list[str]:
    return [c[0] for c in Rows.COLUMNS]


def write(dir_fd: int, name: str, serial: str, stamps: dict[str, int], num_dbs: int, snapshot: Snapshot,
          own_file: Callable[[int], None]) -> None:
    """Write ``snapshot`` to file ``name`` of the directory ``dir_fd`` (``own_file(fd)`` gives
    it the card's mode and group); ``OSError`` when it cannot (no file is left behind)."""
    rows = snapshot.rows
    head = json.dumps({"serial": serial, "rows": rows.n, "num_dbs": num_dbs, "stamps": stamps,
                       "namespaces": [tid.hex() for tid in snapshot.namespaces], "gen": snapshot.gen,
                       "clock": snapshot.clock, "seed": snapshot.seed, "hash": HASH_NAME,
                       "saved": snapshot.saved, "columns": _columns(),
                       "slots": 0 if snapshot.slots is None else len(snapshot.slots)}).encode()
    tmp = name + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        own_file(fd)
        digest = xxhash.xxh3_64()
        with os.fdopen(os.dup(fd), "wb") as out:
            for piece in [SNAPSHOT_MAGIC, SNAPSHOT_FORMAT.to_bytes(4, "little"),
                          len(head).to_bytes(4, "little"), head] + \
                    [bytes_of(getattr(rows, c[0])[:rows.n]) for c in Rows.COLUMNS] + \
                    ([] if snapshot.slots is None else [bytes_of(snapshot.slots)]):
                out.write(piece)
                digest.update(piece)
            out.write(digest.intdigest().to_bytes(8, "little"))
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        os.close(fd)
        unlink_all([FileRef(dir_fd, tmp)])
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def read(dir_fd: int, name: str, serial: str, stamps: dict[str, int], num_dbs: int) -> Union[Snapshot, str]:
    """The snapshot ``write`` left in file ``name`` of the directory ``dir_fd`` (opened
    without following a symlink) when it may be taken (the module's contract); else why
    not (no snapshot, not whole, another card's, older than the files)."""
    try:
        with open(os.open(name, READ_FLAGS, dir_fd=dir_fd), "rb", buffering=0) as src:
            if os.fstat(src.fileno()).st_uid != os.geteuid():
                return "not the gateway's own file"
            got = src.read(16)
            if len(got) < 16 or got[:8] != SNAPSHOT_MAGIC:
                return "not an index snapshot"
            if int.from_bytes(got[8:12], "little") != SNAPSHOT_FORMAT:
                return "of another format"
            raw = src.read(int.from_bytes(got[12:16], "little"))
            digest = xxhash.xxh3_64(got)
            digest.update(raw)
            head = json.loads(raw)
            if head.get("serial") != serial:
                return f"of another card ({head.get('serial')})"
            if head.get("stamps") != stamps or head.get("num_dbs") != num_dbs:
                return "older than the files (a database directory changed since)"
            if head.get("columns") != _columns() or head.get("hash") != HASH_NAME:
                return "of another layout"
            n = int(head["rows"])
            rows = Rows(max(1024, 1 << max(0, n - 1).bit_length()))
            for column in _columns():
                view = bytes_of(getattr(rows, column)[:n])
                if src.readinto(view) != len(view):
                    return "truncated"
                digest.update(view)
            size = int(head.get("slots", 0))
            slots = None
            if size:
                if size & (size - 1) or size < 2 * n:
                    return "of another layout (its hash table)"
                slots = mapped((size,), np.int32)
                view = bytes_of(slots)
                if src.readinto(view) != len(view):
                    return "truncated"
                digest.update(view)
            if src.read(8) != digest.intdigest().to_bytes(8, "little") or src.read(1):
                return "damaged (checksum)"
            rows.n = n
            return Snapshot(rows, [bytes.fromhex(tid) for tid in head["namespaces"]], int(head["gen"]),
                            int(head["clock"]), int(head["seed"]), float(head["saved"]),
                            slots if slots is not None and _whole_table(slots, n) else None)
    except FileNotFoundError:
        return "none"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable ({exc})"
