"""Keys (namespaces: test_namespace.py), dialog marks, fragments, ring allocation, settings, protocol,
the destinations of a data request."""

from __future__ import annotations

import os
import random

import pytest

from adpkv_core.wire import protocol as P
from adpkv_core.affinity import dialog_mark, dialog_marks
from adpkv_gateway.cards.fragments import fragment_db, fragment_extents, fragment_key, head_dbs
from adpkv_core.keys import KEY_BYTES, KeyBuilder, namespace_id
from adpkv_core.memory.ring import max_parallel_ios, object_stride
from adpkv_core.request import InRegion, LoadResult, Scattered, StoreResult, ViaRing, data_request, nothing, regions_of
from adpkv_core.settings import ClientConfig
from adpkv_gateway.config import make_config
from adpkv_gateway.store.placement import Placement, key_layout_fingerprint
from adpkv_gateway.datapath.ring_alloc import RingAllocator


def test_key_layout_and_separation():
    a, b = KeyBuilder("ns-a"), KeyBuilder("ns-b")
    k = a.key(b"\x01" * 32, layer=5, kind=1)
    assert len(k) == KEY_BYTES
    # version:u8 | namespace id:8 | chunk digest:16 | layer:u16 | kind:u8 (big endian)
    assert (k[0], k[1:9], int.from_bytes(k[25:27], "big"), k[27]) == (1, namespace_id("ns-a"), 5, 1)
    assert k != b.key(b"\x01" * 32, 5, 1), "namespaces must separate keys"
    assert k != a.key(b"\x01" * 32, 4, 1) and k != a.key(b"\x01" * 32, 5, 0)
    assert a.key(12345) == KeyBuilder("ns-a").key(12345), "keys must not depend on the process"
    assert a.keys([1, 2], layers=[0, 1]) == [a.key(1, 0), a.key(2, 0), a.key(1, 1), a.key(2, 1)]


def test_dialog_marks():
    hashes = [bytes([i]) * 32 for i in range(6)]
    assert dialog_mark(hashes, 1) == dialog_mark(hashes[:1], 1)
    marks = dialog_marks(hashes, affinity_chunks=3)
    assert marks[2:] == [dialog_mark(hashes, 3)] * 4
    assert len(set(marks[:3])) == 3, "chunks of the common start get their own marks"
    other = [hashes[0], hashes[1], b"\xff" * 32]
    assert dialog_marks(other, 3)[:2] == marks[:2] and dialog_marks(other, 3)[2] != marks[2]


def test_fragments():
    assert fragment_extents(100, 0) == [(0, 100)]
    assert fragment_extents(300, 128) == [(0, 128), (128, 128), (256, 44)]
    key = KeyBuilder("n").key(1)
    assert fragment_key(key, 2)[:KEY_BYTES] == key and len(fragment_key(key, 2)) == KEY_BYTES + 2
    dbs = {fragment_db(key, i, 16) for i in range(16)}
    assert len(dbs) == 16
    assert {fragment_db(key, i, 16, spread=False) for i in range(4)} == {fragment_db(key, 0, 16, spread=False)}
    keys = [KeyBuilder("n").key(i) for i in range(200)]
    for num_dbs in (1, 3, 16):
        assert head_dbs(keys, num_dbs).tolist() == [fragment_db(k, 0, num_dbs) for k in keys] \
            == [fragment_db(k, 0, num_dbs, spread=False) for k in keys]
    with pytest.raises(ValueError):
        fragment_extents(0, 10)


def test_ring_allocator_first_fit_and_coalescing():
    alloc = RingAllocator(64 * 4096)
    a = alloc.alloc(10 * 4096)
    b = alloc.alloc(100)                  # rounded to one unit
    c = alloc.alloc(20 * 4096)
    assert (a, b, c) == (0, 10 * 4096, 11 * 4096)
    assert alloc.alloc(64 * 4096) is None
    alloc.free(b, 100)
    alloc.free(a, 10 * 4096)
    assert alloc.largest_free() == 33 * 4096 and alloc.alloc(11 * 4096) == 0
    alloc.free(0, 11 * 4096)
    alloc.free(c, 20 * 4096)
    assert alloc.largest_free() == 64 * 4096 and alloc.in_use == 0
    # a double free is refused and changes nothing: first a valid free, then the same again
    d = alloc.alloc(4096)
    alloc.free(d, 4096)
    with pytest.raises(ValueError):
        alloc.free(d, 4096)
    assert alloc.largest_free() == 64 * 4096 and alloc.in_use == 0
    # an overlapping free (part of a free extent) is refused too
    e = alloc.alloc(2 * 4096)
    alloc.free(e, 4096)
    with pytest.raises(ValueError):
        alloc.free(e, 2 * 4096)


def test_mapping_a_ring_lets_other_threads_run():
    """A rank maps its ring (and allocates every page) while its I/O thread keeps sending the
    heartbeats: the mapping must not hold the GIL throughout (MAP_POPULATE under Python's mmap
    did: 1.2 s for a GiB on this VM, 7 s on a loaded one, and the gateway detached the rank)."""
    import fcntl
    import os
    import threading
    import time

    from adpkv_core.memory.ring import RING_SEALS, Ring
    size = 1 << 30
    fd = os.memfd_create("adpkv-test-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RING_SEALS)
    ticks: list[float] = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.monotonic())
            done.wait(0.005)
    ticker = threading.Thread(target=tick)
    ticker.start()
    while not ticks:
        done.wait(0.001)
    t0 = time.monotonic()
    ring = Ring.from_fd(fd, size)
    t1 = time.monotonic()
    done.set()
    ticker.join()
    try:
        during = [t for t in ticks if t0 <= t <= t1] + [t1]
        gaps = [b - a for a, b in zip([t0] + during, during)]
        assert t1 - t0 < 0.05 or max(gaps) < (t1 - t0) / 2, \
            f"mapping the ring took {t1 - t0:.3f} s with other threads stopped for {max(gaps):.3f} s"
        assert ring.buf[size - 1] == 0 and len(ring.buf) == size
    finally:
        ring.close()


def _resident_bytes_of_mapping(address: int) -> int:
    """``Rss`` of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == address
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_an_io_process_maps_a_ring_without_populating_it_and_a_discarded_ring_holds_no_memory():
    """The gateway's I/O processes map an engine's ring (``Ring.attach``) on their first read
    task for it: unpopulated, each maps the pages it writes as it writes them (populating the
    whole ring in every one of them was the engine's first restore: 1.5 s for a 4 GiB ring
    with 2 of them, benchmarks/first_restore.py). A discarded ring (the gateway's end, its
    engine gone) holds no memory although an I/O process still maps it, and its size stays."""
    import ctypes
    import os

    from adpkv_core.memory.ring import Ring
    size = 64 << 20
    owner = Ring.create(1, size)
    owner.populate()
    reader = Ring.attach(f"/proc/{os.getpid()}/fd/{owner.fd}", size)
    try:
        export = (ctypes.c_char * size).from_buffer(reader._mmap)
        address = ctypes.addressof(export)
        del export
        assert _resident_bytes_of_mapping(address) == 0
        reader.buf[:1 << 20] = b"x" * (1 << 20)               # a slot written: its pages only
        assert _resident_bytes_of_mapping(address) == 1 << 20
        assert os.fstat(reader.fd).st_blocks * 512 >= size     # the owner populated all of it
        assert owner.discard()
        assert os.fstat(reader.fd).st_blocks == 0 and os.fstat(reader.fd).st_size == size
        assert reader.buf[0] == 0                              # a hole reads zeros, never old data
    finally:
        reader.close()


def test_ring_math():
    assert object_stride(1) == 4096 and object_stride(8192) == 8192
    assert max_parallel_ios(6 << 30, 1 << 20) == 3072


def test_placement_follows_serials_not_order():
    serials = ["L0P0", "L0P1", "L1P0", "L1P1"]
    p1, p2 = Placement(serials, 16), Placement(list(reversed(serials)), 16)
    key = KeyBuilder("n").key(1)
    assert serials[p1.ranking(key, 42)[0]] == list(reversed(serials))[p2.ranking(key, 42)[0]]
    assert key_layout_fingerprint(serials, 16, 128, "dialog") == key_layout_fingerprint(serials[::-1], 16, 128,
                                                                                          "dialog")
    assert key_layout_fingerprint(serials, 16, 128, "dialog") != key_layout_fingerprint(serials, 16, 128, "stripe")


@pytest.mark.parametrize("mode", ["dialog", "stripe"])
def test_batch_placement_is_the_per_key_rule(mode):
    """``Placement.slots`` (a batch at once, as EXIST and GET place their keys) gives every key
    the slot ``Placement.slot`` gives it alone: random keys, marks none, zero, repeated and up
    to 2**64 - 1, slot counts that are and are not powers of two."""
    rng = random.Random(26)
    keys = [os.urandom(28) for _ in range(3000)] + KeyBuilder("n").keys([i.to_bytes(8, "big") for i in range(3000)])
    for slots in (1, 16, 97, 4096):
        p = Placement(["A", "B", "C"], slots, mode)
        few = [rng.choice([0, 1, 7, 2**64 - 1]) for _ in keys]
        many = [rng.choice([0, rng.getrandbits(64)]) for _ in keys]
        for marks in (None, [], [0] * len(keys), few, many):
            got = p.slots(keys, marks).tolist()
            assert got == [p.slot(k, marks[i] if marks else 0) for i, k in enumerate(keys)], (slots, mode)
    assert Placement(["A"], 16, mode).slots([], None).tolist() == []


def test_settings_vocabulary():
    cfg = ClientConfig.from_settings({"adpkv.port": "6000", "adpkv.namespace": "x",
                                      "adpkv.key_namespace_from_model": "true"}, prefix="adpkv.")
    assert (cfg.port, cfg.namespace, cfg.key_namespace_from_model) == (6000, "x", True)
    with pytest.raises(ValueError):
        ClientConfig.from_settings({"port": "abc"})
    with pytest.raises(ValueError):
        ClientConfig.from_settings({"affinity_chunks": 0})


def test_gateway_config_validation():
    assert make_config({"port": "6000"}).port == 6000
    with pytest.raises(ValueError, match="refusing to start"):
        make_config({"shared_storage": True, "start_clean": 1})
    with pytest.raises(ValueError):
        make_config({"key_placement": "random"})
    with pytest.raises(ValueError, match="unknown setting"):
        make_config({"no_such_setting": 1})


def test_protocol_decode_errors():
    """One place decodes and checks a request; each kind of bad frame gets its own code."""
    import msgspec
    raw = msgspec.msgpack.encode
    key = b"k" * KEY_BYTES
    cases = [
        (b"\xc1", P.BAD_MESSAGE),
        (raw([1, 2]), P.BAD_MESSAGE),
        (raw({"op": "PING", "v": 2}), P.BAD_VERSION),
        (raw({"op": "FROB", "v": 1}), P.UNKNOWN_OP),
        (raw({"v": 1}), P.BAD_MESSAGE),
        (raw({"op": "GET", "v": 1, "keys": [key], "obj": 0}), P.BAD_MESSAGE),            # obj must be > 0
        (raw({"op": "GET", "v": 1, "keys": [b"short"], "obj": 4}), P.BAD_MESSAGE),
        (raw({"op": "GET", "v": 1, "keys": [key], "obj": 4, "marks": [1, 2]}), P.BAD_MESSAGE),
        (raw({"op": "GET", "v": 1, "keys": [key], "obj": 4, "tag": "t", "region": 0, "at": [0]}), P.BAD_MESSAGE),
        (raw({"op": "HELLO", "v": 1, "engine": "e", "world": 2, "rank": 2}), P.BAD_MESSAGE),
        (raw({"op": "HELLO", "v": 1, "engine": "e", "world": True, "rank": 0}), P.BAD_MESSAGE),
        (raw({"op": "RELEASE", "v": 1}), P.BAD_MESSAGE),                                  # batch is required
    ]
    for frame, code in cases:
        with pytest.raises(P.ProtocolError) as e:
            P.decode_request(frame)
        assert e.value.code == code, (frame, e.value)
    msg = P.decode_request(P.encode(P.Get(id=9, keys=[key], obj=4, unlock=True)))
    assert isinstance(msg, P.Get) and msg.op == "GET" and msg.id == 9 and msg.unlock
    assert P.request_id(raw({"op": "GET", "v": 1, "id": 5})) == 5
    assert P.unpack_flags(P.pack_flags([True, False, True])) == [True, False, True]


def test_gil_free_checksum_matches_xxhash():
    import os

    import xxhash

    from adpkv_gateway.cards.checksum import xxh3_64
    data = bytearray(os.urandom(300_000))
    for view in (data, memoryview(data)[7:250_007], bytes(data[:5000]), memoryview(bytes(data))):
        assert xxh3_64(view) == xxhash.xxh3_64_intdigest(view)


def test_streamed_checksum_matches_one_shot_in_any_pieces():
    import os

    import xxhash

    from adpkv_gateway.cards.checksum import Xxh3Stream
    data = bytearray(os.urandom(1_000_003))
    h = Xxh3Stream()
    for cuts in ([], [1], [4096, 262144, 262145], list(range(0, len(data), 65536))):
        h.reset()
        edges = [0, *cuts, len(data)]
        for a, b in zip(edges, edges[1:]):
            h.update(memoryview(data)[a:b])
        assert h.digest() == xxhash.xxh3_64_intdigest(data)
    h.reset()
    h.update(memoryview(bytes(data)))            # read-only pieces take the copying route
    assert h.digest() == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("size", [1, 4096, 256 << 10, (256 << 10) + 1, 3 << 20])
def test_fs_card_read_hashed_in_pieces_is_exact_and_catches_damage(tmp_path, size):
    import os

    from adpkv_gateway.cards.base import Read
    from adpkv_gateway.cards.fs.card import FsCard
    from adpkv_gateway.cards.fs.files import object_name
    card = FsCard(str(tmp_path / "card"), num_dbs=2)
    card.open()
    data = bytearray(os.urandom(size))
    key = b"k" * 28 + b"\0\0"                     # a head fragment key (object key + index 0)
    assert card.write(0, key, memoryview(data), write_id=5)
    out = bytearray(size)
    assert card.read(0, key, memoryview(out), write_id=5) is Read.HIT and out == data
    path = os.path.join(card.root, "db000", object_name(key))
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1                                  # last payload byte: in the last piece
    open(path, "wb").write(bytes(raw))
    assert card.read(0, key, memoryview(bytearray(size)), write_id=5) is Read.BAD_CHECKSUM
    assert card.contains_many([(0, key)]) == [False]   # a corrupt object is dropped: a miss


def test_settings_misspelt_key_refused():
    """A misspelt ``adpkv.*`` key is an error naming the near miss (it was silently ignored:
    port 5557 and no namespace); keys without the prefix (the engine's) are left alone."""
    with pytest.raises(ValueError) as err:
        ClientConfig.from_settings({"adpkv.prot": 5590, "adpkv.namesapce": "x"}, prefix="adpkv.")
    text = str(err.value)
    assert "'adpkv.prot' (did you mean 'adpkv.port'?)" in text, text
    assert "'adpkv.namesapce' (did you mean 'adpkv.namespace'?)" in text, text
    assert "\n" not in text
    with pytest.raises(ValueError, match=r"'adpkv.chunk_size'"):
        ClientConfig.from_settings({"adpkv.chunk_size": 64}, prefix="adpkv.")     # not ours here
    cfg = ClientConfig.from_settings({"adpkv.chunk_size": 64, "spec_name": "X", "block_size": 16,
                                      "adpkv.port": 5590, "adpkv.reconnect_s": 1},
                                     prefix="adpkv.", also=("chunk_size",))
    assert cfg.port == 5590


def test_number_and_byte_count_settings_have_one_parser_each():
    from adpkv_core.settings import parse_byte_count, parse_number
    assert parse_number("2.5", "x_s", "seconds") == 2.5 and parse_number(0, "x_s") == 0.0
    for bad in (-1, "soon", True, None, float("nan")):
        with pytest.raises(ValueError, match=r"x_s must be a number of seconds >= 0"):
            parse_number(bad, "x_s", "seconds")
    with pytest.raises(ValueError, match=r"x_s must be a number of seconds > 0, got 0"):
        parse_number(0, "x_s", "seconds", above=True)
    # ClientConfig's times go through it: a negative or non-numeric timeout is refused, naming it
    for bad in (-1, "ten", False):
        with pytest.raises(ValueError, match=r"adpkv.timeout_s must be a number of seconds >= 0"):
            ClientConfig.from_settings({"adpkv.timeout_s": bad}, prefix="adpkv.")
    assert ClientConfig.from_settings({"adpkv.timeout_s": "2.5"}, prefix="adpkv.").timeout_s == 2.5
    assert parse_byte_count("1GiB", "b") == 1 << 30 and parse_byte_count(0, "b") == 0
    with pytest.raises(ValueError, match="b must be >= 0 bytes"):
        parse_byte_count(-5, "b")
    with pytest.raises(ValueError, match="is not a number of bytes"):
        parse_byte_count("lots", "b")


def test_each_destination_of_a_data_request_sends_its_own_fields():
    keys = [b"k" * KEY_BYTES, b"l" * KEY_BYTES]

    def copy(batch):
        return True

    msg, p = data_request(P.Op.GET, keys, 100, ViaRing(copy, (10, 50)), [1, 2], "t", False, 5.0)
    assert isinstance(msg, P.Get) and (msg.region, msg.at, msg.pieces, msg.tag, msg.marks) == (None, None, None, "t", [1, 2])
    assert p.on_batch is copy and p.slice == (10, 50) and p.region_by is None and msg.write_by is None
    msg, p = data_request(P.Op.PUT, keys, 100, ViaRing(copy), None, None, False, 5.0)
    assert isinstance(msg, P.Put) and p.slice == (0, 100), "a ring request without a slice: whole objects"
    msg, p = data_request(P.Op.GET, keys, 100, InRegion(3, [0, 100]), None, None, True, 5.0, (7,))
    assert (msg.region, msg.at, msg.pieces, msg.unlock) == (3, [0, 100], None, True) and p.on_batch is None
    assert msg.write_by == p.region_by is not None and p.region_locks == (7,)
    dest = Scattered([(1, 60), (2, 40)], [0, 0, 60, 40])
    msg, p = data_request(P.Op.PUT, keys, dest.object_bytes, dest, None, None, False, 5.0)
    assert (msg.region, msg.at, msg.obj) == (None, [0, 0, 60, 40], 100)
    assert msg.pieces == [P.Piece(1, 60), P.Piece(2, 40)] and msg.read_by == p.region_by is not None
    assert [regions_of(d) for d in (ViaRing(copy), InRegion(3, [0]), dest)] == [set(), {3}, {1, 2}]


def test_get_and_put_results_read_one_way():
    load, store = LoadResult([True, False]), StoreResult([True, True], [False, True])
    assert (load.ok, load.all_ok, store.ok, store.all_ok) == ([True, False], False, [True, True], True)
    assert nothing(P.Op.GET, 2) == LoadResult.none(2) and nothing(P.Op.PUT, 2) == StoreResult.none(2)
    assert not nothing(P.Op.GET, 2).all_ok and LoadResult([]).all_ok
