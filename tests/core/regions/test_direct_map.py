"""MAP (issue 31): a rank gets read-only descriptors of its own objects' files, checked in place,
and maps them (``adpkv_core.direct_map``) — real gateway processes on real fs cards.

Who may receive what (its own namespace only; FORBIDDEN for another user's, as GET), read-only
(no writable mapping, no write, no reopening for writing), the mapped bytes stay the object's
whole bytes when the gateway deletes, evicts or rewrites it, a corrupt object in the page
cache is a miss (never handed, removed as a corrupt read removes it), an object the gateway
cannot hand whole (several fragments) is a miss and the ring still serves it, and the
client's LRU bound and refusals.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import signal
import threading

import pytest

from adpkv_core import direct_map
from adpkv_core.wire import protocol as P
from adpkv_core.client import GatewayClient
from adpkv_core.direct_map import DirectMaps
from adpkv_core.wire.door import DoorSession
from adpkv_core.settings import ClientConfig
from adpkv_gateway.cards.fs.files import object_name

from ..adversary import NOBODY, as_nobody
from ..rankproc import gateway_door, get_checked, make_keys, pattern

OBJ = 256 << 10          # past the size the checksum hashes without the GIL


def _client(port: int, engine: str = "engine-direct") -> GatewayClient:
    c = GatewayClient(ClientConfig(port=port), engine)
    assert c.enabled, c.attach_error
    return c


def _put(c: GatewayClient, keys, rank_pattern: int = 0, nbytes: int = OBJ):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            c.ring[o:o + nbytes] = pattern(keys[b.first + j], rank_pattern, nbytes)
    return c.put(keys, nbytes, fill).result(30)


def _file_of(card_dir: str, key: bytes) -> str:
    """The head fragment's file of an object on an fs card (found by its name)."""
    name = (key + (0).to_bytes(2, "big")).hex()
    for db in sorted(os.listdir(card_dir)):
        path = os.path.join(card_dir, db, object_name(bytes.fromhex(name)))
        if os.path.exists(path):
            return path
    raise AssertionError(f"no file {name} on {card_dir}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io_processes", [0, 2])
def test_map_hands_checked_read_only_descriptors_of_own_objects(start_gateway, io_processes):
    """Stored objects come back as read-only descriptors whose payload at ``offset`` is the
    object's bytes; a key not stored is a miss; nothing of the descriptor writes."""
    gw = start_gateway(io_processes=io_processes)
    c = _client(gw.port)
    keys = make_keys(6)
    assert _put(c, keys).stored == [True] * 6
    absent = make_keys(1, salt=b"absent")
    reply, fds = c.map_objects(keys + absent, OBJ)
    try:
        assert isinstance(reply, P.MapOk) and list(reply.hits) == [1] * 6 + [0] and len(fds) == 6
        for key, fd in zip(keys, fds):
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert os.pread(fd, OBJ, reply.offset) == pattern(key, 0, OBJ)
            with pytest.raises(OSError) as writable:
                mmap.mmap(fd, reply.offset + OBJ, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            assert writable.value.errno == errno.EACCES
            with pytest.raises(OSError) as wrote:
                os.pwrite(fd, b"x", reply.offset)
            assert wrote.value.errno == errno.EBADF
            with pytest.raises(OSError):
                os.ftruncate(fd, 0)
    finally:
        for fd in fds:
            os.close(fd)
    maps = DirectMaps(64 * OBJ)
    assert maps.fetch(c, keys, OBJ) == 6
    got = maps.acquire(keys)
    assert [bytes(m.array) == pattern(k, 0, OBJ) for m, k in zip(got, keys)] == [True] * 6
    maps.release(got)
    assert maps.stats()["mapped_bytes"] == 6 * OBJ and maps.stats()["handed"] == 6
    counters = c.stats().result(10).counters
    assert (counters["map_requests"], counters["map_handed"], counters["map_misses"]) == (2, 12, 1), counters
    maps.close()
    c.close()


def _vmas(start: int, end: int) -> list[tuple[int, int, str, str]]:
    """This process's mappings that overlap [start, end): (from, to, permissions, path)."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo < end and hi > start:
                out.append((lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nbytes", [OBJ, OBJ + 100])
def test_a_fetch_is_one_span_of_read_only_file_mappings_back_to_back(start_gateway, tmp_path, nbytes):
    """The objects one fetch keeps are one span: each object's own file mapped read-only and
    shared (``r--s``, nothing else in the range), slot after slot; ``runs`` cuts a list of held
    mappings into runs of consecutive slots of one span, and each run's rows hold exactly the
    objects' bytes (a payload that does not fill its last page too: then each payload is its
    own slot's first ``nbytes``)."""
    card = str(tmp_path / "card")
    gw = start_gateway(card_dirs=[card])
    c = _client(gw.port)
    keys, others = make_keys(6), make_keys(3, salt=b"second")
    assert _put(c, keys, nbytes=nbytes).stored == [True] * 6
    assert _put(c, others, nbytes=nbytes).stored == [True] * 3
    absent = make_keys(1, salt=b"absent")
    maps = DirectMaps(64 * (nbytes + 8192))
    assert maps.fetch(c, keys[:3] + absent + keys[3:], nbytes) == 6
    assert maps.fetch(c, others, nbytes) == 3
    assert maps.stats()["spans"] == 2
    order = [keys[0], keys[1], keys[2], others[0], keys[3], others[1], others[2], keys[5], keys[4]]
    held = maps.acquire(order)
    try:
        span = held[0].span
        assert [m.index for m in held[:3]] + [held[4].index] == [0, 1, 2, 3]       # the miss took no slot
        vmas = _vmas(span.base, span.base + span.bytes)
        assert [v[2] for v in vmas] == ["r--s"] * 6, vmas
        assert [v[3] for v in vmas] == [_file_of(card, k) for k in keys], vmas
        got = [(r.first, r.objects) for r in direct_map.runs(held)]
        assert got == [(0, 3), (3, 1), (4, 1), (5, 2), (7, 1), (8, 1)]
        for r in direct_map.runs(held):
            assert not r.rows.flags.writeable
            for j in range(r.objects):
                payload = bytes(r.rows[j, r.lead:r.lead + nbytes])
                assert payload == pattern(order[r.first + j], 0, nbytes)
                assert payload == bytes(held[r.first + j].array)
    finally:
        maps.release(held)
    maps.close()
    assert _vmas(span.base, span.base + span.bytes) == [], "closed spans leave no mapping behind"
    c.close()


@pytest.mark.timeout(120)
def test_mapped_bytes_stay_the_objects_through_delete_rewrite_and_eviction(start_gateway, tmp_path):
    """An engine holds mappings while the gateway deletes an object and stores the key again
    with other bytes (a new file: a new MAP of it hands the new bytes), and while a full card
    evicts them all: every mapping still reads the whole bytes it was handed."""
    card = str(tmp_path / "card")
    gw = start_gateway(card_dirs=[card], capacity_bytes=40 * (OBJ + 4096))
    c = _client(gw.port)
    keys = make_keys(8)
    assert _put(c, keys).stored == [True] * 8
    maps = DirectMaps(64 * OBJ)
    assert maps.fetch(c, keys, OBJ) == 8
    held = maps.acquire(keys)
    files = [_file_of(card, k) for k in keys]

    assert c.delete(keys[:1]).result(10) == 1
    assert not os.path.exists(files[0])
    assert _put(c, keys[:1], rank_pattern=7).stored == [True]          # a new file under the same name
    fresh = DirectMaps(64 * OBJ)
    assert fresh.fetch(c, keys[:1], OBJ) == 1
    [m] = fresh.acquire(keys[:1])
    assert bytes(m.array) == pattern(keys[0], 7, OBJ)
    fresh.release([m])
    fresh.close()
    more = make_keys(80, salt=b"fill")                                 # twice the card: evicts the rest
    for at in range(0, 80, 8):
        _put(c, more[at:at + 8])
    assert not any(os.path.exists(f) for f in files[1:]), "the card evicted none of the mapped objects"
    assert [bytes(m.array) == pattern(k, 0, OBJ) for m, k in zip(held, keys)] == [True] * 8
    maps.release(held)
    maps.close()
    c.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io_processes", [0, 2])
def test_a_corrupt_object_in_the_page_cache_is_a_miss_and_removed(start_gateway, tmp_path, io_processes):
    """Bytes flipped in a stored file (so in the page cache): MAP hands no descriptor for it,
    the card removes the object (as a corrupt ring read does), the others are handed."""
    card = str(tmp_path / "card")
    gw = start_gateway(card_dirs=[card], io_processes=io_processes)
    c = _client(gw.port)
    keys = make_keys(3)
    assert _put(c, keys).stored == [True] * 3
    bad = _file_of(card, keys[1])
    with open(bad, "r+b") as fh:
        fh.seek(4096 + OBJ // 2)
        byte = fh.read(1)
        fh.seek(4096 + OBJ // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    reply, fds = c.map_objects(keys, OBJ)
    for fd in fds:
        os.close(fd)
    assert list(reply.hits) == [1, 0, 1]
    assert not os.path.exists(bad)
    assert get_checked(c, keys, OBJ) == [True, False, True]
    assert "bad_checksum" in gw.log() or "checksum" in gw.log()
    c.close()


@pytest.mark.timeout(120)
def test_objects_of_several_fragments_miss_and_the_ring_serves_them(start_gateway):
    """An object the gateway cannot hand as one file (``fragment_size`` cuts it) is a miss of
    MAP; the ring restores it byte-exact (the fallback)."""
    gw = start_gateway(fragment_size=OBJ // 4)
    c = _client(gw.port)
    keys = make_keys(3)
    assert _put(c, keys).stored == [True] * 3
    maps = DirectMaps(64 * OBJ)
    assert maps.fetch(c, keys, OBJ) == 0
    assert maps.acquire(keys) == [None] * 3
    assert get_checked(c, keys, OBJ) == [True] * 3
    maps.close()
    c.close()


@pytest.mark.timeout(60)
def test_map_needs_an_attached_rank(start_gateway):
    """A door session that never attached a rank gets FORBIDDEN and no descriptor; a
    lookup-only client has no MAP at all."""
    gw = start_gateway()
    c = _client(gw.port)
    keys = make_keys(2)
    assert _put(c, keys).stored == [True] * 2
    door = DoorSession(gateway_door(gw.port), 5.0)
    try:
        reply, fds = door.map_objects(keys, OBJ)
        assert fds == [] and isinstance(reply, P.Error) and reply.code == P.FORBIDDEN
    finally:
        door.close()
    peer = GatewayClient(ClientConfig(port=gw.port), "engine-direct", rank=None)
    with pytest.raises(ConnectionError):
        peer.map_objects(keys, OBJ)
    peer.close()
    c.close()


# ---------------------------------------------------------------- another user
def _nobody_maps(port: int, theirs: list, mine: list) -> dict:
    c = GatewayClient(ClientConfig(port=port), "nobody-engine")
    seen = {"enabled": c.enabled}
    reply, fds = c.map_objects(theirs, OBJ)
    seen["theirs"] = getattr(reply, "code", reply.op)
    seen["theirs_fds"] = len(fds)
    reply, fds = c.map_objects(mine[:1] + theirs[:1], OBJ)
    seen["mixed"] = getattr(reply, "code", reply.op)
    assert _put(c, mine).stored == [True] * len(mine)
    reply, fds = c.map_objects(mine, OBJ)
    seen["mine"] = list(reply.hits)
    fd = fds[0]
    seen["exact"] = os.pread(fd, OBJ, reply.offset) == pattern(mine[0], 0, OBJ)
    try:                                      # the file is root's 0600: no reopening it to write
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
        seen["reopen_rw"] = "opened"
    except OSError as exc:
        seen["reopen_rw"] = errno.errorcode[exc.errno]
    try:
        mmap.mmap(fd, OBJ, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        seen["map_rw"] = "mapped"
    except OSError as exc:
        seen["map_rw"] = errno.errorcode[exc.errno]
    for fd in fds:
        os.close(fd)
    c.close()
    return seen


@pytest.mark.security
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, the other user is 65534")
def test_another_user_gets_forbidden_for_roots_namespace(start_gateway, open_dir):
    """uid 65534, attached as an engine of its own, asks MAP for root's keys: FORBIDDEN, no
    descriptor (alone or mixed with its own); its own objects come as read-only descriptors it
    can neither reopen for writing nor map writable."""
    gw = start_gateway(card_dirs=[os.path.join(open_dir, "card")], control_socket_mode="0666")
    root = _client(gw.port, "root-engine")
    theirs, mine = make_keys(3, namespace="root-tenant"), make_keys(2, namespace="nobody-tenant")
    assert _put(root, theirs).stored == [True] * 3
    root.close()
    seen = as_nobody(_nobody_maps, gw.port, theirs, mine)
    assert seen == {"enabled": True, "theirs": P.FORBIDDEN, "theirs_fds": 0, "mixed": P.FORBIDDEN,
                    "mine": [1, 1], "exact": True, "reopen_rw": "EACCES", "map_rw": "EACCES"}, seen
    assert NOBODY == 65534


# ---------------------------------------------------------------- the client's bound and refusals
@pytest.mark.timeout(120)
def test_the_lru_bounds_mapped_bytes_and_keeps_mappings_in_use(start_gateway, caplog):
    """``direct_map_bytes`` of 3 objects: after mapping 5, 3 are held (the most recent), a
    mapping in use survives its eviction until released; the objects of one fetch are one span
    and leave the LRU together; a registrar that refuses (CUDA refusing) a span and then each of
    its objects, with registration required, keeps nothing and logs once."""
    gw = start_gateway()
    c = _client(gw.port)
    keys = make_keys(5)
    assert _put(c, keys).stored == [True] * 5
    maps = DirectMaps(3 * OBJ)
    assert maps.fetch(c, keys[:1], OBJ) == 1
    [first] = maps.acquire(keys[:1])
    assert maps.fetch(c, keys[1:], OBJ) == 3                            # the batch's last 3 fit the bound
    assert [maps.held(k) for k in keys] == [False, False, True, True, True]
    assert maps.stats()["mapped_bytes"] == 3 * OBJ and maps.stats()["spans"] == 1
    assert bytes(first.array) == pattern(keys[0], 0, OBJ)              # evicted, in use: still mapped
    maps.release([first])
    assert first.array is None                                         # unmapped once released
    maps.prefetch(c, keys[:2], OBJ)
    assert maps.drain(30)
    assert [maps.held(k) for k in keys] == [True, True, False, False, False]   # the older span went whole
    assert maps.stats()["mapped_bytes"] == 2 * OBJ
    maps.close()

    calls = []
    refusing = DirectMaps(8 * OBJ, registrar=(lambda ptr, n: calls.append(n) or False, lambda ptr: None),
                          require_registration=True)
    with caplog.at_level(logging.WARNING, logger="adpkv.direct_map"):
        assert refusing.fetch(c, keys, OBJ) == 0
    assert calls == [5 * OBJ] + [OBJ] * 5                 # the span, then each object
    assert sum("refused to register" in r.getMessage() for r in caplog.records) == 1
    refusing.close()
    with pytest.raises(ValueError):
        DirectMaps(0)
    c.close()


@pytest.mark.timeout(120)
def test_a_map_that_times_out_ends_the_door_session_its_late_reply_never_answers_another(start_gateway):
    """A MAP that times out (the gateway stopped past the deadline) ends the door session: the
    gateway's late reply, its descriptors of the first keys' files, is never taken as the
    answer to the next MAP (of other keys), which raises ``ConnectionError``; ``DirectMaps``
    then holds nothing. (Door replies carry no request id: before, the next MAP got the
    first one's descriptors under its own keys.)"""
    gw = start_gateway()
    c = GatewayClient(ClientConfig(port=gw.port, timeout_s=30.0), "engine-direct")
    assert c.enabled, c.attach_error
    first, other = make_keys(4, salt=b"first"), make_keys(4, salt=b"other")
    assert _put(c, first).stored == [True] * 4 and _put(c, other).stored == [True] * 4
    door = c._door
    os.kill(gw.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(OSError):
            door.map_objects(first, OBJ, timeout_s=0.5)
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)
    assert door.broken and "timed out" in door.broken
    with pytest.raises(ConnectionError):
        door.map_objects(other, OBJ)
    maps = DirectMaps(64 * OBJ)
    assert maps.fetch(c, other, OBJ) == 0 and not any(maps.held(k) for k in first + other)
    maps.close()
    c.close()


@pytest.mark.timeout(120)
def test_a_prefetch_waits_for_the_restores_in_flight(start_gateway):
    """A background prefetch queued while a GET of the client is in flight (the gateway
    stopped for a moment) sends its MAP only once that GET is answered: the gateway's check of
    what MAP hands does not compete with the restore it follows."""
    gw = start_gateway()
    c = GatewayClient(ClientConfig(port=gw.port, timeout_s=30.0), "engine-direct")
    assert c.enabled, c.attach_error
    keys = make_keys(4)
    assert _put(c, keys).stored == [True] * 4
    in_flight_at_map: list[int] = []
    map_objects = c.map_objects

    def recording(*args, **kwargs):
        in_flight_at_map.append(c.restores_in_flight())
        return map_objects(*args, **kwargs)
    c.map_objects = recording
    maps = DirectMaps(64 * OBJ)
    os.kill(gw.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(0.5, os.kill, (gw.proc.pid, signal.SIGCONT))
    try:
        fut = c.get(keys, OBJ, lambda b: None)
        assert c.restores_in_flight() == 1
        maps.prefetch(c, keys, OBJ)
        resume.start()
        assert fut.result(30).hits == [True] * 4
        assert maps.drain(30)
    finally:
        resume.cancel()
        os.kill(gw.proc.pid, signal.SIGCONT)
    assert in_flight_at_map == [0] and all(maps.held(k) for k in keys)
    maps.close()
    c.close()


@pytest.mark.timeout(120)
def test_a_prefetch_waits_for_the_engine_to_pause(start_gateway):
    """A prefetch of what a pass stored (``after_passes``), queued while the engine computes
    (``busy``: the vLLM worker's passes), sends its MAP only once the engine pauses: mapping and
    registering never run under the passes of the prefill that stores. A restore's prefetch
    does not wait for the engine (the prompt's next return wants the mappings)."""
    gw = start_gateway()
    c = GatewayClient(ClientConfig(port=gw.port, timeout_s=30.0), "engine-busy")
    assert c.enabled, c.attach_error
    keys = make_keys(4)
    assert _put(c, keys).stored == [True] * 4
    computing = threading.Event()
    computing.set()
    busy_at_map: list[bool] = []
    map_objects = c.map_objects

    def recording(*args, **kwargs):
        busy_at_map.append(computing.is_set())
        return map_objects(*args, **kwargs)
    c.map_objects = recording
    maps = DirectMaps(64 * OBJ, busy=computing.is_set)
    # a restore's prefetch does not wait for the engine (its next return wants the mappings)
    maps.prefetch(c, keys[:2], OBJ)
    assert maps.drain(30) and busy_at_map == [True]
    # what a pass stored waits for a pause
    maps.prefetch(c, keys[2:], OBJ, after_passes=True)
    pause = threading.Timer(0.5, computing.clear)
    pause.start()
    try:
        assert maps.drain(30)
    finally:
        pause.cancel()
    assert busy_at_map == [True, False] and all(maps.held(k) for k in keys)
    maps.close()
    c.close()
