"""Reads that try to make the gateway lie: real gateway processes, real card files damaged,
swapped, evicted or rewritten while (and between) the engine's reads.

Every test asserts the one rule of the read paths: a hit holds exactly the bytes stored
under its key, and what is not a hit leaves the engine's buffer as it was (or is reported
a miss where the contract lets bytes land first). The paths attacked: the I/O processes'
packed ``ReadTask`` (many reads of one card in one task, errors reported by position),
replica fallback from such a task, the pool threads' ring reads, and the fs card's copies
straight into a client's region (whole objects up to ``WHOLE_CACHED``, pieces above).
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
import uuid

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.keys import namespace_id
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards.objfile import HEADER_BYTES, WHOLE_CACHED

from ..fs_cards import object_paths
from ..rankproc import get_checked, make_keys, pattern

pytestmark = pytest.mark.read_attacks


def stats(port):
    return control.request(port, {"op": "STATS"}, timeout_s=10)["stats"]


def _client(port, engine, rank=0, world=1):
    c = GatewayClient(ClientConfig(port=port, timeout_s=30.0, busy_wait_s=0), engine, rank=rank, world_size=world)
    assert c.enabled, c.attach_error
    return c


def put(c, keys, nbytes):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            c.ring[o:o + nbytes] = pattern(keys[b.first + j], 0, nbytes)
    return list(c.put(keys, nbytes, fill).result(timeout=60).stored)


get = get_checked          # a ring GET whose hits are byte-checked

def card_files(card_dir) -> dict[str, str]:
    """Fragment file name (its key in hex) -> path, for every object file of a card."""
    out = {}
    for path in object_paths(card_dir):
        out[os.path.basename(path)] = path
    return out


def frag_path(card_dir, key: bytes, index: int = 0) -> str:
    return card_files(card_dir)[(key + index.to_bytes(2, "big")).hex()]


def flip(path, at):
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xA5]))


def _damage(path, how, other_path=None):
    if how == "deleted":
        os.unlink(path)
    elif how == "short":                      # a short read: the payload's last page gone
        os.truncate(path, os.path.getsize(path) - 100)
    elif how == "header only":
        os.truncate(path, HEADER_BYTES)
    elif how == "empty":
        os.truncate(path, 0)
    elif how == "flipped":
        flip(path, os.path.getsize(path) - 7)
    elif how == "foreign":                    # another object's file (same size) in its place
        with open(other_path, "rb") as src:
            data = src.read()
        with open(path, "wb") as dst:
            dst.write(data)
    else:
        raise AssertionError(how)


# ---------------------------------------------------------------- packed read tasks
DAMAGES = ["deleted", "short", "header only", "empty", "flipped", "foreign"]


@pytest.mark.parametrize("io_processes", [1, 3])
def test_a_packed_task_reports_each_failed_read_as_its_own(start_gateway, io_processes):
    """One card, every read of a GET in one or three ``ReadTask``s: reads at scattered
    positions of a task fail six different ways (gone, cut, header only, empty, a flipped
    byte, another object's file). Exactly those objects miss, every other one is exact, the
    card counts exactly their failures, and the next GET misses exactly them again (dropped
    from the index), with the objects next to them in the task still read."""
    gw = start_gateway(io_processes=io_processes)
    keys = make_keys(48)
    obj = 12 * 1024 + 40
    c = _client(gw.port, "packed")
    try:
        assert put(c, keys, obj) == [True] * 48
        files = card_files(gw.card_dirs[0])
        assert len(files) == 48
        victims = {3: "deleted", 4: "short", 17: "header only", 30: "empty", 31: "flipped", 47: "foreign"}
        for i, how in victims.items():
            _damage(frag_path(gw.card_dirs[0], keys[i]), how, frag_path(gw.card_dirs[0], keys[0]))
        before = stats(gw.port)["cards"][0]
        hits = get(c, keys, obj)
        assert [i for i, h in enumerate(hits) if not h] == sorted(victims), hits
        after = stats(gw.port)["cards"][0]
        assert after["reads"] - before["reads"] == 48
        assert after["read_errors"] - before["read_errors"] == len(victims)
        assert after["bytes_read"] - before["bytes_read"] == (48 - len(victims)) * obj
        assert gw.alive()
        # the damaged ones were dropped; the neighbours in the task read again, exactly
        assert get(c, keys, obj) == [i not in victims for i in range(48)]
        assert stats(gw.port)["cards"][0]["read_errors"] == after["read_errors"]
        assert put(c, [keys[i] for i in sorted(victims)], obj) == [True] * len(victims)
        assert get(c, keys, obj) == [True] * 48
    finally:
        c.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_fragments_of_one_object_failing_inside_packed_tasks(start_gateway, tmp_path, replicas):
    """Objects of four fragments, read in the I/O processes (fragments of one object in one
    task or split over two): one fragment of an object damaged, its head gone, or (with a
    replica) different fragments damaged on both cards. Without a replica those objects
    miss and no other does; with one, an object damaged on one card reads exactly from the
    other, fragment by fragment, and one damaged on both is exact or a miss, never mixed."""
    dirs = [str(tmp_path / "fa"), str(tmp_path / "fb")][:replicas]
    gw = start_gateway(card_dirs=dirs, replicas=replicas, io_processes=2, fragment_size=64 * 1024,
                       key_placement="stripe")
    keys = make_keys(24)
    obj = 3 * 64 * 1024 + 4096 + 8                # 4 fragments, the last one short
    c = _client(gw.port, "frag-tasks")
    try:
        assert put(c, keys, obj) == [True] * 24
        for d in dirs:
            assert len(card_files(d)) == 24 * 4
        a = dirs[0]
        flip(frag_path(a, keys[3], 2), HEADER_BYTES + 5000)
        os.unlink(frag_path(a, keys[7], 0))
        _damage(frag_path(a, keys[11], 1), "short")
        _damage(frag_path(a, keys[12], 3), "foreign", frag_path(a, keys[13], 3))
        if replicas == 2:
            b = dirs[1]
            flip(frag_path(b, keys[11], 3), HEADER_BYTES + 100)     # 11: damaged on both cards
            os.unlink(frag_path(b, keys[12], 2))                    # 12: damaged on both cards
        hits = get(c, keys, obj)
        if replicas == 1:
            assert [i for i, h in enumerate(hits) if not h] == [3, 7, 11, 12], hits
        else:
            assert hits[3] and hits[7], "an object damaged on one card did not read from the other"
            assert all(h for i, h in enumerate(hits) if i not in (11, 12)), hits
        again = get(c, keys, obj)
        assert all(again[i] for i in range(24) if i not in (3, 7, 11, 12) or replicas == 2 and i in (3, 7))
        assert gw.alive()
    finally:
        c.close()


# ---------------------------------------------------------------- swapped files, every read path
class ShmFile:
    """A /dev/shm file an engine registers as its region; read and written here only with
    pread/pwrite (never mapped: a test that shrinks it must not fault itself)."""

    def __init__(self, size):
        self.path = f"/dev/shm/adpkv-test-attack-{uuid.uuid4().hex[:8]}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, size)

    def write(self, at, data):
        assert os.pwrite(self.fd, data, at) == len(data)

    def read(self, at, n):
        return os.pread(self.fd, n, at)

    def size(self):
        return os.fstat(self.fd).st_size

    def close(self):
        os.close(self.fd)
        os.unlink(self.path)


@pytest.fixture
def shm_file():
    made = []

    def make(size):
        made.append(ShmFile(size))
        return made[-1]
    yield make
    for f in made:
        f.close()


SENTINEL = b"\xee"


def region_get_checked(c, rid, region, keys, obj, at=0, misses_untouched=True):
    """A GET of ``keys`` into the region at ``at``, ``at + obj``, ... (first filled with
    SENTINEL): the hits; fails the test on a hit whose bytes are not its key's and, with
    ``misses_untouched``, on a miss that wrote into the engine's buffer."""
    n = len(keys)
    region.write(at, SENTINEL * (n * obj))
    hits = list(c.get_into(rid, [at + i * obj for i in range(n)], keys, obj).result(60).hits)
    for i, (k, hit) in enumerate(zip(keys, hits)):
        if hit or misses_untouched:
            got = region.read(at + i * obj, obj)
            if hit:
                assert got == pattern(k, 0, obj), f"a region hit of object {i} of the GET holds other bytes"
            else:
                assert got == SENTINEL * obj, f"a region miss (object {i} of the GET) wrote into the engine's buffer"
    return hits
PATHS = {"threads": (0, 256 * 1024 + 512), "processes": (2, 256 * 1024 + 512),
         "region-whole": (0, WHOLE_CACHED - 4096), "region-pieces": (2, WHOLE_CACHED + 300 * 1024)}


@pytest.mark.parametrize("path", list(PATHS))
def test_swapped_and_replaced_card_files_are_misses_on_every_read_path(start_gateway, shm_file, path):
    """Two objects' files swapped (renamed into each other's place), a third's replaced by
    a copy of a fourth's: the pool threads' ring reads, the I/O processes' tasks, and the
    fs card's whole and piece-by-piece copies into a region all give misses for the three,
    exact bytes for the rest; a region keeps its own bytes where a miss was (nothing of a
    foreign file lands: its header is checked first)."""
    io_processes, obj = PATHS[path]
    gw = start_gateway(io_processes=io_processes)
    n = 6
    keys = make_keys(n, salt=b"swap")
    c = _client(gw.port, "swap")
    try:
        assert put(c, keys, obj) == [True] * n
        card = gw.card_dirs[0]
        p1, p2, p3, p4 = (frag_path(card, keys[i]) for i in (1, 2, 3, 4))
        os.rename(p1, p1 + ".swap")
        os.rename(p2, p1)
        os.rename(p1 + ".swap", p2)
        with open(p4, "rb") as src, open(p3 + ".new", "wb") as dst:
            dst.write(src.read())
        os.rename(p3 + ".new", p3)
        if path.startswith("region"):
            region = shm_file(n * obj)
            rid = c.register_region(region.path, 0, n * obj).result(10)
            assert rid is not None
            hits = region_get_checked(c, rid, region, keys, obj)
        else:
            hits = get(c, keys, obj)
        assert hits == [True, False, False, False, True, True], hits
        assert get(c, keys, obj) == [True, False, False, False, True, True]
        assert gw.alive()
    finally:
        c.close()


# ---------------------------------------------------------------- region bounds
@pytest.mark.parametrize("obj", [WHOLE_CACHED - 4096 + 100, WHOLE_CACHED + 4096 + 100], ids=["whole", "pieces"])
def test_copies_into_a_region_stay_inside_it(start_gateway, shm_file, obj):
    """A region that is a window (offset, size) of a larger file: an object placed flush
    with the window's end lands exactly there; one a byte further, or one larger than the
    whole window, is refused with BAD_REGION and nothing is written anywhere; after the
    engine shrinks its file under the window, the object across the new end misses, the
    file is not grown back, and the object before it is exact."""
    gw = start_gateway()
    keys = make_keys(2, salt=b"bounds")
    c = _client(gw.port, "bounds")
    try:
        assert put(c, keys, obj) == [True, True]
        lead, size = 4096 * 3, 2 * obj + 8192               # the window: file bytes lead .. lead+size
        f = shm_file(lead + size + 65536)
        f.write(0, SENTINEL * f.size())
        rid = c.register_region(f.path, lead, size).result(10)
        assert rid is not None
        flush = [0, size - obj]                              # object 1 ends where the window ends
        assert c.get_into(rid, flush, keys, obj).result(60).hits == [True, True]
        assert f.read(lead, obj) == pattern(keys[0], 0, obj)
        assert f.read(lead + size - obj, obj) == pattern(keys[1], 0, obj)
        expect = f.read(0, f.size())
        assert expect[:lead] == SENTINEL * lead and expect[lead + size:] == SENTINEL * (f.size() - lead - size)
        f.write(lead, SENTINEL * size)
        expect = f.read(0, f.size())
        for at in ([0, size - obj + 1], [0, size], [size - obj + 1, 0]):
            assert c.get_into(rid, at, keys, obj).result(30).hits == [False, False], at
        assert c.get_into(rid, [0], keys[:1], size + 1).result(30).hits == [False]
        assert f.read(0, f.size()) == expect, "a refused GET wrote into the engine's file"
        assert c.enabled and gw.alive()
        # the engine shrinks its file: object 1's place now runs past the end
        os.ftruncate(f.fd, lead + size - obj // 2)
        assert c.get_into(rid, flush, keys, obj).result(60).hits == [True, False]
        assert f.size() == lead + size - obj // 2, "the gateway grew the engine's file back"
        assert f.read(lead, obj) == pattern(keys[0], 0, obj)
        assert f.read(lead + obj, size - 2 * obj) == SENTINEL * (size - 2 * obj)
        assert get(c, keys, obj) == [True, True]             # the objects themselves are fine
    finally:
        c.close()


# ---------------------------------------------------------------- races
def _race(seconds, *loops):
    """Run ``loops`` (each ``loop(stop)``, returning a count) in threads for ``seconds``;
    their counts, or the first exception any raised."""
    stop = threading.Event()
    out, errors = {}, []

    def run(k, loop):
        try:
            out[k] = loop(stop)
        except BaseException as exc:          # noqa: BLE001 -- handed to the test
            errors.append(exc)
            stop.set()
    threads = [threading.Thread(target=run, args=(k, loop), daemon=True) for k, loop in enumerate(loops)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racing client hung"
    if errors:
        raise errors[0]
    return [out[k] for k in range(len(loops))]


def test_eviction_and_restores_racing_packed_reads_never_serve_other_bytes(start_gateway, shm_file):
    """A card that holds about 24 of 160 objects: one rank stores the 160 over and over
    (each store evicts, the same keys come back), while another reads batches of them in
    the I/O processes' packed tasks and a third reads them straight into its region. Every
    hit is exact; an evicted file is only ever a miss (never a checksum, header or length
    failure: nothing is unlinked or renamed under a read that way), and the card stays
    under its capacity."""
    obj = 48 * 1024 + 16
    capacity = 24 * (obj + HEADER_BYTES)
    gw = start_gateway(io_processes=2, capacity_bytes=capacity, eviction_watermark=0.9, eviction_ratio=0.3)
    keys = make_keys(160, salt=b"evict")
    region = shm_file(32 * obj)
    counts = {"hits": 0, "misses": 0, "region_hits": 0}

    def writer(stop):
        c, rng, n = _client(gw.port, "evict", 0, 3), random.Random(1), 0
        try:
            while not stop.is_set():
                start = rng.randrange(0, 160 - 16)
                put(c, keys[start:start + 16], obj)
                n += 1
        finally:
            c.close()
        return n

    def reader(stop):
        c, rng, n = _client(gw.port, "evict", 1, 3), random.Random(2), 0
        try:
            while not stop.is_set():
                batch = rng.sample(keys, 32)
                hits = get(c, batch, obj)
                counts["hits"] += sum(hits)
                counts["misses"] += len(hits) - sum(hits)
                n += 1
        finally:
            c.close()
        return n

    def region_reader(stop):
        c, rng, n = _client(gw.port, "evict", 2, 3), random.Random(3), 0
        try:
            rid = c.register_region(region.path, 0, 32 * obj).result(10)
            assert rid is not None
            while not stop.is_set():
                hits = region_get_checked(c, rid, region, rng.sample(keys, 32), obj)
                counts["region_hits"] += sum(hits)
                n += 1
        finally:
            c.close()
        return n

    puts, gets, region_gets = _race(8.0, writer, reader, region_reader)
    print(f"stores {puts}, packed GETs {gets}, region GETs {region_gets}: {counts}")
    assert puts > 5 and gets > 5 and region_gets > 5, (puts, gets, region_gets)
    assert counts["hits"] > 0 and counts["misses"] > 0 and counts["region_hits"] > 0, counts
    card = stats(gw.port)["cards"][0]
    assert card["evicted"] > 0 and card["used_bytes"] <= capacity, card
    log = gw.log()
    for word in ("checksum mismatch", "bad header", "truncated"):
        assert word not in log, f"an eviction or a store made a read see a {word!r} file"
    assert gw.alive()


def _damager(card_dir, seed):
    """A loop that damages card files in place and puts them back, as fast as it can: a
    payload byte flipped, the file cut short, the header overwritten, another object's file
    renamed over it; each followed by the original bytes again (a file the gateway dropped
    meanwhile is left alone)."""
    def loop(stop):
        rng, n = random.Random(seed), 0
        files: list[str] = []
        while not stop.is_set():
            if len(files) < 2:                  # listed again only when files went (4,096 directories a listing)
                files = list(card_files(card_dir).values())
                continue
            path, other = rng.sample(files, 2)
            try:
                with open(path, "r+b") as fh:
                    original = fh.read()
                    how = n % 4
                    if how == 0:
                        at = HEADER_BYTES + rng.randrange(len(original) - HEADER_BYTES)
                        fh.seek(at)
                        fh.write(bytes([original[at] ^ 0x3C]))
                    elif how == 1:
                        fh.truncate(len(original) // 2)
                    elif how == 2:
                        fh.seek(8)
                        fh.write(b"\xff" * 16)
                    else:
                        with open(other, "rb") as src:
                            foreign = src.read()
                        with open(path + ".f", "wb") as dst:
                            dst.write(foreign)
                        os.rename(path + ".f", path)
                    fh.seek(0)
                    fh.write(original)
                if how == 3:
                    with open(path + ".o", "wb") as dst:
                        dst.write(original)
                    os.rename(path + ".o", path)
            except FileNotFoundError:
                files.remove(path)              # dropped by the gateway (stored again: found by the next listing)
            n += 1
        return n
    return loop


@pytest.mark.parametrize("io_processes,obj", [(2, 1 << 20), (0, WHOLE_CACHED + 512 * 1024)],
                         ids=["processes+whole", "threads+pieces"])
def test_card_files_damaged_and_restored_under_reads_never_reach_an_engine(start_gateway, shm_file, io_processes,
                                                                           obj):
    """Card files damaged and put back in a tight loop while one rank reads them through the
    ring (packed I/O-process tasks, or the pool threads) and re-stores what missed, and
    another reads them straight into its region (whole-object copies, or piece by piece):
    every hit is exact, and a whole-object miss leaves the region as it was. (Piece-by-piece
    copies may land bytes before their checksum is known; such an object is reported a
    miss, which is their documented contract.)"""
    gw = start_gateway(io_processes=io_processes)
    n = 12
    keys = make_keys(n, salt=b"flap%d" % obj)
    region = shm_file(8 * obj)
    counts = {"hits": 0, "misses": 0, "region_hits": 0, "region_misses": 0}
    setup = _client(gw.port, "flap", 0, 2)
    assert put(setup, keys, obj) == [True] * n

    def ring_reader(stop):
        rng, rounds = random.Random(4), 0
        while not stop.is_set():
            batch = rng.sample(keys, 8)
            hits = get(setup, batch, obj)
            counts["hits"] += sum(hits)
            counts["misses"] += 8 - sum(hits)
            missed = [k for k, h in zip(batch, hits) if not h]
            if missed:
                put(setup, missed, obj)
            rounds += 1
        return rounds

    def region_reader(stop):
        c, rng, rounds = _client(gw.port, "flap", 1, 2), random.Random(5), 0
        try:
            rid = c.register_region(region.path, 0, 8 * obj).result(10)
            assert rid is not None
            while not stop.is_set():
                # a damaged object copied piece by piece may leave pieces (documented contract)
                hits = region_get_checked(c, rid, region, rng.sample(keys, 8), obj,
                                          misses_untouched=obj <= WHOLE_CACHED)
                counts["region_hits"] += sum(hits)
                counts["region_misses"] += 8 - sum(hits)
                rounds += 1
        finally:
            c.close()
        return rounds

    try:
        gets, region_gets, damaged = _race(8.0, ring_reader, region_reader, _damager(gw.card_dirs[0], 6))
    finally:
        setup.close()
    print(f"ring GETs {gets}, region GETs {region_gets}, damages {damaged}: {counts}")
    assert gets > 3 and region_gets > 3 and damaged > 20, (gets, region_gets, damaged)
    assert counts["hits"] > 0 and counts["region_hits"] > 0, counts
    assert counts["misses"] + counts["region_misses"] > 0, "no read met a damaged file: the race tested nothing"
    assert gw.alive()


# ---------------------------------------------------------------- namespaces
def test_a_tenant_evicting_under_its_quota_never_touches_another_tenants_packed_reads(start_gateway):
    """Two namespaces whose keys come from the same chunk hashes: one's objects are never
    the other's (a GET of tenant a's keys misses while only b stored them). Tenant a, far
    past its quota, stores objects of four fragments in a loop, evicting its own whole
    objects, while the other rank reads all of tenant b's objects in the I/O processes'
    packed tasks round after round: every one a hit, exact. After a kill -9 and the index
    rebuild, b is whole, and every object of a that EXIST finds reads whole and exact."""
    obj, frag = 3 * 32 * 1024 + 8, 32 * 1024                 # 4 fragments
    on_disk = 3 * (frag + HEADER_BYTES) + HEADER_BYTES + 8
    gw = start_gateway(io_processes=2, fragment_size=frag, namespace_quotas=f"tenant-a={10 * on_disk}")
    a_keys = make_keys(120, namespace="tenant-a", salt=b"ns")
    b_keys = make_keys(40, namespace="tenant-b", salt=b"ns")
    c = _client(gw.port, "tenants", 0, 2)
    try:
        assert put(c, b_keys, obj) == [True] * 40
        assert get(c, a_keys[:40], obj) == [False] * 40, "tenant a's key found tenant b's object"

        def tenant_a(stop):
            rounds = 0
            while not stop.is_set():
                for start in range(0, 120, 8):
                    assert put(c, a_keys[start:start + 8], obj) == [True] * 8
                    get(c, a_keys[max(0, start - 16):start + 8], obj)
                rounds += 1
            return rounds

        def tenant_b(stop):
            r, rounds = _client(gw.port, "tenants", 1, 2), 0
            try:
                while not stop.is_set():
                    assert get(r, b_keys, obj) == [True] * 40, "tenant b lost objects to tenant a's quota"
                    rounds += 1
            finally:
                r.close()
            return rounds

        a_rounds, b_rounds = _race(6.0, tenant_a, tenant_b)
        assert a_rounds >= 1 and b_rounds > 3, (a_rounds, b_rounds)
        tenants = {t["id"]: t for t in stats(gw.port)["tenants"]}
        a, b = tenants[namespace_id("tenant-a").hex()], tenants[namespace_id("tenant-b").hex()]
        assert a["evicted"] > 0 and a["objects"] <= 10, tenants
        assert b["evicted"] == 0 and b["objects"] == 40, tenants
    finally:
        c.close()
    gw.restart(hard=True)
    c = _client(gw.port, "tenants-after", 0, 1)
    try:
        assert get(c, b_keys, obj) == [True] * 40
        present = list(c.exist(a_keys).result(timeout=30))
        assert 0 < sum(present) <= 10
        assert get(c, a_keys, obj) == present, "an object EXIST finds does not read whole"
    finally:
        c.close()


# ---------------------------------------------------------------- O_DIRECT cards
def test_an_o_direct_card_with_unaligned_fragments_reads_exact_or_misses_on_every_path(start_gateway, shm_file):
    """An O_DIRECT card (padded files) with fragments that are not a multiple of 4 KiB, so
    most ring offsets and lengths of the I/O processes' reads are unaligned (the bounce
    buffer path), stored from the ring and from a region: the packed tasks and the region
    copies read every object exactly; a damaged padded file (a payload byte, the padding's
    start cut off, another object's file) is a miss on both paths."""
    frag = 64 * 1024 + 100
    obj = 3 * frag + 777                                  # 4 fragments, none page aligned
    gw = start_gateway(io_processes=2, o_direct=True, fragment_size=frag)
    keys = make_keys(16, salt=b"odirect")
    region = shm_file(32 * obj)
    c = _client(gw.port, "odirect")
    try:
        assert "refuses O_DIRECT" not in gw.log(), "the card's file system has no O_DIRECT: not the path under test"
        assert put(c, keys[:8], obj) == [True] * 8
        for i in range(8, 16):
            region.write(i * obj, pattern(keys[i], 0, obj))
        rid = c.register_region(region.path, 0, 32 * obj).result(10)
        assert list(c.put_from(rid, [i * obj for i in range(8, 16)], keys[8:], obj).result(60).stored) == [True] * 8
        sizes = {os.path.getsize(p) for p in card_files(gw.card_dirs[0]).values()}
        assert all(s % 4096 == 0 for s in sizes), sizes          # padded: written with O_DIRECT
        assert get(c, keys, obj) == [True] * 16
        card = gw.card_dirs[0]
        flip(frag_path(card, keys[2], 1), HEADER_BYTES + 10)
        os.truncate(frag_path(card, keys[9], 3), os.path.getsize(frag_path(card, keys[9], 3)) - 4096)
        _damage(frag_path(card, keys[12], 0), "foreign", frag_path(card, keys[13], 0))
        damaged = {2, 9, 12}
        assert get(c, keys, obj) == [i not in damaged for i in range(16)]
        flip(frag_path(card, keys[5], 2), HEADER_BYTES + frag - 1)   # the region path's turn
        hits = region_get_checked(c, rid, region, keys, obj, at=16 * obj, misses_untouched=False)
        assert hits == [i not in damaged | {5} for i in range(16)], hits
    finally:
        c.close()
