"""Store and restore through a real gateway process: ranks, restarts, crashes, eviction, batching."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control

from ..fs_cards import object_dirs, object_paths
from ..rankproc import make_keys, pattern, run_ranks

SLICE = 48 * 1024 + 100       # deliberately not 4 KiB aligned


def stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_restores_its_bytes(gateway, world):
    keys = make_keys(24)
    stored = run_ranks(gateway.port, world, "PUT", keys, SLICE, engine="writer")
    assert all(all(flags) for _, flags, ok, _ in stored)
    restored = run_ranks(gateway.port, world, "GET", keys, SLICE, engine="reader")
    for rank, hits, exact, _ in restored:
        assert all(hits), f"rank {rank} missed objects"
        assert exact is True, f"rank {rank} got wrong bytes"
    s = stats(gateway.port)
    # one collective request each way: the gateway ran it once for all ranks
    assert s["counters"]["put_requests"] == 1 and s["counters"]["get_requests"] == 1
    assert s["objects"]["stored"] == 24 and s["objects"]["hits"] == 24


def test_partial_hits_and_misses(gateway):
    keys = make_keys(10)
    run_ranks(gateway.port, 1, "PUT", keys[:5], SLICE)
    (_, hits, exact, _), = run_ranks(gateway.port, 1, "GET", keys, SLICE, engine="r2")
    assert hits == [True] * 5 + [False] * 5 and exact is True


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "kill9"])
def test_restart_finds_everything(start_gateway, hard):
    gw = start_gateway()
    keys = make_keys(30)
    run_ranks(gw.port, 2, "PUT", keys, SLICE, engine="a")
    gw.restart(hard=hard)
    (_, h0, e0, _), (_, h1, e1, _) = run_ranks(gw.port, 2, "GET", keys, SLICE, engine="b")
    assert all(h0) and all(h1) and e0 is True and e1 is True


def _flood(port, keys, stop_at, q):
    client = GatewayClient(ClientConfig(port=port, timeout_s=2.0, busy_wait_s=0), "flood")
    done = 0
    for start in range(0, len(keys), 8):
        part = keys[start:start + 8]

        def fill(b, part=part):
            for j in range(b.count):
                o = b.offset + j * b.stride
                client.ring[o:o + SLICE] = pattern(part[b.first + j], 0, SLICE)
        client.put(part, SLICE, fill)
        done += len(part)
        if time.monotonic() > stop_at:
            break
    q.put(done)
    time.sleep(5)


def test_kill9_during_put_flood_never_yields_wrong_data(start_gateway, tmp_path):
    gw = start_gateway(thread_pool_size=4)
    keys = make_keys(4000)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_flood, args=(gw.port, keys, time.monotonic() + 20, q))
    p.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and stats(gw.port)["objects"].get("stored", 0) < 50:
        time.sleep(0.05)
    os.kill(gw.proc.pid, signal.SIGKILL)   # in the middle of the flood
    gw.proc.wait()
    gw.proc = None
    submitted = q.get(timeout=30)
    p.kill()
    p.join()
    gw.start()
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys[:submitted], SLICE, engine="check")
    assert exact is True, "a restored object differs from what was written"
    assert 50 <= sum(hits) <= submitted
    leftovers = [p for p in object_paths(gw.card_dirs[0], hidden=True) if os.path.basename(p).startswith(".")]
    assert leftovers == [], "temp files of interrupted writes survived the restart"


def test_eviction_keeps_usage_under_capacity_and_evicts_lru(start_gateway):
    obj = 64 * 1024
    on_disk = obj + 4096
    capacity = 40 * on_disk
    gw = start_gateway(capacity_bytes=capacity, eviction_watermark=0.9, eviction_ratio=0.2)
    old = make_keys(30, salt=b"old")
    new = make_keys(15, salt=b"new")
    run_ranks(gw.port, 1, "PUT", old, obj, engine="e1")
    # touch the first 10 old objects: they become the most recently used
    (_, hits, _, _), = run_ranks(gw.port, 1, "GET", old[:10], obj, engine="e2")
    assert all(hits)
    run_ranks(gw.port, 1, "PUT", new, obj, engine="e3")
    s = stats(gw.port)
    card = s["cards"][0]
    assert card["used_bytes"] <= capacity
    assert card["evicted"] > 0
    (_, touched, _, _), = run_ranks(gw.port, 1, "GET", old[:10], obj, engine="e4")
    (_, untouched, _, _), = run_ranks(gw.port, 1, "GET", old[10:], obj, engine="e5")
    (_, recent, _, _), = run_ranks(gw.port, 1, "GET", new[-10:], obj, engine="e6")
    assert all(touched), "recently used objects were evicted"
    assert all(recent), "the newest objects were evicted"
    assert sum(untouched) < len(untouched), "nothing least-recently-used was evicted"


def test_request_larger_than_ring_runs_in_batches(start_gateway):
    gw = start_gateway(shared_memory_size=8 << 20)
    obj = 1 << 20
    keys = make_keys(40)          # 40 MiB through an 8 MiB ring
    stored = run_ranks(gw.port, 2, "PUT", keys, obj // 2, engine="w")
    assert all(all(f) for _, f, _, _ in stored)
    restored = run_ranks(gw.port, 2, "GET", keys, obj // 2, engine="r")
    assert all(all(h) and e is True for _, h, e, _ in restored)
    assert stats(gw.port)["counters"]["get_requests"] == 1


def test_196k_token_prompt_layer_is_one_request(gateway):
    chunks = 196000 // 256
    keys = make_keys(chunks)
    obj = 4096
    (_, stored, _, _), = run_ranks(gateway.port, 1, "PUT", keys, obj, engine="w")
    (_, hits, exact, _), = run_ranks(gateway.port, 1, "GET", keys, obj, engine="r")
    assert all(stored) and all(hits) and exact is True
    s = stats(gateway.port)
    assert s["counters"]["put_requests"] == 1 and s["counters"]["get_requests"] == 1
    assert s["objects"]["hits"] == chunks


def test_fragments_spread_over_dbs_and_a_lost_fragment_is_a_miss(start_gateway):
    gw = start_gateway(fragment_size=64 * 1024, num_dbs=8)
    obj = 300 * 1024                              # 5 fragments
    keys = make_keys(4)
    run_ranks(gw.port, 1, "PUT", keys, obj, engine="w")
    card = gw.card_dirs[0]
    files = {d: os.listdir(d) for d in object_dirs(card)}
    assert sum(len(f) for f in files.values()) == 4 * 5
    assert sum(1 for f in files.values() if f) >= 4, "fragments were not spread over the databases"
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, obj, engine="r")
    assert all(hits) and exact is True
    # remove one non-head fragment of key 0: that object must now miss, the others hit
    frag_name = (keys[0] + (2).to_bytes(2, "big")).hex()
    for d, names in files.items():
        if frag_name in names:
            os.unlink(os.path.join(d, frag_name))
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, obj, engine="r2")
    assert hits == [False, True, True, True] and exact is True


def test_reads_in_io_processes(start_gateway):
    """``io_processes``: fs card reads run in worker processes; same bytes, same misses."""
    gw = start_gateway(io_processes=2, fragment_size=64 * 1024)
    keys = make_keys(24)
    obj = 200 * 1024 + 8                      # 4 fragments, the last one short
    stored = run_ranks(gw.port, 2, "PUT", keys[:20], obj // 2, engine="w")
    assert all(all(f) for _, f, _, _ in stored)
    restored = run_ranks(gw.port, 2, "GET", keys, obj // 2, engine="r")
    for _, hits, exact, _ in restored:
        assert hits == [True] * 20 + [False] * 4 and exact is True
    assert "I/O processes" in gw.log()
    card = gw.card_dirs[0]
    head = keys[0].hex() + "0000"
    for p in object_paths(card):
        if os.path.basename(p) == head:
            with open(p, "r+b") as fh:
                fh.seek(5000)
                fh.write(b"corrupt!")
    restored = run_ranks(gw.port, 2, "GET", keys[:3], obj // 2, engine="r2")
    assert all(hits == [False, True, True] and exact is True for _, hits, exact, _ in restored)
    assert "checksum mismatch" in gw.log()


def test_reads_in_io_processes_are_counted_on_every_card(start_gateway, tmp_path):
    """A group of reads that spans two cards, read in the I/O processes: each card's read
    statistics count them (before, such a group was counted on no card at all)."""
    gw = start_gateway(card_dirs=[str(tmp_path / "pa"), str(tmp_path / "pb")], io_processes=1,
                       key_placement="stripe")
    keys = make_keys(32)
    assert all(all(f) for _, f, _, _ in run_ranks(gw.port, 1, "PUT", keys, 8192, engine="w"))
    before = [c["reads"] for c in stats(gw.port)["cards"]]
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, 8192, engine="r")
    assert all(hits) and exact is True
    cards = stats(gw.port)["cards"]
    per_card = [c["reads"] - b for c, b in zip(cards, before)]
    assert sum(per_card) == 32 and all(n > 0 for n in per_card), per_card
    assert all(c["bytes_read"] > 0 and c["read_errors"] == 0 for c in cards)


def test_reads_in_io_processes_fall_back_to_the_replica_byte_exact(start_gateway, tmp_path):
    """Reads in the I/O processes go as one task of many reads per process: a task whose reads
    on one card partly fail (every other file of the card removed or a payload byte flipped)
    reads those objects from the other replica, byte exact, the rest as read; the card counts
    exactly its failed reads as errors and drops what it lost, so the next GET reads those
    objects from the replica at once."""
    dirs = [str(tmp_path / "ra"), str(tmp_path / "rb")]
    gw = start_gateway(card_dirs=dirs, replicas=2, io_processes=2, key_placement="stripe")
    keys = make_keys(64)
    obj = 8192 + 40
    assert all(all(f) for _, f, _, _ in run_ranks(gw.port, 1, "PUT", keys, obj, engine="w"))
    files = object_paths(dirs[0])
    assert len(files) == 64
    for i, path in enumerate(files[::2]):
        if i % 2:
            os.unlink(path)
        else:
            with open(path, "r+b") as fh:
                fh.seek(4096 + 100)
                byte = fh.read(1)
                fh.seek(4096 + 100)
                fh.write(bytes([byte[0] ^ 0xFF]))

    def get(engine):
        before = stats(gw.port)["cards"]
        (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, obj, engine=engine)
        assert all(hits) and exact is True
        after = stats(gw.port)["cards"]
        return [(a["reads"] - b["reads"], a["read_errors"] - b["read_errors"]) for a, b in zip(after, before)]

    (r0, e0), (r1, e1) = get("r")
    # card 0 read the objects placed first on it, of which about half failed (a task of good
    # and bad reads); card 1 read its own and every one that failed on card 0
    assert e1 == 0 and 0 < e0 < r0 and r0 + r1 - e0 == 64, (r0, e0, r1, e1)
    assert "checksum mismatch" in gw.log()
    assert get("r2") == [(r0 - e0, 0), (r1, 0)]


def _io_processes(gateway_pid: int) -> list[int]:
    """The gateway's I/O reader processes (its spawned children, not multiprocessing's tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == gateway_pid and b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
            pids.append(int(entry))
    return sorted(pids)


def _queued_task_bytes(pid: int) -> int:
    """Bytes waiting in the pipes of a process (its task pipe: read tasks sent, not yet taken)."""
    import fcntl
    import struct
    import termios
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("pipe:"):
                continue
            probe = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            total += struct.unpack("i", fcntl.ioctl(probe, termios.FIONREAD, b"\0" * 4))[0]
        finally:
            os.close(probe)
    return total


def _until(what, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met before the deadline")


def test_io_process_killed_mid_read_gives_misses_then_fresh_readers(start_gateway):
    """A reader killed while reads wait on it: the GET ends (no hang) with misses for what it
    could not read and exact bytes for every hit; the readers start again and the next GET
    hits everything. Nothing read by the dead set lands after the GET was answered."""
    import threading
    gw = start_gateway(io_processes=2)
    keys = make_keys(16)
    assert all(all(f) for _, f, _, _ in run_ranks(gw.port, 1, "PUT", keys, 96 * 1024, engine="w"))
    readers = _until(lambda: (lambda p: p if len(p) == 2 else None)(_io_processes(gw.proc.pid)))
    result = {}
    t = threading.Thread(target=lambda: result.update(
        r=run_ranks(gw.port, 1, "GET", keys, 96 * 1024, engine="r", timeout=120)))
    try:
        for pid in readers:
            os.kill(pid, signal.SIGSTOP)          # the reads of the next GET queue up behind them
        t.start()
        _until(lambda: _queued_task_bytes(readers[0]) > 0)     # its reads wait for the readers
        os.kill(readers[0], signal.SIGKILL)
        _until(lambda: "died" in gw.log())        # the other reader, still stopped, went with it
    finally:
        try:
            os.kill(readers[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    t.join(120)
    assert not t.is_alive(), "the GET hung on a dead reader"
    (_, hits, exact, _), = result["r"]
    assert exact is True and not any(hits)
    fresh = _until(lambda: (lambda p: p if len(p) == 2 and not set(p) & set(readers) else None)(
        _io_processes(gw.proc.pid)))
    assert fresh
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, 96 * 1024, engine="r2")
    assert all(hits) and exact is True


def fill_from(c: GatewayClient, keys: list[bytes], obj: int):
    """A PUT's batch callback: each object's pattern (by its key) into ``c``'s ring."""
    def fill(b):
        for i in range(b.count):
            at = b.offset + i * b.stride
            c.ring[at:at + obj] = pattern(keys[b.first + i], 0, obj)
    return fill


def drain_into(c: GatewayClient, got: dict[int, bytes], obj: int):
    """A GET's batch callback: each hit object's bytes out of ``c``'s ring into ``got``, by index."""
    def drain(b):
        for i in range(b.count):
            if b.hits[i]:
                at = b.offset + i * b.stride
                got[b.first + i] = bytes(c.ring[at:at + obj])
    return drain


@contextlib.contextmanager
def stores_held_by_slow_writes(start_gateway, ns: str, obj: int, stores: int, per_store: int, **settings):
    """A real gateway (2 I/O threads, 2 I/O processes, ``settings``) with 4 objects of ``obj``
    bytes stored (``stored``), then every card write held 0.25 s (strace) and ``stores`` PUTs of
    ``per_store`` objects sent, one of their writes running: yields (client, stored, puts). After
    the block every store has landed and is found."""
    from ..stall import Stall

    gw = start_gateway(thread_pool_size=2, io_processes=2, **settings)
    c = GatewayClient(ClientConfig(port=gw.port, timeout_s=60.0, busy_wait_s=0), ns, 0, 1)
    assert c.enabled, c.attach_error
    stored = make_keys(4, namespace=ns, salt=b"stored")
    assert c.put(stored, obj, fill_from(c, stored, obj)).result(30).stored == [True] * 4
    stall = Stall(gw.proc.pid, 0.25, "pwrite64,pwritev,pwritev2")
    try:
        batches = [make_keys(per_store, namespace=ns, salt=b"new%d" % i) for i in range(stores)]
        puts = [c.put(keys, obj, fill_from(c, keys, obj)) for keys in batches]
        assert stall.until("pwrite", 20), "no card write started"
        yield c, stored, puts
        assert all(all(f.result(60).stored) for f in puts)
    finally:
        stall.stop()
    assert c.exist([k for keys in batches for k in keys]).result(30) == [True] * (stores * per_store)
    c.close()


def test_a_lookup_is_answered_while_stores_wait_for_slow_writes(start_gateway):
    """The scheduler's lookup (EXIST) of a returning prompt does not queue behind the card
    writes of the prompts stored before it: on an H200 a prompt served right after others
    waited 0.3-0.9 s for its lookup (the writes of the earlier prompts ahead of it on the I/O
    pool), which was all of what storing cost the next prompt's prefill. Here every write of
    a real gateway is held 0.25 s (strace) with 2 I/O threads and 48 objects' writes queued
    (about 6 s of them): an EXIST is answered within 1 s, its hits right, a restore of stored
    objects (reads in the I/O processes) ends within 1.5 s with their bytes, and every store
    still lands."""
    obj = 64 << 10
    with stores_held_by_slow_writes(start_gateway, "lq", obj, stores=6, per_store=8) as (c, stored, _):
        asked = time.monotonic()
        hits = c.exist(stored + make_keys(1, namespace="lq", salt=b"never")).result(30)
        answered = time.monotonic() - asked
        assert hits == [True] * 4 + [False]
        assert answered < 1.0, f"the lookup waited {answered:.2f} s behind the writes"
        # a restore of the stored prompt: its lookup stage neither (its reads in the I/O processes)
        got: dict[int, bytes] = {}
        asked = time.monotonic()
        assert c.get(stored, obj, drain_into(c, got, obj)).result(30).hits == [True] * 4
        restored = time.monotonic() - asked
        assert got == {i: pattern(k, 0, obj) for i, k in enumerate(stored)}
        assert restored < 1.5, f"the restore waited {restored:.2f} s behind the writes"


def test_a_restore_finds_ring_room_while_stores_hold_theirs_for_slow_writes(start_gateway):
    """Stores hold at most ``STORE_SHARE`` of an engine's ring (their batches keep it until their
    card writes end); the rest is kept for restores, which a returning prompt waits for. Here
    every write of a real gateway is held 0.25 s (strace), 2 I/O threads, an 8 MiB ring, two
    stores of 16 objects of 256 KiB (a batch's writes take 2 s): a restore of other stored
    objects ends within 1 s with their bytes (it waited for the first store's batch before,
    the whole ring held), and every store still lands."""
    obj = 256 << 10
    with stores_held_by_slow_writes(start_gateway, "rr", obj, stores=2, per_store=16,
                                    shared_memory_size=8 << 20) as (c, stored, puts):
        got: dict[int, bytes] = {}
        asked = time.monotonic()
        hits = c.get(stored, obj, drain_into(c, got, obj)).result(30).hits
        restored = time.monotonic() - asked
        assert hits == [True] * 4
        assert got == {i: pattern(k, 0, obj) for i, k in enumerate(stored)}
        assert restored < 1.0, f"the restore waited {restored:.2f} s for ring room behind the stores"
        assert not puts[0].done(), "the first store's writes ended first: no window tested"


def test_a_prompt_back_before_its_writes_landed_is_answered_at_once_and_restored_whole(start_gateway):
    """The engine lets a stored prompt's blocks go once their pages are in the ring, before the
    card writes: the same prompt can come back while they are queued. Its lookup (EXIST), which
    the engine's scheduler waits for, answers at once with what is on the card (on an H200 an
    EXIST that waited for such writes stalled the engine 4.1 s); a restore (GET) of objects
    being written waits for their writes and gets every object with its bytes; a lookup of
    other keys does not wait. Every write of a real gateway is held 0.25 s (strace), 2 I/O
    threads, 16 objects a prompt (about 2 s of writes)."""
    from ..stall import Stall

    gw = start_gateway(thread_pool_size=2, io_processes=2)
    obj = 64 << 10
    c = GatewayClient(ClientConfig(port=gw.port, timeout_s=60.0, busy_wait_s=0), "own-writes", 0, 1)
    assert c.enabled, c.attach_error

    def store(keys, stall):
        """A PUT of ``keys``, returned once a card write of it runs (the strace attached first
        sees no earlier write)."""
        put = c.put(keys, obj, fill_from(c, keys, obj))
        assert stall.until("pwrite", 20), "no card write started"
        assert not put.done()
        return put

    keys = make_keys(16, namespace="ow", salt=b"back")
    stall = Stall(gw.proc.pid, 0.25, "pwrite64,pwritev,pwritev2")
    try:
        put = store(keys, stall)
        asked = time.monotonic()
        assert c.exist(make_keys(2, namespace="ow", salt=b"other")).result(30) == [False, False]
        assert time.monotonic() - asked < 1.0, "a lookup of keys nobody writes waited for the writes"
        assert not put.done(), "the writes ended before the prompt came back: no window tested"
        asked = time.monotonic()
        hits = c.exist(keys).result(30)
        answered = time.monotonic() - asked
        assert answered < 1.0, f"the lookup waited {answered:.2f} s for the prompt's own writes"
        assert not put.done(), "the writes ended before the lookup was answered: no window tested"
        assert sum(hits) < 16, "every object was on the card already: no window tested"
        assert put.result(30).stored == [True] * 16
        assert c.exist(keys).result(30) == [True] * 16
    finally:
        stall.stop()

    more = make_keys(16, namespace="ow", salt=b"again")
    got: dict[int, bytes] = {}
    stall = Stall(gw.proc.pid, 0.25, "pwrite64,pwritev,pwritev2")
    try:
        put = store(more, stall)
        hits = c.get(more, obj, drain_into(c, got, obj)).result(30).hits
        assert hits == [True] * 16, f"the restore found {sum(hits)} of 16 objects while they were written"
        assert got == {i: pattern(k, 0, obj) for i, k in enumerate(more)}
        assert put.result(30).stored == [True] * 16
    finally:
        stall.stop()
    c.close()
