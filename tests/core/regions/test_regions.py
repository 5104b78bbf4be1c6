"""Registered regions: a rank's own /dev/shm buffer read and written by a real gateway directly."""

from __future__ import annotations

import ctypes
import os
import random
import socket

import msgspec
import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import DoorSession, recv
from adpkv_core.memory.regions import shared_file_of
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.ops.spawn import GatewayProcess

from ..rankproc import gateway_door, make_keys

OBJ = 256 * 1024 + 512          # deliberately not page aligned


def _address(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _client(port, name):
    return GatewayClient(ClientConfig(port=port, timeout_s=5.0, busy_wait_s=0), name, 0, 1)


def _stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


def test_finds_the_shm_file_behind_an_address(shm_buffer):
    path, arr = shm_buffer
    base = _address(arr)
    assert shared_file_of(base + 4096 * 3, 4096) == (path, 4096 * 3)
    assert shared_file_of(base, len(arr) + 1) is None               # runs past the mapping
    anon = bytearray(1 << 20)
    assert shared_file_of(_address(anon), len(anon)) is None        # anonymous memory


def test_get_into_and_put_from_a_region_are_byte_exact(gateway, shm_buffer):
    path, arr = shm_buffer
    keys = make_keys(12)
    rng = random.Random(1)
    src_at = [i * OBJ for i in range(12)]
    for at in src_at:
        arr[at:at + OBJ] = rng.randbytes(OBJ)
    expect = [arr[at:at + OBJ] for at in src_at]
    c = _client(gateway.port, "region-writer")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert region == 0
        stored = c.put_from(region, src_at[:10], keys[:10], OBJ).result(10)
        assert stored.stored == [True] * 10
        # read back into other places of the region, with two keys never stored
        dst_at = [4 << 20 | i * OBJ for i in range(12)]
        arr[4 << 20:] = bytes(len(arr) - (4 << 20))
        hits = c.get_into(region, dst_at, keys, OBJ).result(10).hits
        assert hits == [True] * 10 + [False] * 2
        for i in range(10):
            assert arr[dst_at[i]:dst_at[i] + OBJ] == expect[i], f"object {i} differs"
        s = _stats(gateway.port)
        assert s["counters"]["get_region_requests"] == 1 and s["counters"]["put_region_requests"] == 1
        assert s["regions"] == 1
        # the ring path sees the same objects (same keys, same bytes)
        out = {}

        def copy_out(b):
            for j in range(b.count):
                if b.hits[j]:
                    out[b.first + j] = bytes(c.ring[b.offset + j * b.stride:b.offset + j * b.stride + OBJ])
        assert c.get(keys[:10], OBJ, copy_out).result(10).hits == [True] * 10
        assert all(out[i] == expect[i] for i in range(10))
    finally:
        c.close()
    assert _stats(gateway.port)["regions"] == 0      # gone with the rank


def test_a_corrupt_object_read_into_a_region_is_a_miss(gateway, shm_buffer, tmp_path):
    path, arr = shm_buffer
    keys = make_keys(3)
    arr[:3 * OBJ] = b"\x07" * (3 * OBJ)
    c = _client(gateway.port, "region-corrupt")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert c.put_from(region, [0, OBJ, 2 * OBJ], keys, OBJ).result(10).stored == [True] * 3
        files = sorted(p for p in (tmp_path / "card0").rglob("*") if p.is_file() and p.name != "adpkv-card.json")
        victim = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        hits = c.get_into(region, [4 << 20, (4 << 20) + OBJ, (4 << 20) + 2 * OBJ], keys, OBJ).result(10).hits
        assert hits.count(False) == 1 and hits.count(True) == 2
    finally:
        c.close()


def _refusal(port, fd, offset, size):
    """What the gateway answers a REGION of ``fd`` on a fresh door session of our own."""
    session = DoorSession(gateway_door(port), 5.0)
    try:
        return session.register_region(fd, offset, size)
    finally:
        session.close()


@pytest.mark.security
@pytest.mark.parametrize("case", ["not-shared-memory", "too-long", "negative", "read-only", "mistyped"])
def test_bad_regions_are_refused_clearly(gateway, shm_buffer, tmp_path, case):
    path, arr = shm_buffer
    plain = tmp_path / "plain-file"
    plain.write_bytes(bytes(1 << 20))
    fd = os.open(plain if case == "not-shared-memory" else path,
                 os.O_RDONLY if case == "read-only" else os.O_RDWR)
    try:
        if case == "mistyped":
            session = DoorSession(gateway_door(gateway.port), 5.0)
            try:
                frame = msgspec.msgpack.encode({"v": 1, "op": "REGION", "offset": 0, "size": "10"})
                socket.send_fds(session.sock, [frame], [fd])
                reply = msgspec.msgpack.decode(recv(session.sock)[0])
            finally:
                session.close()
            assert reply["code"] == "BAD_MESSAGE", reply
        else:
            offset, size = {"too-long": (0, len(arr) + 1), "negative": (-1, 10)}.get(case, (0, 4096))
            reply = _refusal(gateway.port, fd, offset, size)
            assert reply.code == ("BAD_MESSAGE" if case == "negative" else "BAD_REGION"), reply
    finally:
        os.close(fd)
    c = _client(gateway.port, "region-bad")
    try:
        assert c.register_region("/dev/shm/adpkv-no-such-file", 0, 10).result(5) is None
        assert c.register_region("/dev/shm/adpkv-\0nul", 0, 10).result(5) is None     # was INTERNAL
        assert c.enabled                       # a refused request changes nothing
        assert c.register_region(path, 0, len(arr)).result(5) == 0
    finally:
        c.close()


@pytest.mark.security
def test_rings_and_foreign_ranges_are_refused(gateway, shm_buffer):
    path, arr = shm_buffer
    c = _client(gateway.port, "region-ring")
    try:
        assert _refusal(gateway.port, c._ring.fd, 0, 4096).code == "BAD_REGION"    # this gateway's ring
        with GatewayProcess(str(gateway.card_dirs[0]) + "-other", shared_memory_size=64 << 20) as other:  # another
            # gateway's ring (its engine's: handed to our attached rank there)
            other_client = _client(other.port, "region-ring-other")
            try:
                assert _refusal(gateway.port, other_client._ring.fd, 0, 4096).code == "BAD_REGION"
            finally:
                other_client.close()
        region = c.register_region(path, 0, 1 << 20).result(5)
        keys = make_keys(2)
        for at, reg in (([0, (1 << 20) - OBJ + 1], region), ([0, 0], region + 1)):
            reply = control.request(gateway.port, {"op": "GET", "keys": keys, "obj": OBJ, "region": reg, "at": at})
            assert reply["code"] in ("BAD_REGION", "NOT_ATTACHED"), reply
            assert c.get_into(reg, at, keys, OBJ).result(5).hits == [False, False]
        assert c.enabled
        with pytest.raises(P.ProtocolError, match="at and keys differ"):
            control.request(gateway.port, {"op": "PUT", "keys": keys, "obj": OBJ, "region": region, "at": [0]})
        assert _stats(gateway.port)["objects"].get("stored", 0) == 0
    finally:
        c.close()


@pytest.mark.security
def test_a_region_truncated_under_the_gateway_costs_only_its_own_objects(gateway, shm_buffer):
    """An engine that shrinks its region between REGION and GET/PUT: before the door, the
    gateway died of SIGBUS; now those objects miss / are not stored and the gateway serves on."""
    path, arr = shm_buffer
    keys = make_keys(8)
    c = _client(gateway.port, "region-truncate")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        arr[:4 * OBJ] = b"\x05" * (4 * OBJ)
        assert c.put_from(region, [i * OBJ for i in range(4)], keys[:4], OBJ).result(10).stored == [True] * 4
        os.truncate(path, 0)
        assert not any(c.put_from(region, [i * OBJ for i in range(4)], keys[4:], OBJ).result(10).stored)
        assert not any(c.get_into(region, [i * OBJ for i in range(4)], keys[:4], OBJ).result(10).hits)
        assert gateway.alive() and c.enabled
        out = []
        assert c.get(keys[:4], OBJ, lambda b: out.extend(
            bytes(c.ring[b.offset + j * b.stride:b.offset + j * b.stride + OBJ]) for j in range(b.count))
        ).result(10).hits == [True] * 4
        assert out == [b"\x05" * OBJ] * 4
        assert os.path.getsize(path) == 0           # the gateway did not grow the engine's file back
    finally:
        c.close()


@pytest.mark.security
def test_the_ring_cannot_be_resized_by_a_client(gateway):
    """The ring is a sealed memfd: a rank that tries to truncate it gets EPERM, the gateway
    never sees it change (before, a truncation between BATCH and FILLED killed it)."""
    c = _client(gateway.port, "ring-truncate")
    try:
        for size in (0, c._ring.size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(c._ring.fd, size)
        keys = make_keys(4)

        def fill(b):
            for j in range(b.count):
                c.ring[b.offset + j * b.stride:b.offset + j * b.stride + OBJ] = bytes([b.first + j + 1]) * OBJ
        assert c.put(keys, OBJ, fill).result(10).stored == [True] * 4
        assert gateway.alive()
    finally:
        c.close()


def test_a_stalled_gateway_never_writes_into_a_region_after_the_client_gave_up(gateway, shm_buffer):
    """A gateway that stalls (here: SIGSTOP) past the client's timeout must not write into the
    engine's buffer when it resumes: by then the engine was told "miss" and may have reused it.
    Each GET into a region carries the moment the client gives up (``write_by``, on the host's
    monotonic clock); the gateway writes nothing after it."""
    import signal
    import time
    path, arr = shm_buffer
    keys = make_keys(4)
    c = GatewayClient(ClientConfig(port=gateway.port, timeout_s=1.5, busy_wait_s=0), "region-stall", 0, 1)
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        arr[:4 * OBJ] = b"\x11" * (4 * OBJ)
        assert c.put_from(region, [i * OBJ for i in range(4)], keys, OBJ).result(10).stored == [True] * 4
        dst = [(4 << 20) + i * OBJ for i in range(4)]
        arr[4 << 20:(4 << 20) + 4 * OBJ] = bytes(4 * OBJ)
        gateway.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            fut = c.get_into(region, dst, keys, OBJ)
            assert fut.result(10).hits == [False] * 4            # the client gave up: a miss
            assert time.monotonic() - t0 >= 1.0
            arr[4 << 20:(4 << 20) + 4 * OBJ] = b"\x22" * (4 * OBJ)   # the engine reuses its buffer
        finally:
            gateway.proc.send_signal(signal.SIGCONT)
        # the resumed gateway processes the late GET: it must leave the buffer alone
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and control.request(gateway.port, {"op": "STATS"}, timeout_s=2.0) is None:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            s = _stats(gateway.port)
            if s["requests_in_flight"] == 0 and s["counters"].get("get_region_requests", 0) >= 1:
                break
        assert s["requests_in_flight"] == 0 and s["counters"].get("get_region_requests", 0) >= 1
        assert bytes(arr[4 << 20:(4 << 20) + 4 * OBJ]) == b"\x22" * (4 * OBJ), "a stale write hit the buffer"
    finally:
        c.close()


@pytest.mark.parametrize("card", ["fs", "resp"])
def test_a_stalled_gateway_never_stores_what_the_engine_put_in_the_region_after_it_gave_up(
        start_gateway, redis_servers, shm_buffer, card):
    """The store side of the same race: a PUT from a region whose gateway stalls past the
    client's timeout. The client reports "not stored" and the engine reuses its buffer for other
    blocks; the resumed gateway must not store those bytes under the old keys (a wrong hit for
    everyone later). Each region PUT carries ``read_by``; nothing read from the region at or
    after it is stored: by an fs card reading the region itself, nor through the ring (resp)."""
    import signal
    import time
    if card == "resp":
        server, = redis_servers(1)
        gateway = start_gateway(card_dirs=[server.url], storage_backend="resp")
    else:
        gateway = start_gateway()
    path, arr = shm_buffer
    keys = make_keys(4)
    c = GatewayClient(ClientConfig(port=gateway.port, timeout_s=1.5, busy_wait_s=0), "region-put-stall", 0, 1)
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        arr[:4 * OBJ] = b"\x33" * (4 * OBJ)
        gateway.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            fut = c.put_from(region, [i * OBJ for i in range(4)], keys, OBJ)
            assert fut.result(10).stored == [False] * 4          # the client gave up: not stored
            assert time.monotonic() - t0 >= 1.0
            arr[:4 * OBJ] = b"\x44" * (4 * OBJ)                 # the engine reuses its buffer
        finally:
            gateway.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 15
        s = None
        while time.monotonic() < deadline:
            s = control.request(gateway.port, {"op": "STATS"}, timeout_s=2.0)
            s = s and s["stats"]
            if s and s["requests_in_flight"] == 0 and s["counters"].get("put_region_requests", 0) >= 1:
                break
        assert s and s["requests_in_flight"] == 0 and s["counters"].get("put_region_requests", 0) >= 1
    finally:
        c.close()
    c = _client(gateway.port, "region-put-stall-after")         # the first one turned itself off
    try:
        assert c.exist(keys).result(5) == [False] * 4, "bytes read after the client gave up were stored"
        # the same keys stored now, in time, hold the engine's current bytes
        region = c.register_region(path, 0, len(arr)).result(5)
        assert c.put_from(region, [i * OBJ for i in range(4)], keys, OBJ).result(10).stored == [True] * 4
        assert c.get_into(region, [(4 << 20) + i * OBJ for i in range(4)], keys, OBJ).result(10).hits == [True] * 4
        assert bytes(arr[4 << 20:(4 << 20) + 4 * OBJ]) == b"\x44" * (4 * OBJ)
    finally:
        c.close()


BIG = 1 << 20


def _fill_rows(arr, n, seed):
    rng = random.Random(seed)
    rows = [rng.randbytes(BIG) for _ in range(n)]
    for i, row in enumerate(rows):
        arr[i * BIG:(i + 1) * BIG] = row
    return rows


def _ring_read(c, keys):
    """Objects read back through the ring (not through the region under test): key -> bytes."""
    out = {}

    def copy_out(b):
        for j in range(b.count):
            if b.hits[j]:
                out[keys[b.first + j]] = bytes(c.ring[b.offset + j * b.stride:b.offset + j * b.stride + BIG])
    c.get(keys, BIG, copy_out).result(30)
    return out


@pytest.mark.parametrize("round_", range(3))
def test_a_region_truncated_during_a_store_stores_whole_objects_or_none(start_gateway, big_region, round_):
    """The engine shrinks its region while the gateway is storing from it (one copy, the card
    reading the region by descriptor): each object is stored whole with the bytes it had, or
    not at all; the gateway serves on."""
    import threading
    gw = start_gateway()
    path, arr = big_region
    n = 48
    rows = _fill_rows(arr, n, round_)
    keys = make_keys(n + 1)[1:]
    c = _client(gw.port, f"region-truncate-store-{round_}")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        cut_at = (16 + 8 * round_) * BIG + BIG // 3          # mid-object
        futs = [c.put_from(region, [i * BIG for i in range(j, j + 8)], keys[j:j + 8], BIG) for j in range(0, n, 8)]
        cut = threading.Timer(0.004 * round_, lambda: os.truncate(path, cut_at))
        cut.start()
        cut.join()
        stored = [s for f in futs for s in f.result(30).stored]
        assert gw.alive() and c.enabled
        back = _ring_read(c, keys)
        assert set(back) == {k for k, s in zip(keys, stored) if s}
        for i, k in enumerate(keys):
            if k in back:
                assert back[k] == rows[i], f"object {i} was stored with other bytes than the region had"
        # after the cut, the rows past it (the one cut in two included) store nothing
        late = make_keys(n + 1 + n)[n + 1:]
        cut_row = cut_at // BIG
        after = c.put_from(region, [i * BIG for i in range(cut_row, n)], late[cut_row:], BIG).result(30)
        assert not any(after.stored)
        assert os.path.getsize(path) == cut_at        # nothing grew the engine's file
    finally:
        c.close()


def test_a_gateway_killed_mid_store_keeps_only_whole_objects(start_gateway, big_region, tmp_path):
    """SIGKILL while region PUTs are being written: after a restart on the same card every
    object found reads back byte for byte (no partial file is ever an object); the rest miss."""
    import signal
    import time
    gw = start_gateway()
    path, arr = big_region
    n = 64
    rows = _fill_rows(arr, n, 7)
    keys = make_keys(8 * n + 1)[1:]               # key i holds row i % n: stores go on while the card is watched
    card = tmp_path / "card0"

    def store_in_progress() -> bool:
        return any(e.name.startswith(".") for db in os.scandir(card) if db.is_dir()
                   for sub in os.scandir(db.path) if sub.is_dir() for e in os.scandir(sub.path))

    c = _client(gw.port, "region-kill-store")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        futs = []
        deadline = time.monotonic() + 20
        writing = False
        while time.monotonic() < deadline and not writing:      # until a store is on its way to the card
            j = 4 * len(futs)
            if j < len(keys) and sum(not f.done() for f in futs) < 8:
                futs.append(c.put_from(region, [(i % n) * BIG for i in range(j, j + 4)], keys[j:j + 4], BIG))
            writing = store_in_progress()
        assert writing, "no store was in progress to interrupt"
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait(10)
        for f in futs:
            f.result(30)
    finally:
        c.close()
    again = start_gateway([str(card)])
    c = _client(again.port, "region-kill-store-after")
    try:
        back = _ring_read(c, keys)
        for i, k in enumerate(keys):
            if k in back:
                assert back[k] == rows[i % n], f"object {i} differs after the restart"
        assert c.exist(keys).result(5) == [k in back for k in keys]      # what is found reads whole
    finally:
        c.close()


def test_region_stores_racing_evictions_never_serve_other_bytes(start_gateway, big_region):
    """A card far smaller than what is stored: region PUTs evict older objects while region
    GETs of those objects run. Every hit holds exactly the bytes stored under its key."""
    gw = start_gateway(capacity_bytes=12 * (BIG + 8192))
    path, arr = big_region
    n = 32
    rows = _fill_rows(arr, n, 11)
    keys = make_keys(n + 1)[1:]
    c = _client(gw.port, "region-evict-race")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        dst = 40 * BIG
        checked = 0
        for rnd in range(4):
            puts = [c.put_from(region, [i * BIG for i in range(j, j + 4)], keys[j:j + 4], BIG) for j in range(0, n, 4)]
            gets = [c.get_into(region, [dst + (i % 16) * BIG for i in range(j, j + 4)], keys[j:j + 4], BIG)
                    for j in range(0, 16, 4)]
            for j, g in zip(range(0, 16, 4), gets):
                hits = g.result(30).hits
                for i, hit in zip(range(j, j + 4), hits):
                    if hit:
                        got = bytes(arr[dst + (i % 16) * BIG:dst + (i % 16 + 1) * BIG])
                        assert got == rows[i], f"object {i} read back with other bytes (round {rnd})"
                        checked += 1
            for p in puts:
                p.result(30)
        assert gw.alive()
        s = _stats(gw.port)
        assert s["objects"]["stored"] > 12            # evictions happened
    finally:
        c.close()


def _evict_from_page_cache(path) -> None:
    """Write the file back and drop its pages (this file only, no global drop)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached(path) -> bool:
    """Whether the file's first page is in the page cache (Linux cachestat; no readahead)."""
    from adpkv_gateway.cards.objfile import page_cached
    fd = os.open(path, os.O_RDONLY)
    try:
        cached = page_cached(fd)
    finally:
        os.close(fd)
    if cached is None:
        pytest.skip("this kernel cannot tell what is in the page cache (cachestat: Linux 6.5+)")
    return cached


def _object_files(card_dir):
    return sorted(p for p in card_dir.glob("db*/*/*") if p.is_file())      # dbNNN/<subdirectory>/<file>


@pytest.mark.parametrize("damage", ["none", "flipped byte", "truncated"])
def test_objects_not_in_the_page_cache_are_read_whole_and_checked_before_they_land(gateway, shm_buffer, tmp_path,
                                                                                   damage):
    """A file out of the page cache is read into the region with one O_DIRECT read (the
    dropped-cache load) and checked before anything is written: byte exact when intact; a
    flipped byte or a cut file is a miss that leaves the engine's buffer as it was."""
    path, arr = shm_buffer
    keys = make_keys(3)
    rng = random.Random(5)
    rows = [rng.randbytes(OBJ) for _ in range(3)]
    for i, row in enumerate(rows):
        arr[i * OBJ:(i + 1) * OBJ] = row
    c = _client(gateway.port, f"region-uncached-{damage.replace(' ', '-')}")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert c.put_from(region, [i * OBJ for i in range(3)], keys, OBJ).result(10).stored == [True] * 3
        files = _object_files(tmp_path / "card0")
        assert len(files) == 3
        victim = files[1]
        if damage == "flipped byte":
            with open(victim, "r+b") as fh:
                fh.seek(-100, os.SEEK_END)
                b = fh.read(1)
                fh.seek(-100, os.SEEK_END)
                fh.write(bytes([b[0] ^ 0x5A]))
        elif damage == "truncated":
            os.truncate(victim, victim.stat().st_size - 4096)
        for f in files:
            _evict_from_page_cache(f)
            if _cached(f):
                pytest.skip(f"the card's file system keeps its files in memory ({f.parent}: tmpfs?); "
                            "nothing here is out of the page cache")
        dst = 4 << 20
        arr[dst:dst + 3 * OBJ] = b"\xee" * (3 * OBJ)
        hits = c.get_into(region, [dst + i * OBJ for i in range(3)], keys, OBJ).result(10).hits
        intact = damage == "none"
        assert hits.count(True) == (3 if intact else 2)
        for i in range(3):
            got = bytes(arr[dst + i * OBJ:dst + (i + 1) * OBJ])
            if hits[i]:
                assert got == rows[i], f"object {i} differs"
            else:
                assert got == b"\xee" * OBJ, "a damaged object wrote into the engine's buffer"
        assert not any(_cached(f) for f in files if f.exists()), "read through the page cache"
    finally:
        c.close()


def test_a_card_that_cannot_read_regions_stores_them_through_the_ring(redis_servers, start_gateway, shm_buffer):
    """A resp card (real redis-server) has no direct region I/O: region PUTs go region ->
    ring slot -> card, GETs card -> ring -> region. Byte exact, fragments included; a region
    truncated before the PUT stores nothing of the objects past its end."""
    server, = redis_servers(1)
    gw = start_gateway(card_dirs=[server.url], storage_backend="resp", fragment_size=64 * 1024, num_dbs=4)
    path, arr = shm_buffer
    keys = make_keys(8)
    rng = random.Random(9)
    rows = [rng.randbytes(OBJ) for _ in range(8)]
    for i, row in enumerate(rows):
        arr[i * OBJ:(i + 1) * OBJ] = row
    c = _client(gw.port, "region-resp")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert c.put_from(region, [i * OBJ for i in range(6)], keys[:6], OBJ).result(10).stored == [True] * 6
        dst = 4 << 20
        arr[dst:dst + 6 * OBJ] = bytes(6 * OBJ)
        assert c.get_into(region, [dst + i * OBJ for i in range(6)], keys[:6], OBJ).result(10).hits == [True] * 6
        for i in range(6):
            assert bytes(arr[dst + i * OBJ:dst + (i + 1) * OBJ]) == rows[i], f"object {i} differs"
        os.truncate(path, 6 * OBJ + OBJ // 2)                  # object 6 cut in two, 7 gone
        assert c.put_from(region, [6 * OBJ, 7 * OBJ], keys[6:], OBJ).result(10).stored == [False, False]
        assert c.exist(keys).result(5) == [True] * 6 + [False] * 2
        assert gw.alive() and c.enabled
    finally:
        c.close()


@pytest.mark.parametrize("cached", [True, False])
def test_a_copy_into_a_region_writes_nothing_once_the_client_gave_up(shm_buffer, tmp_path, cached):
    """The card-level copy checks the client's give-up moment before every write into the
    region (not only before the object): a gateway held up between the check of the request
    and the copy writes nothing after it. Here the moment has passed when the copy starts."""
    import time
    from adpkv_gateway.cards.base import Read
    from adpkv_gateway.cards.objfile import FdSlice, Scratch, copy_object_file, write_object_file
    path, arr = shm_buffer
    fkey = make_keys(1)[0] + b"\0\0"
    arr[:OBJ] = random.Random(3).randbytes(OBJ)
    region_fd = os.open(path, os.O_RDWR)
    obj_path = tmp_path / "object"
    try:
        fd = os.open(obj_path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            write_object_file(fd, fkey, FdSlice(region_fd, 0, OBJ), 0, False, Scratch())
        finally:
            os.close(fd)
        if not cached:
            _evict_from_page_cache(obj_path)
            if _cached(obj_path):
                pytest.skip("the file system keeps the object in memory")
        dst = 4 << 20
        arr[dst:dst + OBJ] = b"\x77" * OBJ
        dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert copy_object_file(dir_fd, "object", fkey, OBJ, region_fd, dst, Scratch(),
                                    write_by=time.monotonic() - 0.001) is Read.UNDELIVERED
            assert bytes(arr[dst:dst + OBJ]) == b"\x77" * OBJ
            assert copy_object_file(dir_fd, "object", fkey, OBJ, region_fd, dst, Scratch(),
                                    write_by=time.monotonic() + 60) is Read.HIT
        finally:
            os.close(dir_fd)
        assert bytes(arr[dst:dst + OBJ]) == bytes(arr[:OBJ])
    finally:
        os.close(region_fd)
