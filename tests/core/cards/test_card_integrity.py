"""Card integrity: an object (all its fragments) lives and dies whole, replicas are read,
crash leftovers never block a card, fsync covers the directory, card files are private."""

from __future__ import annotations

import grp
import json
import os
import stat
import time

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards.fs import card as fs_mod
from adpkv_gateway.cards.base import CardError, Read
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.cards.fs.files import object_name

from ..fs_cards import object_dirs, object_paths
from ..rankproc import get_checked, make_keys, pattern

HEADER = fs_mod.HEADER_BYTES


def stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


class Client:
    """One engine rank in this process: put/get/exist with exact-byte checks."""

    def __init__(self, port, engine="t"):
        self.c = GatewayClient(ClientConfig(port=port, timeout_s=20.0, busy_wait_s=5), engine)
        assert self.c.enabled, self.c.attach_error

    def put(self, keys, nbytes, marks=None):
        c = self.c

        def fill(b):
            for j in range(b.count):
                o = b.offset + j * b.stride
                c.ring[o:o + nbytes] = pattern(keys[b.first + j], 0, nbytes)
        flags = c.put(keys, nbytes, fill, marks=marks).result(timeout=30)
        return flags.stored, flags.existed

    def get(self, keys, nbytes, marks=None):
        return get_checked(self.c, keys, nbytes, marks=marks, timeout=30)

    def exist(self, keys):
        return list(self.c.exist(keys).result(timeout=30))

    def close(self):
        self.c.close()


def _files(card_dir):
    out = {}
    for path in object_paths(card_dir, hidden=True):
        out[os.path.basename(path)] = path
    return out


def _frag_path(card_dir, key, index):
    return _files(card_dir).get((key + index.to_bytes(2, "big")).hex())


# ---------------------------------------------------------------- whole objects
def test_eviction_with_fragments_never_leaves_an_object_present_but_unreadable(start_gateway):
    obj = 80 * 1024                                 # 5 fragments of 16 KiB
    on_disk = obj + 5 * HEADER
    capacity = 12 * on_disk
    gw = start_gateway(fragment_size=16 * 1024, num_dbs=4, capacity_bytes=capacity,
                       eviction_watermark=0.9, eviction_ratio=0.13)
    c = Client(gw.port)
    keys = make_keys(60, salt=b"ev")
    for start in range(0, len(keys), 3):
        c.put(keys[start:start + 3], obj)
        seen = keys[:start + 3]
        present = c.exist(seen)
        hits = c.get(seen, obj)
        assert hits == present, ("EXIST and GET disagree after eviction: "
                                 f"{[i for i, (p, h) in enumerate(zip(present, hits)) if p != h]}")
    assert stats(gw.port)["cards"][0]["evicted"] > 0
    # the oldest objects are gone: a re-PUT stores them again and they read back exactly
    first = keys[:3]
    assert c.exist(first) == [False] * 3
    assert c.put(first, obj) == ([True] * 3, [False] * 3)
    assert c.get(first, obj) == [True] * 3
    # usage is exactly the bytes on disk
    used = stats(gw.port)["cards"][0]["used_bytes"]
    assert used == sum(os.path.getsize(p) for p in _files(gw.card_dirs[0]).values())
    c.close()


def test_corrupt_non_head_fragment_is_a_miss_and_a_reput_stores_it_again(start_gateway):
    gw = start_gateway(fragment_size=64 * 1024, num_dbs=8)
    obj = 300 * 1024                                # 5 fragments
    keys = make_keys(2, salt=b"corrupt")
    c = Client(gw.port)
    assert c.put(keys, obj)[0] == [True, True]
    path = _frag_path(gw.card_dirs[0], keys[0], 2)
    with open(path, "r+b") as fh:
        fh.seek(HEADER + 1000)
        fh.write(b"flipped!")
    assert c.get(keys, obj) == [False, True]
    assert c.exist(keys) == [False, True], "an object with a bad fragment must not be present"
    files = _files(gw.card_dirs[0])
    assert not any(n.startswith(keys[0].hex()) for n in files), "the whole object must be removed"
    stored, existed = c.put(keys, obj)
    assert stored == [True, True] and existed == [False, True], "the re-PUT must write the object again"
    assert c.get(keys, obj) == [True, True]
    c.close()


def test_truncated_file_is_absent_after_a_restart(start_gateway):
    gw = start_gateway()
    obj = 64 * 1024
    keys = make_keys(3, salt=b"trunc")
    c = Client(gw.port)
    c.put(keys, obj)
    c.close()
    gw.stop()
    path = _frag_path(gw.card_dirs[0], keys[1], 0)
    os.truncate(path, HEADER + obj // 2)
    gw.start()
    c = Client(gw.port, "t2")
    assert c.exist(keys) == [True, False, True]
    assert c.get(keys, obj) == [True, False, True]
    stored, existed = c.put(keys, obj)
    assert existed == [True, False, True] and all(stored)
    assert c.get(keys, obj) == [True, True, True]
    used = stats(gw.port)["cards"][0]["used_bytes"]
    assert used == sum(os.path.getsize(p) for p in _files(gw.card_dirs[0]).values())
    c.close()


def test_resp_card_object_with_a_lost_fragment_is_absent(redis_servers, start_gateway):
    """Redis's own LRU may drop one fragment key of an object: the object is then absent."""
    server, = redis_servers(1)
    gw = start_gateway(card_dirs=[server.url], storage_backend="resp", fragment_size=16 * 1024, num_dbs=4)
    obj = 50 * 1024                                 # 4 fragments
    keys = make_keys(2, salt=b"resp")
    c = Client(gw.port)
    assert c.put(keys, obj)[0] == [True, True]
    from adpkv_gateway.cards.resp.conn import RespConnection
    conn = RespConnection(server.url, 5.0)
    frag = keys[0] + (2).to_bytes(2, "big")
    victims = [k for k in conn.command(b"KEYS", b"adpkv:*") if k.endswith(frag)]
    assert len(victims) == 1
    conn.command(b"DEL", victims[0])
    assert c.exist(keys) == [False, True]
    assert c.get(keys, obj) == [False, True]
    stored, existed = c.put(keys, obj)
    assert stored == [True, True] and existed == [False, True]
    assert c.get(keys, obj) == [True, True]
    conn.close()
    c.close()


# ---------------------------------------------------------------- replicas
def test_a_read_falls_back_to_the_next_replica(start_gateway, tmp_path):
    dirs = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    gw = start_gateway(card_dirs=dirs, replicas=2, fragment_size=16 * 1024, num_dbs=4, key_placement="stripe")
    obj = 40 * 1024                                 # 3 fragments
    keys = make_keys(16, salt=b"rep")
    c = Client(gw.port)
    assert c.put(keys, obj)[0] == [True] * 16
    # card 0 loses its copy of every object: half the files removed, the other half corrupted
    for i, (name, path) in enumerate(sorted(_files(dirs[0]).items())):
        if i % 2:
            os.unlink(path)
        else:
            with open(path, "r+b") as fh:
                fh.seek(HEADER + 10)
                fh.write(b"XXXX")
    assert c.get(keys, obj) == [True] * 16, "a replica on the other card must serve every object"
    assert c.exist(keys) == [True] * 16
    assert c.get(keys, obj) == [True] * 16
    c.close()


# ---------------------------------------------------------------- crash leftovers
def test_leftover_card_file_tmp_of_a_crashed_first_start_is_cleaned(start_gateway, tmp_path):
    """The leftover is cleaned and the card starts; an unreadable card file still refuses."""
    card = tmp_path / "fresh"
    card.mkdir()
    (card / "adpkv-card.json.tmp").write_text('{"serial": "FS12')      # cut short by the crash
    gw = start_gateway(card_dirs=[str(card)])
    assert not (card / "adpkv-card.json.tmp").exists()
    assert json.loads((card / "adpkv-card.json").read_text())["serial"].startswith("FS")
    c = Client(gw.port)
    keys = make_keys(2, salt=b"tmp")
    assert c.put(keys, 4096)[0] == [True, True]
    c.close()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adpkv-card.json").write_text("{not json")
    (bad / "adpkv-card.json.tmp").write_text("{}")
    with pytest.raises(CardError, match="unreadable"):
        FsCard(str(bad)).open()


# ---------------------------------------------------------------- fsync
def test_fsync_covers_the_directory_and_the_card_file(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", recording_fsync)

    def ident(path):
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    root = tmp_path / "card"
    card = FsCard(str(root), num_dbs=2, fsync=True)
    card.open()
    assert ident(root / "adpkv-card.json") in synced
    assert ident(root) in synced, "the card's directory was not fsynced after adding adpkv-card.json"
    synced.clear()
    key = b"k" * 28 + b"\0\0"
    assert card.write(1, key, memoryview(b"x" * 5000))
    path = root / "db001" / object_name(key)
    assert ident(path) in synced, "the object file was not fsynced"
    assert ident(path.parent) in synced, "the object's subdirectory was not fsynced after the rename"
    card.close()


# ---------------------------------------------------------------- permissions
def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_card_files_are_private_by_default(start_gateway, tmp_path):
    old = os.umask(0o022)
    try:
        gw = start_gateway(card_dirs=[str(tmp_path / "priv")])
    finally:
        os.umask(old)
    c = Client(gw.port)
    keys = make_keys(2, salt=b"mode")
    assert c.put(keys, 8192)[0] == [True, True]
    c.close()
    root = gw.card_dirs[0]
    assert _mode(root) == 0o700
    assert _mode(os.path.join(root, "adpkv-card.json")) == 0o600
    for d in os.listdir(root):
        if d.startswith("db"):
            assert _mode(os.path.join(root, d)) == 0o700, d
    for d in object_dirs(root):
        assert _mode(d) == 0o700, d
    files = _files(root)
    assert len(files) == 2
    assert all(_mode(p) == 0o600 for p in files.values())


def test_card_group_shares_the_card_with_a_group(start_gateway, tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    gw = start_gateway(card_dirs=[str(tmp_path / "shared")], card_group=group)
    c = Client(gw.port)
    keys = make_keys(1, salt=b"grp")
    assert c.put(keys, 8192)[0] == [True]
    c.close()
    root = gw.card_dirs[0]
    assert _mode(root) & 0o777 == 0o750
    assert _mode(os.path.join(root, "adpkv-card.json")) == 0o640
    path, = _files(root).values()
    assert _mode(path) == 0o640 and os.stat(path).st_gid == os.getgid()
    assert _mode(os.path.dirname(path)) & 0o777 == 0o750


# ---------------------------------------------------------------- a store cut short
_CUT_SHORT = r"""
import os, sys
from adpkv_gateway.cards.fs.card import FsCard
root, region, point, o_direct = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
card = FsCard(root, num_dbs=2, o_direct=o_direct)
card.open()
fd = os.open(region, os.O_RDONLY)
real_pwritev = os.pwritev
if point == "mid-write":          # the process dies with half of the object file written
    def pwritev(f, bufs, offset):
        real_pwritev(f, [memoryview(bufs[0])[:4096], memoryview(bufs[1])[:len(bufs[1]) // 2]], offset)
        os._exit(9)
    os.pwritev = pwritev
else:                             # the whole file written, the process dies before its rename
    os.rename = lambda *a, **k: os._exit(9)
card.write_from_fd(0, b"k" * 28 + b"\0\0", 1 << 20, fd, 4096, object_bytes=1 << 20)
os._exit(0)                       # not reached: the write dies first
"""


@pytest.mark.parametrize("o_direct", [False, True], ids=["page-cache", "o_direct"])
@pytest.mark.parametrize("point", ["mid-write", "before-rename"])
def test_a_store_from_a_region_cut_short_leaves_no_object_that_reads_as_present(tmp_path, point, o_direct):
    """A gateway killed while it writes an object from a client's region (``write_from_fd``,
    buffered or O_DIRECT): after a restart the object is absent (a miss), nothing of the
    write is left, and the key stores and reads back exactly."""
    import subprocess
    import sys
    root, region = tmp_path / "card", tmp_path / "region"
    data = os.urandom(4096 + (1 << 20))
    region.write_bytes(data)
    done = subprocess.run([sys.executable, "-c", _CUT_SHORT, str(root), str(region), point, "1" if o_direct else "0"],
                          timeout=120)
    assert done.returncode == 9, "the write was not cut short where the test meant to"
    leftovers = object_paths(str(root), hidden=True)
    assert leftovers, "the cut-short write left no file: the test cut nothing"
    card = FsCard(str(root), num_dbs=2, o_direct=o_direct)
    card.open()
    key = b"k" * 28 + b"\0\0"
    assert card.contains_many([(0, key)]) == [False]
    assert card.object_sizes([(0, key)]) == [None]
    assert card.read(0, key, memoryview(bytearray(1 << 20))) is Read.ABSENT
    assert not _files(root), "the leftover of the cut-short write is still there"
    fd = os.open(region, os.O_RDONLY)
    try:
        assert card.write_from_fd(0, key, 1 << 20, fd, 4096, object_bytes=1 << 20)
    finally:
        os.close(fd)
    out = bytearray(1 << 20)
    assert card.read(0, key, memoryview(out)) is Read.HIT and bytes(out) == data[4096:]
    card.close()


# ---------------------------------------------------------------- cached objects into a region
def _stored_object(tmp_path, size, seed):
    """An object file written from a region (the gateway's ``write_object_file``), still in
    the page cache; (its fragment key, its path, the payload, the region's path)."""
    import random
    from adpkv_gateway.cards.objfile import FdSlice, Scratch, write_object_file
    payload = random.Random(seed).randbytes(size)
    region = tmp_path / f"region-{seed}"
    region.write_bytes(payload + bytes(size))          # the payload, then room for the copy back
    fkey = (b"%027d" % seed) + b"r\0\0"
    path = tmp_path / f"object-{seed}"
    rfd = os.open(region, os.O_RDONLY)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        write_object_file(fd, fkey, FdSlice(rfd, 0, size), 0, False, Scratch())
    finally:
        os.close(fd)
        os.close(rfd)
    return fkey, path, payload, region


@pytest.mark.parametrize("size", [1 << 20, 3 << 20], ids=["whole", "pieces"])
@pytest.mark.parametrize("damage", ["none", "flipped byte", "truncated", "foreign header"])
def test_a_cached_object_copied_into_a_region_is_exact_or_a_miss(tmp_path, size, damage):
    """``copy_object_file`` of a page-cache-hot file (the hot load of a CPU-tier row): byte
    exact when intact; a flipped byte, a cut file or another key's header is a miss. Up to
    ``WHOLE_CACHED`` the object is checked before anything lands: the destination keeps its
    bytes."""
    from adpkv_gateway.cards.objfile import WHOLE_CACHED, Scratch, copy_object_file, page_cached
    fkey, path, payload, region = _stored_object(tmp_path, size, 11)
    if damage == "flipped byte":
        with open(path, "r+b") as fh:
            fh.seek(-(size // 3), os.SEEK_END)
            b = fh.read(1)
            fh.seek(-(size // 3), os.SEEK_END)
            fh.write(bytes([b[0] ^ 0x5A]))
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 4096)
    elif damage == "foreign header":
        fkey = fkey[:-3] + b"x\0\0"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert page_cached(fd) is not False, "the object file is not in the page cache: not the hot path"
    finally:
        os.close(fd)
    rfd = os.open(region, os.O_RDWR)
    try:
        os.pwrite(rfd, b"\xee" * size, size)
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            verdict = copy_object_file(dir_fd, os.path.basename(path), fkey, size, rfd, size, Scratch())
        finally:
            os.close(dir_fd)
        got = os.pread(rfd, size, size)
    finally:
        os.close(rfd)
    if damage == "none":
        assert verdict is Read.HIT and got == payload
        return
    assert verdict in (Read.BAD_CHECKSUM, Read.TRUNCATED, Read.BAD_HEADER), verdict
    if size <= WHOLE_CACHED:
        assert got == b"\xee" * size, "a damaged object wrote into the destination"


def test_a_card_file_changed_after_its_check_cannot_reach_the_region(tmp_path, monkeypatch):
    """The whole-object hot copy writes the destination from the buffer it checked: a card
    file overwritten right after the check (between the checksum and the ``pwrite``) changes
    nothing that lands; the next copy reads the damage and reports it."""
    from adpkv_gateway.cards import objfile, objfmt
    size = 1 << 20
    fkey, path, payload, region = _stored_object(tmp_path, size, 12)
    real_payload_ok = objfmt.payload_ok
    changed = []

    def check_then_damage(header, data):
        ok = real_payload_ok(header, data)
        with open(path, "r+b") as fh:                # the card file changes after its check
            fh.seek(HEADER + 1234)
            fh.write(b"\x00" * 64)
        changed.append(True)
        return ok
    monkeypatch.setattr(objfmt, "payload_ok", check_then_damage)
    rfd = os.open(region, os.O_RDWR)
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    name = os.path.basename(path)
    try:
        assert objfile.copy_object_file(dir_fd, name, fkey, size, rfd, size, objfile.Scratch()) is Read.HIT
        assert changed, "the check did not run: the test damaged nothing"
        assert os.pread(rfd, size, size) == payload, "bytes changed after their check reached the region"
        monkeypatch.setattr(objfmt, "payload_ok", real_payload_ok)
        os.pwrite(rfd, b"\xee" * size, size)
        assert objfile.copy_object_file(dir_fd, name, fkey, size, rfd, size, objfile.Scratch()) is Read.BAD_CHECKSUM
        assert os.pread(rfd, size, size) == b"\xee" * size
    finally:
        os.close(rfd)
        os.close(dir_fd)


# ---------------------------------------------------------------- a stale failed-read verdict
_STALE_KEY = b"k" * 28 + b"\0\0"


def _race(card, how, data):
    """The two halves of what happens to X between a reader's lookup and its verdict: (before
    the reader opens the file, after it found it gone). ``evicted``: X leaves the index, its
    files are unlinked, then a PUT stores it again; ``moved``: a PUT of the fragment into the
    other database, whose commit unlinks the old file. Either PUT is acknowledged."""
    def gone():
        if how == "evicted":
            card._remove(card.index.drop(_STALE_KEY[:-2]))
        else:
            assert card.write(1, _STALE_KEY, data, object_bytes=len(data))

    def back():
        if how == "evicted":
            assert card.write(0, _STALE_KEY, data, object_bytes=len(data))
    return gone, back


@pytest.mark.parametrize("how", ["evicted", "moved"])
def test_a_stale_failed_read_does_not_drop_a_newer_store(tmp_path, how):
    """The I/O-process path (real card, real files; the race's steps in its order): the card
    hands a reader the file of X (``process_reads``); X is evicted (or its fragment moved);
    the reader finds the file missing; X is stored again and acknowledged; then the reader's
    verdict arrives (``process_read_result``). The acknowledged store stays, readable; a
    verdict on the object the reader was handed still drops it."""
    from adpkv_gateway.cards.objfile import read_object_file
    card = FsCard(str(tmp_path / "card"), num_dbs=2)
    card.open()
    data = memoryview(bytearray(os.urandom(8192)))
    gone, back = _race(card, how, data)
    try:
        assert card.write(0, _STALE_KEY, data, object_bytes=8192)
        task, = card.process_reads([_STALE_KEY], [None])            # a reader is handed the file ...
        gone()                                                      # ... X is evicted or moved ...
        reader_dir = os.open(task.dir_ref, os.O_RDONLY | os.O_DIRECTORY)   # as an I/O process opens it
        try:
            verdict = read_object_file(reader_dir, object_name(_STALE_KEY), _STALE_KEY, memoryview(bytearray(8192)),
                                       False, card._scratch)
        finally:
            os.close(reader_dir)
        assert verdict is Read.ABSENT                               # ... the reader finds it gone ...
        back()                                                      # ... X is stored (acknowledged) ...
        assert card.process_read_result(task, verdict) is Read.CHANGED   # ... the stale verdict: a miss
        assert card.contains_many([(0, _STALE_KEY)], [8192]) == [True], "the acknowledged store was dropped"
        out = bytearray(8192)
        assert card.read(0, _STALE_KEY, memoryview(out)) is Read.HIT and out == data, \
            "the acknowledged store is unreadable"
        fresh, = card.process_reads([_STALE_KEY], [None])           # a verdict on the entry it was handed
        path = os.path.join(fresh.dir_ref, object_name(_STALE_KEY))   # the file the reader was handed
        os.truncate(path, 4096)
        reader_dir = os.open(fresh.dir_ref, os.O_RDONLY | os.O_DIRECTORY)
        try:
            verdict = read_object_file(reader_dir, object_name(_STALE_KEY), _STALE_KEY, memoryview(bytearray(8192)),
                                       False, card._scratch)
        finally:
            os.close(reader_dir)
        assert verdict is Read.TRUNCATED
        assert card.process_read_result(fresh, verdict) is Read.TRUNCATED
        assert card.contains_many([(0, _STALE_KEY)]) == [False], "a damaged object was kept"
        assert not os.path.exists(path)
    finally:
        card.close()


@pytest.mark.parametrize("how", ["evicted", "moved"])
@pytest.mark.parametrize("reader", ["read", "read_to_fd"])
def test_a_stale_failed_read_in_a_thread_does_not_drop_a_newer_store(tmp_path, monkeypatch, how, reader):
    """The thread path (``FsCard.read``, ``read_to_fd``; real card and files): the race is
    put between the card's lookup and its verdict by wrapping the file read (the one stand-in:
    timing), which evicts or moves X, reads the gone file ("missing") and stores X again
    before the verdict. The acknowledged store stays, readable."""
    card = FsCard(str(tmp_path / "card"), num_dbs=2)
    card.open()
    data = memoryview(bytearray(os.urandom(8192)))
    gone, back = _race(card, how, data)
    raced = []

    def racing(real):
        def run(*args, **kwargs):
            if raced:                                       # only the first read races
                return real(*args, **kwargs)
            gone()
            problem = real(*args, **kwargs)
            back()
            raced.append(problem)
            return problem
        return run

    region = tmp_path / "region"
    region.write_bytes(bytes(8192))
    rfd = os.open(region, os.O_RDWR)
    try:
        assert card.write(0, _STALE_KEY, data, object_bytes=8192)
        if reader == "read":
            monkeypatch.setattr(fs_mod, "read_object_file", racing(fs_mod.read_object_file))
            assert card.read(0, _STALE_KEY, memoryview(bytearray(8192))) is Read.CHANGED
        else:
            monkeypatch.setattr(fs_mod, "copy_object_file", racing(fs_mod.copy_object_file))
            assert card.read_to_fd(0, _STALE_KEY, 8192, rfd, 0) is Read.CHANGED
        assert raced == [Read.ABSENT], f"the race did not run as meant: {raced}"
        assert card.contains_many([(0, _STALE_KEY)], [8192]) == [True], "the acknowledged store was dropped"
        out = bytearray(8192)
        assert card.read(0, _STALE_KEY, memoryview(out)) is Read.HIT and out == data, \
            "the acknowledged store is unreadable"
        assert card.read_to_fd(0, _STALE_KEY, 8192, rfd, 0) is Read.HIT and os.pread(rfd, 8192, 0) == data
    finally:
        os.close(rfd)
        card.close()
