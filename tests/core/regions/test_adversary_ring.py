"""The ring and the regions under a hostile local user and a stalled gateway (issue 25, items 3 and 10).

A real gateway runs as root with its door open to every user (``control_socket_mode`` 0666,
documented as safe: each user reaches only its own engine and buffers); the attacker is a
forked child of the test that drops to uid 65534 (``adversary.as_nobody``).

- item 3: the ring is per engine and handed only after HELLO to an attached rank of its owner.
  Before: SESSION handed the one ring to any session, before and without HELLO; another user
  read root's KV in transit, its writes into the slots gave root wrong hits and stored foreign
  bytes, and the fs read, hashing the slot after reading into it, took those writes for
  corruption and deleted root's good objects.
- item 10: a gateway stalled between its check of ``write_by`` and its write into a region no
  longer writes into the buffer after the client gave up and took it back.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import select
import shutil
import socket
import tempfile
import threading
import time

import msgpack
import pytest
import zmq

from adpkv_core.wire import protocol as P
from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig

from ..adversary import as_nobody
from ..rankproc import gateway_door, make_keys, pattern
from ..stall import Stall

OBJ = 256 << 10          # one read piece of the fs card's page-cache path (hashing after each piece)

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, "
                                 "the attacker as uid 65534"),
              pytest.mark.security]


@pytest.fixture
def open_dir():
    """A directory every user may traverse (the card's own permissions decide the rest)."""
    path = tempfile.mkdtemp(prefix="adpkv-ring-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fill(client, keys, obj=OBJ):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + obj] = pattern(keys[b.first + j], 0, obj)
    return fill


def _drain(client, got: dict, keys, obj=OBJ):
    def drain(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride
                got[keys[b.first + j]] = bytes(client.ring[o:o + obj])
    return drain


def _fds_of_memory(fds) -> list[int]:
    return [fd for fd in fds if os.readlink(f"/proc/self/fd/{fd}").startswith(("/memfd:", "/dev/shm"))]


# ------------------------------------------------------------------ the attacker (uid 65534)
def _door(port):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5.0)
    s.connect(gateway_door(port))
    return s


def _door_ask(s, msg: dict, got: list) -> dict:
    """One raw door request; every descriptor of the reply goes into ``got``."""
    socket.send_fds(s, [msgpack.packb({"v": P.PROTOCOL_VERSION, **msg})], [])
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
    got.extend(fds)
    return msgpack.unpackb(data, raw=False)


def _hello(port, token: bytes, **fields) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "HELLO", "id": 1, "session": token,
                                 "world": 1, "namespace": "", "layout": {}, **fields}))
        assert sock.poll(5000), "no answer to HELLO"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)


def _hunt_the_ring(port, engine_id, needles, seconds):
    """Everything a session of ours can ask at the door, before and after every HELLO it can
    make; every descriptor of memory it gets is mapped, searched for root's bytes and
    overwritten for ``seconds``."""
    seen, got = {}, []
    s = _door(port)
    reply = _door_ask(s, {"op": "SESSION", "id": 1}, got)
    token = reply["token"]
    seen["ring_before_hello"] = _door_ask(s, {"op": "RING", "id": 2}, got).get("code")
    for name, fields in (("as_its_rank", {"engine": engine_id, "rank": 0, "role": "rank"}),
                         ("as_its_lookup", {"engine": engine_id, "role": "lookup"}),
                         ("own_engine", {"engine": "nobody-engine", "rank": 0, "role": "rank"})):
        seen[f"hello_{name}"] = _hello(port, token, **fields).get("code")
        seen[f"ring_after_hello_{name}"] = _door_ask(s, {"op": "RING", "id": 3}, got).get("code")
    for op in ("REGION", "SESSION", "OK", "BATCH"):
        _door_ask(s, {"op": op, "id": 4}, got)
    maps = []
    for fd in _fds_of_memory(got):
        size = os.fstat(fd).st_size
        if size:
            maps.append(mmap.mmap(fd, size, mmap.MAP_SHARED))
    seen["memory_fds"] = len(maps)
    found, rounds = 0, 0
    deadline = time.monotonic() + seconds
    junk = os.urandom(1 << 16)
    while maps and time.monotonic() < deadline:
        for mm in maps:
            if rounds % 8 == 0:
                found += sum(mm.find(n) >= 0 for n in needles)
            for off in range(0, len(mm) - len(junk) + 1, len(junk)):
                mm[off:off + len(junk)] = junk
        rounds += 1
    seen["root_bytes_seen"] = found
    s.close()
    return seen


def test_another_user_gets_no_ring_and_cannot_touch_roots_kv_in_transit(start_gateway, open_dir):
    """Root's engine restores in a loop while uid 65534 asks the door for everything it can,
    and maps and overwrites whatever memory it gets: it gets no ring at all (not by SESSION,
    not by RING before or after any HELLO it can make), sees none of root's bytes, and root's
    every hit is byte-exact and none of its objects is deleted."""
    gw = start_gateway(card_dirs=[os.path.join(open_dir, "card")], control_socket_mode="0666")
    keys = make_keys(24, namespace="root-tenant")
    rank = GatewayClient(ClientConfig(port=gw.port, timeout_s=10.0), "root-engine-ring")
    assert rank.enabled
    assert rank.put(keys, OBJ, _fill(rank, keys)).result(20).stored == [True] * len(keys)
    stop = threading.Event()
    wrong, missed, rounds = [], [], [0]

    def restore():
        while not stop.is_set():
            got: dict = {}
            hits = rank.get(keys, OBJ, _drain(rank, got, keys)).result(20).hits
            rounds[0] += 1
            missed.extend(k for k, h in zip(keys, hits) if not h)
            wrong.extend(k for k, v in got.items() if v != pattern(k, 0, OBJ))

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    try:
        needles = [pattern(k, 0, OBJ)[:64] for k in keys]
        seen = as_nobody(_hunt_the_ring, gw.port, "root-engine-ring", needles, 3.0)
    finally:
        stop.set()
        t.join(30)
    damage = f"{rounds[0]} restores: {len(wrong)} wrong hits, {len(missed)} misses; " \
        f"{sum(rank.exist(keys).result(10))} of {len(keys)} objects left"
    assert seen["memory_fds"] == 0, (seen, damage)             # no ring, no memory of any kind
    assert seen["ring_before_hello"] == P.FORBIDDEN, seen
    assert seen["hello_as_its_rank"] == P.FORBIDDEN and seen["hello_as_its_lookup"] == P.FORBIDDEN, seen
    assert seen["hello_own_engine"] == P.ENGINE_BUSY, seen
    assert all(seen[f"ring_after_hello_{n}"] == P.FORBIDDEN for n in ("as_its_rank", "as_its_lookup", "own_engine"))
    assert seen["root_bytes_seen"] == 0
    assert rounds[0] > 0 and not wrong and not missed, (rounds, len(wrong), len(missed))
    assert rank.exist(keys).result(10) == [True] * len(keys)           # none deleted
    got: dict = {}
    assert rank.get(keys, OBJ, _drain(rank, got, keys)).result(20).hits == [True] * len(keys)
    assert all(got[k] == pattern(k, 0, OBJ) for k in keys)
    rank.close()


# ------------------------------------------------------------------ engines in turn
def _ring_identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _rings_mapped(pid: int) -> int:
    """How many mappings of a ring memfd the process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as fh:
        return sum("/memfd:adpkv-ring-" in line for line in fh)


def _nobody_engine_puts(port, keys):
    c = GatewayClient(ClientConfig(port=port, timeout_s=10.0, busy_wait_s=5.0), "nobody-engine-second")
    try:
        assert c.enabled, c.attach_error
        stored = c.put(keys, OBJ, _fill(c, keys)).result(20).stored
        got: dict = {}
        hits = c.get(keys, OBJ, _drain(c, got, keys)).result(20).hits
        return {"ring": _ring_identity(c._ring.fd), "stored": stored, "hits": hits,
                "exact": all(got.get(k) == pattern(k, 0, OBJ) for k in keys)}
    finally:
        c.close()


def _nobody_engine_then_watch(port, keys, root_needles, detached, root_done):
    """Attach, store, keep a mapping of our ring, detach; once root's engine ran, search the old
    mapping for root's bytes."""
    c = GatewayClient(ClientConfig(port=port, timeout_s=10.0, busy_wait_s=5.0), "nobody-engine-first")
    assert c.enabled, c.attach_error
    stored = c.put(keys, OBJ, _fill(c, keys)).result(20).stored
    fd = os.dup(c._ring.fd)
    old = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
    identity = _ring_identity(fd)
    c.close()
    detached.set()
    assert root_done.wait(60), "root's engine did not run"
    seen = sum(old.find(n) >= 0 for n in root_needles)
    return {"ring": identity, "stored": stored, "root_bytes_seen": seen}


@pytest.mark.parametrize("io_processes", [0, 2])
def test_engines_in_turn_never_share_a_ring(start_gateway, open_dir, io_processes):
    """Root's engine, then uid 65534's, then 65534's and root's again: each engine gets a ring
    of its own (another memfd), and a mapping an engine kept of its old ring sees none of the
    next engine's bytes. Before: one ring for the gateway's life, every engine's data in it.
    With I/O processes too: they map each engine's ring, not one fixed at start."""
    gw = start_gateway(card_dirs=[os.path.join(open_dir, "card")], control_socket_mode="0666",
                       io_processes=io_processes)
    root_keys = make_keys(8, namespace="root-tenant")
    nobody_keys = make_keys(8, namespace="nobody-tenant")
    # root first, 65534 second
    root = GatewayClient(ClientConfig(port=gw.port, timeout_s=10.0), "root-engine-first")
    assert root.put(root_keys, OBJ, _fill(root, root_keys)).result(20).stored == [True] * 8
    got: dict = {}
    assert root.get(root_keys, OBJ, _drain(root, got, root_keys)).result(20).hits == [True] * 8
    kept = os.dup(root._ring.fd)
    root_ring = _ring_identity(kept)
    old = mmap.mmap(kept, os.fstat(kept).st_size, mmap.MAP_SHARED)
    root.close()
    second = as_nobody(_nobody_engine_puts, gw.port, nobody_keys)
    assert second["stored"] == [True] * 8 and second["hits"] == [True] * 8 and second["exact"]
    assert second["ring"] != root_ring                            # another memfd
    assert not any(old.find(pattern(k, 0, OBJ)[:64]) >= 0 for k in nobody_keys)
    old.close()
    os.close(kept)
    # both engines detached: the gateway maps no ring any more (each went once nothing used it)
    deadline = time.monotonic() + 10
    while _rings_mapped(gw.proc.pid) and time.monotonic() < deadline:
        select.select([], [], [], 0.05)
    assert _rings_mapped(gw.proc.pid) == 0
    # 65534 first, root second
    ctx = mp.get_context("fork")
    detached, root_done = ctx.Event(), ctx.Event()
    out: dict = {}

    def root_engine():
        assert detached.wait(60)
        c = GatewayClient(ClientConfig(port=gw.port, timeout_s=10.0, busy_wait_s=5.0), "root-engine-second")
        try:
            out["enabled"] = c.enabled
            more = make_keys(8, namespace="root-tenant", salt=b"2")
            out["stored"] = c.put(more, OBJ, _fill(c, more)).result(20).stored
            got2: dict = {}
            out["hits"] = c.get(root_keys + more, OBJ, _drain(c, got2, root_keys + more)).result(20).hits
            out["exact"] = all(got2.get(k) == pattern(k, 0, OBJ) for k in root_keys + more)
            out["ring"] = _ring_identity(c._ring.fd)
        finally:
            c.close()
            root_done.set()

    t = threading.Thread(target=root_engine, daemon=True)
    t.start()
    needles = [pattern(k, 0, OBJ)[:64] for k in root_keys]
    first = as_nobody(_nobody_engine_then_watch, gw.port, make_keys(8, namespace="nobody-tenant", salt=b"1"),
                      needles, detached, root_done)
    t.join(30)
    assert first["stored"] == [True] * 8
    assert out["enabled"] and out["stored"] == [True] * 8 and out["hits"] == [True] * 16 and out["exact"], out
    assert out["ring"] != first["ring"]
    assert first["root_bytes_seen"] == 0                         # its old ring carried none of root's KV


# ------------------------------------------------------------------ the fs read's checksum
def test_a_writer_of_the_slot_does_not_make_a_good_object_corrupt(tmp_path):
    """The fs card reads an object into a ring slot, memory the engine's ranks map too. A
    process writing into that memory while the read runs must not make the read call the
    object corrupt (a "checksum mismatch" deletes it): the checksum is of the file's bytes.
    Before: the slot was hashed after the read, so the writer's bytes failed it. Real object
    files, the card's own read function; the writer is a forked process on a shared mapping."""
    from adpkv_gateway.cards import objfile
    n = 1 << 20
    fkey = bytes(range(30))                    # a fragment key's length
    from adpkv_gateway.cards.base import Read
    dir_fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    scratch = objfile.Scratch()
    fd = os.open("object", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=dir_fd)
    payload = memoryview(bytearray(pattern(b"good", 0, n)))
    objfile.write_object_file(fd, fkey, payload, n, False, scratch, 7)
    os.close(fd)
    slot = mmap.mmap(-1, n)                       # shared with the forked writer
    assert objfile.read_object_file(dir_fd, "object", fkey, memoryview(slot), False, scratch, 7) is Read.HIT
    writer = mp.get_context("fork").Process(target=_scribble, args=(slot,), daemon=True)
    writer.start()
    try:
        verdicts = [objfile.read_object_file(dir_fd, "object", fkey, memoryview(slot), False, scratch, 7)
                    for _ in range(300)]
    finally:
        writer.kill()
        writer.join(5)
        os.close(dir_fd)
    assert verdicts == [Read.HIT] * 300, {v: verdicts.count(v) for v in set(verdicts)}


def _scribble(slot):
    addr = ctypes.addressof(ctypes.c_char.from_buffer(slot))
    memset = ctypes.CDLL(None).memset
    memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    k = 0
    while True:
        memset(addr, k & 0xFF, len(slot))
        k += 1


# ------------------------------------------------------------------ item 10: a stalled region write
# shm_buffer: the /dev/shm buffer fixture of tests/core/conftest.py


def test_a_gateway_stalled_between_its_check_and_its_write_never_writes_a_given_up_buffer(gateway, shm_buffer):
    """A region GET whose gateway stalls right after it checked ``write_by`` and before its
    ``pwrite`` (held there 3 s) while the client gives up after 1.5 s: once the client resolved
    the request (a miss) and the engine reused its buffer, the resumed gateway's write must not
    land in it. Before: the client resolved at its give-up time and the gateway's late write
    overwrote the reused buffer. Now the write happens under a lock the client takes before it
    hands the buffer back: the request resolves only once the stalled write is done."""
    path, arr = shm_buffer
    keys = make_keys(2, namespace="stall")
    obj = 64 << 10
    c = GatewayClient(ClientConfig(port=gateway.port, timeout_s=1.5, busy_wait_s=0), "region-stall-write", 0, 1)
    tracer = None
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert region == 0
        for i, k in enumerate(keys):
            arr[i * obj:(i + 1) * obj] = pattern(k, 0, obj)
        assert c.put_from(region, [0, obj], keys, obj).result(10).stored == [True, True]
        dst = [4 << 20, (4 << 20) + obj]
        arr[4 << 20:(4 << 20) + 2 * obj] = bytes(2 * obj)
        tracer = Stall(gateway.proc.pid, 3.0, "pwrite64,pwritev")
        t0 = time.monotonic()
        hits = c.get_into(region, dst, keys, obj).result(20).hits
        resolved_after = time.monotonic() - t0
        arr[4 << 20:(4 << 20) + 2 * obj] = b"\x22" * (2 * obj)        # the engine reuses its buffer
        assert hits in ([False, False], [True, False], [False, True], [True, True])
        assert tracer.until("DELAYED", 15), "the stalled write never completed"      # it has run now
        tracer.stop()
        tracer = None
        assert bytes(arr[4 << 20:(4 << 20) + 2 * obj]) == b"\x22" * (2 * obj), \
            f"the gateway wrote into the buffer after the client gave it back ({resolved_after:.2f} s)"
    finally:
        if tracer is not None:
            tracer.stop()
        c.close()
