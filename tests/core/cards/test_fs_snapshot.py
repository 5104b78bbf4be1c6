"""The fs index's snapshot carries its hash table (``fs_snapshot``, format 3): a restart takes
the table as saved instead of hashing every key again, and only a table that holds every row
exactly once: a damaged one (a row twice, a row missing, a slot past the rows, a size that is
not a power of two of at least twice the rows) is not taken, the keys are hashed again, and
every stored key is still found, never another row. Unit tests of the index alone (no files:
what the card does with a snapshot against its files is in test_fs_scale)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from adpkv_gateway.cards.fs import snapshot as fs_snapshot
from adpkv_gateway.cards.base import FirstExtent
from adpkv_gateway.cards.fs.files import FileRef
from adpkv_gateway.cards.fs.index import START_TICK, FsIndex
from adpkv_gateway.cards.fs.rows import Rows
from adpkv_gateway.cards.fragments import head_dbs
from adpkv_gateway.cards.quotas import tenant_of

from ..fs_cards import card_keys

N = 5000


def _rows(keys: list[bytes]) -> Rows:
    n = len(keys)
    rows = Rows(capacity=n)
    rows.n = n
    rows.key[:n] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, -1)
    rows.disk[:n], rows.total[:n], rows.flen[:n], rows.nfrag[:n] = 8192, 1024, 1024, 1
    rows.db0[:n], rows.dbmod[:n] = head_dbs(keys, 16), 0
    rows.gen[:n] = np.arange(1, n + 1)
    rows.wid[:n] = np.arange(7, n + 7, dtype=np.uint64)
    rows.tick[:n] = START_TICK - 1
    return rows


def _index(d: str, fd: int) -> FsIndex:
    return FsIndex(d, lambda db, fkey: FileRef(fd, fkey.hex()), num_dbs=16)


@pytest.fixture
def saved(tmp_path):
    """An index of N objects saved as a clean stop saves it: (directory, its fd, keys, the saved table)."""
    d = str(tmp_path)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    keys = card_keys(N)
    fs_snapshot.write(fd, "rows", "S", {}, 16, fs_snapshot.Snapshot(_rows(keys), [tenant_of(keys[0])], N,
                                                                    START_TICK, 99, time.time()), lambda f: None)
    index = _index(d, fd)
    assert index.load(fd, "rows", "S", {}) is None          # no table in that one: hashed here
    index.save(fd, "index", "S", {}, lambda f: None)
    got = fs_snapshot.read(fd, "index", "S", {}, 16)
    assert not isinstance(got, str) and got.slots is not None
    yield d, fd, keys, got
    os.close(fd)


def _found_rows(index: FsIndex, keys: list[bytes]) -> np.ndarray:
    """The write id each key's head records (0 where not found), through the batch lookup."""
    got = index.heads_found(keys, FirstExtent(None, 0))
    return np.where(got.found, got.write_id, 0)


def test_a_restart_takes_the_saved_table_and_finds_every_key(saved):
    d, fd, keys, snap = saved
    index = _index(d, fd)
    assert index.load(fd, "index", "S", {}) is None
    assert np.array_equal(index._slots, snap.slots)                   # taken as saved, not rebuilt
    assert list(_found_rows(index, keys)) == list(range(7, N + 7))    # each key its own row
    assert not _found_rows(index, card_keys(100, start=N)).any()      # others are not there


@pytest.mark.parametrize("damage", ["row twice", "row missing", "past the rows", "not a power of two", "too small"])
def test_a_damaged_table_is_not_taken_and_the_keys_are_hashed_again(saved, damage):
    d, fd, keys, snap = saved
    slots = np.array(snap.slots)
    used = np.flatnonzero(slots >= 0)
    if damage == "row twice":
        slots[used[1]] = slots[used[0]]
    elif damage == "row missing":
        slots[used[0]] = -1
    elif damage == "past the rows":
        slots[used[0]] = N
    elif damage == "not a power of two":
        slots = np.concatenate([slots, np.full(3, -1, slots.dtype)])
    else:
        slots = np.full(4096, -1, slots.dtype)          # a power of two under twice the rows
    # written whole (its checksum right): only the table's own check can refuse it
    fs_snapshot.write(fd, "damaged", "S", {}, 16, fs_snapshot.Snapshot(
        snap.rows, snap.namespaces, snap.gen, snap.clock, snap.seed, snap.saved, slots), lambda f: None)
    got = fs_snapshot.read(fd, "damaged", "S", {}, 16)
    if damage in ("not a power of two", "too small"):
        assert got == "of another layout (its hash table)"
        return
    assert not isinstance(got, str) and got.slots is None
    index = _index(d, fd)
    assert index.load(fd, "damaged", "S", {}) is None
    assert list(_found_rows(index, keys)) == list(range(7, N + 7))
