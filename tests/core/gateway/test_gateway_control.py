"""Bad input, engine exclusivity, gateway loss, clean rules and the status file."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from adpkv_core.wire import protocol as P
from adpkv_core.client import TURNED_OFF_MESSAGE, GatewayClient, StoreResult
from adpkv_core.wire.door import DoorSession
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.ops.spawn import free_port

from ..fs_cards import object_paths
from ..rankproc import gateway_door, make_keys, pattern, run_ranks


class RawPeer:
    """A raw DEALER socket: sends whatever bytes a test wants. It holds a session from the
    door, added to HELLO, STATS and CLEAN unless the test gives ``session`` itself."""

    def __init__(self, port):
        self.door = DoorSession(gateway_door(port), 5.0)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send_raw(self, *frames) -> dict:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(3000), "the gateway did not answer"
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def send(self, **msg) -> dict:
        msg.setdefault("v", P.PROTOCOL_VERSION)
        msg.setdefault("id", 7)
        if msg.get("op") in ("HELLO", "STATS", "CLEAN"):
            msg.setdefault("session", self.door.token)
        if msg.get("session") is None:
            msg.pop("session", None)
        return self.send_raw(msgpack.packb(msg, use_bin_type=True))

    def close(self):
        self.sock.close(0)
        self.door.close()


@pytest.mark.security
def test_bad_input_gets_clear_errors_and_changes_nothing(gateway):
    keys = make_keys(3)
    run_ranks(gateway.port, 1, "PUT", keys, 8192, engine="w")
    peer = RawPeer(gateway.port)
    assert peer.send_raw(b"\xc1garbage")["code"] == P.BAD_MESSAGE
    assert peer.send_raw(msgpack.packb([1, 2, 3]))["code"] == P.BAD_MESSAGE
    assert peer.send_raw(b"a", b"b")["code"] == P.BAD_MESSAGE
    assert peer.send(v=99, op="PING")["code"] == P.BAD_VERSION
    assert peer.send(op="FROB")["code"] == P.UNKNOWN_OP
    assert peer.send(op="GET", keys=keys, obj=8192)["code"] == P.NOT_ATTACHED
    assert peer.send(op="HELLO", engine="raw", rank=3, world=2)["code"] == P.BAD_MESSAGE
    assert peer.send(op="HELLO", engine="raw", rank="0", world=1)["code"] == P.BAD_MESSAGE
    # no session, a forged one, fields out of bounds: refused, nothing attached
    assert peer.send(op="HELLO", engine="raw", rank=0, world=1, session=None)["code"] == P.FORBIDDEN
    assert peer.send(op="HELLO", engine="raw", rank=0, world=1, session=b"x" * 16)["code"] == P.FORBIDDEN
    assert peer.send(op="STATS", session=None)["code"] == P.FORBIDDEN
    assert peer.send(op="CLEAN", session=None)["code"] == P.FORBIDDEN
    for bad in ({"world": (1 << 64) - 1, "rank": 0}, {"world": 1025, "rank": 0}, {"world": 2, "rank": 1 << 63},
                {"world": 1, "rank": 0, "engine": "e" * 100_000}, {"world": 1, "rank": 0, "engine": "a\nb"},
                {"world": 1, "rank": 0, "engine": ""}, {"world": 1, "rank": 0, "namespace": "n" * 257},
                {"world": 1, "rank": 0, "layout": {"x": "y" * 20_000}}):
        reply = peer.send(op="HELLO", **{"engine": "raw", **bad})
        assert reply["code"] == P.BAD_MESSAGE and len(reply["msg"]) < 200, reply
    assert peer.send(op="HELLO", engine="raw", rank=0, world=1)["op"] == "OK"
    assert peer.send(op="HELLO", engine="raw", rank=0, world=1)["code"] == P.RANK_TAKEN
    assert peer.send(op="GET", keys=keys, obj=1 << 40)["code"] == P.TOO_LARGE
    assert peer.send(op="GET", keys=keys, obj=-5)["code"] == P.BAD_MESSAGE
    assert peer.send(op="GET", keys=[b"short"], obj=4096)["code"] == P.BAD_MESSAGE
    assert peer.send(op="GET", keys=keys, obj=4096, marks=[1])["code"] == P.BAD_MESSAGE
    assert peer.send(op="EXIST", keys="notalist")["code"] == P.BAD_MESSAGE
    assert peer.send(op="RELEASE", batch=999999)["code"] == P.UNKNOWN_BATCH
    assert peer.send(op="FILLED", batch="x")["code"] == P.BAD_MESSAGE
    second = RawPeer(gateway.port)
    reply = second.send(op="HELLO", engine="another-engine", rank=0, world=1)
    assert reply["code"] == P.ENGINE_BUSY and "one engine per gateway" in reply["msg"]
    second.close()
    peer.send(op="BYE")
    peer.close()
    # the gateway still serves, and nothing stored was changed
    (_, hits, exact, _), = run_ranks(gateway.port, 1, "GET", keys, 8192, engine="after")
    assert all(hits) and exact is True


def test_garbage_truncated_and_foreign_card_files_are_misses(start_gateway):
    gw = start_gateway()
    keys = make_keys(4)
    run_ranks(gw.port, 1, "PUT", keys, 20000, engine="w")
    gw.stop()
    card = gw.card_dirs[0]
    paths = {}
    for path in object_paths(card):
        paths[bytes.fromhex(os.path.basename(path))[:28]] = path
    with open(paths[keys[0]], "r+b") as fh:          # garbage in the payload
        fh.seek(5000)
        fh.write(os.urandom(64))
    with open(paths[keys[1]], "r+b") as fh:          # truncated
        fh.truncate(4096 + 100)
    with open(paths[keys[3]], "rb") as src, open(paths[keys[2]], "wb") as dst:   # another key's object
        dst.write(src.read())
    gw.start()
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, 20000, engine="r")
    assert hits == [False, False, False, True] and exact is True
    assert "checksum mismatch" in gw.log() and "truncated" in gw.log() and "bad header" in gw.log()


def test_second_engine_is_refused_and_a_dead_engine_frees_the_gateway(start_gateway):
    gw = start_gateway(engine_timeout_s=2)
    first = subprocess.Popen([sys.executable, "-c", f"""
import time
from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
c = GatewayClient(ClientConfig(port={gw.port}), "engine-one")
assert c.enabled
print("attached", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "attached"
    second = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=0), "engine-two")
    assert not second.enabled and second.attach_error.startswith(P.ENGINE_BUSY)
    assert second.exist(make_keys(2)).result(timeout=0.1) == [False, False]
    second.close()
    first.kill()                       # dies without a goodbye
    first.wait()
    t0 = time.monotonic()
    third = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=10), "engine-three")
    assert third.enabled, third.attach_error
    assert time.monotonic() - t0 < 8
    third.close()


def test_gateway_down_turns_the_cache_off_once_and_at_once(start_gateway, caplog):
    """A dead gateway closes its door: the rank knows at once, not after timeout_s (10 s)."""
    gw = start_gateway()
    keys = make_keys(4)
    client = GatewayClient(ClientConfig(port=gw.port, timeout_s=10.0), "engine")
    assert client.enabled
    assert client.exist(keys).result(timeout=5) == [False] * 4
    with caplog.at_level(logging.WARNING, logger="adpkv.client"):
        gw.kill()
        t0 = time.monotonic()
        hits = client.get(keys, 4096, lambda b: None).result(timeout=10).hits
        waited = time.monotonic() - t0
        assert hits == [False] * 4 and not client.enabled
        assert waited < 2.0, f"a rank waited {waited:.2f} s for a dead gateway"
        t0 = time.monotonic()
        for _ in range(100):
            assert client.exist(keys).result() == [False] * 4
            assert client.put(keys, 4096, lambda b: None).result() == StoreResult.none(4)
        assert time.monotonic() - t0 < 0.5, "calls after turn-off must be fast"
    assert sum(TURNED_OFF_MESSAGE in r.getMessage() for r in caplog.records) == 1
    client.close()


def test_a_quickly_restarted_gateway_turns_the_old_attachment_off(start_gateway, caplog):
    """The new gateway never heard of the rank (nor has it the old ring): the client must not
    go on sending into a void; the old gateway's door closed, so it is off before the new
    gateway is up, and a new client attaches."""
    gw = start_gateway()
    keys = make_keys(3)
    client = GatewayClient(ClientConfig(port=gw.port, timeout_s=5.0), "engine")
    assert client.enabled
    with caplog.at_level(logging.WARNING, logger="adpkv.client"):
        gw.restart()                          # back before any timeout could notice
        assert client.exist(keys).result(timeout=10) == [False] * 3
        assert not client.enabled
    assert any("went away" in r.getMessage() for r in caplog.records)
    client.close()
    fresh = GatewayClient(ClientConfig(port=gw.port, timeout_s=5.0), "engine")
    assert fresh.enabled
    fresh.close()


def test_no_gateway_at_start_is_a_fast_miss(caplog):
    with caplog.at_level(logging.WARNING, logger="adpkv.client"):
        client = GatewayClient(ClientConfig(port=1, connect_timeout_s=0.5), "engine")
    assert not client.enabled
    assert client.get(make_keys(2), 4096, lambda b: None).result(timeout=0.1).hits == [False, False]
    assert sum(TURNED_OFF_MESSAGE in r.getMessage() for r in caplog.records) == 1
    client.close()


def test_clean_and_shared_storage(start_gateway, tmp_path):
    gw = start_gateway()
    keys = make_keys(3)
    run_ranks(gw.port, 1, "PUT", keys, 4096, engine="w")
    reply = control.request(gw.port, {"op": "CLEAN"})
    assert reply["op"] == "OK" and reply["deleted"] == 3
    run_ranks(gw.port, 1, "PUT", keys, 4096, engine="w2")
    gw.stop()
    shared = start_gateway(card_dirs=gw.card_dirs, shared_storage=True)
    reply = control.request(shared.port, {"op": "CLEAN"})
    assert reply["code"] == P.CLEAN_REFUSED
    (_, hits, _, _), = run_ranks(shared.port, 1, "GET", keys, 4096, engine="r")
    assert all(hits), "a refused CLEAN deleted something"
    assert "nothing was deleted" in shared.log()
    shared.stop()
    refused = subprocess.run([sys.executable, "-m", "adpkv_gateway.loop.main", "--storage-devices", gw.card_dirs[0],
                              "--port", str(free_port()), "--shared-storage", "1", "--start-clean", "1"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to start" in refused.stderr


def test_fingerprint_mismatch_refuses_to_start(start_gateway):
    gw = start_gateway()
    fp = control.request(gw.port, {"op": "STATS"})["stats"]["fingerprint"]
    assert f"Key layout fingerprint {fp}" in gw.log()
    gw.stop()
    same = start_gateway(card_dirs=gw.card_dirs, key_layout_fingerprint=fp)
    same.stop()
    bad = subprocess.run([sys.executable, "-m", "adpkv_gateway.loop.main", "--storage-devices", gw.card_dirs[0],
                          "--port", str(free_port()), "--key-layout-fingerprint", "0123456789abcdef"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "refusing to start" in bad.stderr


def test_status_file_and_cli(start_gateway, tmp_path):
    status = tmp_path / "status.prom"
    gw = start_gateway(status_file=str(status))
    run_ranks(gw.port, 1, "PUT", make_keys(5), 4096, engine="w")
    run_ranks(gw.port, 1, "GET", make_keys(6), 4096, engine="r")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and 'adpkv_gateway_hits_total{namespace=""} 5.0' not in (
            status.read_text() if status.exists() else ""):
        time.sleep(0.2)
    text = status.read_text()
    serial = control.request(gw.port, {"op": "STATS"})["stats"]["cards"][0]["serial"]
    assert f'adpkv_gateway_storage_group_active{{group="{serial}"}} 1.0' in text
    assert 'adpkv_gateway_hits_total{namespace=""} 5.0' in text
    assert 'adpkv_gateway_misses_total{namespace=""} 1.0' in text
    assert "adpkv_gateway_key_layout_info{fingerprint=" in text
    cli = [sys.executable, "-m", "adpkv_gateway.ops.cli", "--port", str(gw.port)]
    out = subprocess.run(cli + ["status"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and serial in out.stdout and "active" in out.stdout
    out = subprocess.run(cli + ["usage"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "5 objects" in out.stdout
    out = subprocess.run(cli + ["clean"], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "--yes" in out.stderr
    out = subprocess.run(cli + ["clean", "--yes"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "deleted 5 objects" in out.stdout
    gw.stop()
    out = subprocess.run(cli + ["status"], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "no gateway answered" in out.stderr


def test_lookup_peer_pins_and_duplicate_puts(gateway):
    """A lookup-only peer (vLLM's scheduler) beside a rank; pins; a PUT of stored keys is skipped."""
    keys = make_keys(4)
    rank = GatewayClient(ClientConfig(port=gateway.port), "engine-x", rank=0, world_size=1)
    lookup = GatewayClient(ClientConfig(port=gateway.port, busy_wait_s=0), "engine-x", rank=None, world_size=1)
    assert rank.enabled and lookup.enabled
    other = GatewayClient(ClientConfig(port=gateway.port, busy_wait_s=0), "engine-y", rank=None)
    assert not other.enabled and other.attach_error.startswith(P.ENGINE_BUSY)
    other.close()

    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            rank.ring[o:o + 4096] = bytes([b.first + j]) * 4096
    first = rank.put(keys[:2], 4096, fill).result(timeout=10)
    assert first == StoreResult([True, True], [False, False])
    again = rank.put(keys, 4096, fill).result(timeout=10)
    assert again == StoreResult([True] * 4, [True, True, False, False])
    assert lookup.exist(keys).result(timeout=5) == [True] * 4
    assert lookup.get(keys, 4096, lambda b: None).result(timeout=1).hits == [False] * 4, "lookup peers move no data"
    # pins: taken by EXIST(lock), kept across a plain GET, released by UNLOCK
    assert rank.exist(keys, lock=True).result(timeout=5) == [True] * 4
    assert control.request(gateway.port, {"op": "STATS"})["stats"]["pinned"] == 4
    rank.get(keys, 4096, lambda b: None).result(timeout=10)
    assert control.request(gateway.port, {"op": "STATS"})["stats"]["pinned"] == 4
    rank.get(keys[:2], 4096, lambda b: None, unlock=True).result(timeout=10)
    assert control.request(gateway.port, {"op": "STATS"})["stats"]["pinned"] == 2
    rank.unlock(keys[2:]).result(timeout=5)
    assert control.request(gateway.port, {"op": "STATS"})["stats"]["pinned"] == 0
    assert lookup.delete(keys[:1], marks=[0]).result(timeout=5) == 1
    assert rank.exist(keys).result(timeout=5) == [False, True, True, True]
    lookup.close()
    rank.close()


def test_put_over_an_object_of_another_size_rewrites_it(gateway):
    keys = make_keys(2)
    c = GatewayClient(ClientConfig(port=gateway.port), "engine")
    for size, byte in ((4096, 1), (12288, 2)):
        def fill(b, size=size, byte=byte):
            for j in range(b.count):
                c.ring[b.offset + j * b.stride:b.offset + j * b.stride + size] = bytes([byte]) * size
        flags = c.put(keys, size, fill).result(timeout=10)
        assert flags == StoreResult([True, True], [False, False])
    out = []
    assert c.get(keys, 12288, lambda b: out.append(bytes(c.ring[b.offset:b.offset + 12288]))).result(timeout=10).hits \
        == [True, True]
    assert out[0] == bytes([2]) * 12288
    assert c.get(keys, 4096, lambda b: None).result(timeout=10).hits == [False, False]
    c.close()


def test_calls_after_close_resolve_at_once(gateway):
    c = GatewayClient(ClientConfig(port=gateway.port), "engine")
    c.close()
    assert c.exist(make_keys(2)).result(timeout=1) == [False, False]
    assert c.get(make_keys(2), 4096, lambda b: None).result(timeout=1).hits == [False, False]
    assert c.put(make_keys(2), 4096, lambda b: None).result(timeout=1) == StoreResult.none(2)


def test_collective_mismatch_and_a_rank_leaving_mid_collective(gateway):
    a, b = RawPeer(gateway.port), RawPeer(gateway.port)
    assert a.send(op="HELLO", engine="tp2", rank=0, world=2)["op"] == "OK"
    assert b.send(op="HELLO", engine="tp2", rank=1, world=2)["op"] == "OK"
    k1, k2 = make_keys(2), make_keys(2, salt=b"other")
    a.sock.send(msgpack.packb({"v": 1, "op": "GET", "id": 1, "keys": k1, "obj": 4096, "tag": "x"}))
    reply = b.send(op="GET", id=2, keys=k2, obj=4096, tag="x")
    assert reply["code"] == P.COLLECTIVE_MISMATCH
    assert a.sock.poll(3000) and msgpack.unpackb(a.sock.recv())["code"] == P.COLLECTIVE_MISMATCH
    a.sock.send(msgpack.packb({"v": 1, "op": "GET", "id": 3, "keys": k1, "obj": 4096, "tag": "y"}))
    # the gateway serves one connection's messages in order: PING's answer means GET was taken
    assert a.send(op="PING", id=4)["id"] == 4
    assert b.send(op="BYE")["op"] == "OK"
    assert a.sock.poll(3000), "the waiting rank must be told, not left hanging"
    reply = msgpack.unpackb(a.sock.recv())
    assert reply["code"] == P.COLLECTIVE_MISMATCH and "left" in reply["msg"]
    a.close()
    b.close()


def test_a_rank_dying_mid_transfer_frees_the_ring(start_gateway):
    gw = start_gateway(engine_timeout_s=2)
    stuck = subprocess.Popen([sys.executable, "-c", f"""
import time
from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
c = GatewayClient(ClientConfig(port={gw.port}, timeout_s=600), "dies")
keys = KeyBuilder("n").keys([b"k%d" % i for i in range(4)])
def hang(b):
    print("filling", flush=True)
    time.sleep(600)
c.put(keys, 1 << 20, hang)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    assert stuck.stdout.readline().strip() == "filling"
    assert control.request(gw.port, {"op": "STATS"})["stats"]["ring_in_use"] > 0
    stuck.kill()
    stuck.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = control.request(gw.port, {"op": "STATS"})["stats"]
        if s["ring_in_use"] == 0 and s["engine"] is None:
            break
        time.sleep(0.2)
    assert s["ring_in_use"] == 0 and s["requests_in_flight"] == 0 and s["engine"] is None
    assert s["objects"].get("stored", 0) == 0, "a batch that was never filled must not be stored"
    (_, stored, _, _), = run_ranks(gw.port, 1, "PUT", make_keys(3), 4096, engine="next")
    assert all(stored)


@pytest.mark.security
def test_a_second_gateway_on_a_busy_port_refuses_and_touches_nothing(start_gateway, tmp_path):
    """Before the door, the second gateway replaced the first one's ring file on its way to
    'Address already in use': engines attaching then stored zeros with valid checksums."""
    gw = start_gateway()
    keys = make_keys(6)
    early = GatewayClient(ClientConfig(port=gw.port), "engine")
    assert early.enabled
    second = subprocess.run([sys.executable, "-m", "adpkv_gateway.loop.main", "--storage-devices",
                             str(tmp_path / "another-card"), "--port", str(gw.port)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 2
    assert "another gateway is running on this port" in second.stderr + second.stdout
    assert gw.alive()
    late = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=0), "engine", rank=None)
    assert late.enabled

    def fill(b):
        for j in range(b.count):
            early.ring[b.offset + j * b.stride:b.offset + j * b.stride + 8192] = pattern(keys[b.first + j], 0, 8192)
    assert early.put(keys, 8192, fill).result(timeout=10).stored == [True] * 6
    late.close()
    early.close()
    gw.restart()
    (_, hits, exact, _), = run_ranks(gw.port, 1, "GET", keys, 8192, engine="after")
    assert all(hits) and exact is True


def test_a_dead_gateways_door_is_reclaimed(start_gateway, tmp_path):
    gw = start_gateway()
    door = gateway_door(gw.port)
    gw.proc.kill()                      # a crash: its door and lock files stay behind
    gw.proc.wait()
    gw.proc = None
    assert os.path.exists(door)
    gw.start()
    assert GatewayClient(ClientConfig(port=gw.port), "engine").enabled


def test_a_ring_of_the_wrong_size_turns_the_cache_off(tmp_path):
    """A client that gets a ring other than announced turns the cache off on its rank
    (before: ValueError out of GatewayClient). The door and the control port here are the
    test's own (the door hands out a memfd one page short after an answered HELLO); no
    gateway could be made to do that."""
    import socket
    import threading
    from adpkv_core.wire import door as D
    path = str(tmp_path / "door.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve():
        conn, _ = listener.accept()
        D.recv(conn)
        D.send(conn, P.SessionOk(token=b"t" * 16))
        ident, frame = router.recv_multipart()          # HELLO
        router.send_multipart([ident, P.encode(P.Ok(id=P.request_id(frame)))])
        D.recv(conn)                                    # RING
        fd = os.memfd_create("short", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 20)
        D.send(conn, P.RingOk(size=(1 << 20) + 4096), [fd])
        os.close(fd)
        conn.recv(1)                   # until the client closes
        conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = GatewayClient(ClientConfig(port=port, socket=path, connect_timeout_s=2.0), "engine")
    assert not client.enabled
    assert client.get(make_keys(2), 4096, lambda b: None).result(timeout=1).hits == [False, False]
    client.close()
    t.join(5)
    listener.close()
    router.close(0)


def test_a_request_of_no_keys_is_answered(gateway):
    """Found by the fuzzer: a GET/PUT with an empty key list was never answered (the job had
    no batch whose retirement would finish it); the rank waited for timeout_s. Now it is
    refused at once (the client never sends one)."""
    peer = RawPeer(gateway.port)
    assert peer.send(op="HELLO", engine="e", rank=0, world=1)["op"] == "OK"
    for op in ("PUT", "GET"):
        reply = peer.send(op=op, id=11, keys=[], obj=100)
        assert reply["code"] == P.BAD_MESSAGE and reply["id"] == 11
    peer.close()


def test_stats_reply_is_typed_and_the_wire_keeps_its_map(gateway):
    """STATS through the client is a ``GatewayStats`` (typed cards, engine, tenants); the same
    reply read as a plain map (what ``adpkv status --json`` prints) keeps the keys it had, and
    an fs card carries no cluster field."""
    keys = make_keys(3)
    rank = GatewayClient(ClientConfig(port=gateway.port), "engine-stats", rank=0, world_size=1)
    try:
        assert rank.put(keys, 4096, lambda b: None).result(timeout=10).stored == [True] * 3
        stats = rank.stats().result(timeout=10)
        assert isinstance(stats, P.GatewayStats)
        assert stats.engine is not None and stats.engine.id == "engine-stats" and stats.engine.ranks == [0]
        card = stats.cards[0]
        assert isinstance(card, P.CardFigures) and card.kind == "fs" and card.path and card.active
        assert card.objects >= 3 and card.cluster_state is None and card.cluster_nodes is None
        assert stats.objects.get("stored") == 3
        assert [t.objects for t in stats.tenants] == [3]
        raw = control.request(gateway.port, {"op": "STATS"})["stats"]
        assert P.gateway_stats(raw) == P.gateway_stats(raw)            # reads the plain map too
        assert {"path", "used_bytes", "serial"} <= set(raw["cards"][0]) and "cluster_state" not in raw["cards"][0]
        assert raw["engine"]["id"] == "engine-stats" and "layout_change" in raw and raw["layout_change"] is None
    finally:
        rank.close()
    assert rank.stats().result(timeout=1) is None, "a closed client answers STATS with None"


def test_a_stats_reply_that_is_not_one_is_a_protocol_error():
    """What ``adpkv status`` and the doctor read from a plain map: a STATS reply lacking a
    field is a clear BAD_MESSAGE, never a KeyError somewhere later."""
    import pytest
    with pytest.raises(P.ProtocolError) as err:
        P.gateway_stats({"port": 1})
    assert err.value.code == P.BAD_MESSAGE
