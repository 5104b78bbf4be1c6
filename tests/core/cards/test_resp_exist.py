"""EXIST on the resp and cluster cards (issue 26, item 5): a batch of 16k heads is looked up
in one round trip per server (``Card.heads_holding``: a GETRANGE of each header and its
STRLEN, one pipeline per server / per cluster node), with exactly the answers of the two
calls it replaces key by key (``heads`` then ``contains_many``); a cluster node that dies
in the middle costs its own keys only; a batch EXIST through a real gateway answers what the
objects are (whole, absent, partly written); and a card's usage leaves its own keys out.

Everything runs on real redis-server processes. Round trips are counted on the card's real
sockets (``Turns`` wraps each: a send after a receive starts a round trip)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.base import Card
from adpkv_gateway.cards.resp.cluster_map import key_slot
from adpkv_gateway.cards.resp.card import RespCard
from adpkv_gateway.cards.resp.conn import RespConnection
from adpkv_gateway.cards.resp.cluster import ClusterCard
from adpkv_gateway.cards.fragments import fragment_key


N = 16384
PAYLOAD = 256


class Turns:
    """A real socket that counts round trips: a send after a receive (or the first send)
    starts one."""

    def __init__(self, sock):
        self.sock, self.turns, self._sending = sock, 0, False

    def _send(self):
        if not self._sending:
            self.turns += 1
            self._sending = True

    def sendall(self, data):
        self._send()
        return self.sock.sendall(data)

    def sendmsg(self, buffers):
        self._send()
        return self.sock.sendmsg(buffers)

    def recv(self, n):
        self._sending = False
        return self.sock.recv(n)

    def recv_into(self, buf, n=0):
        self._sending = False
        return self.sock.recv_into(buf, n)

    def close(self):
        self.sock.close()


def head_keys(n: int, seed: bytes = b"h") -> list[bytes]:
    return [fragment_key(hashlib.sha256(seed + b"%d" % i).digest()[:28], 0) for i in range(n)]


def value(fkey: bytes, payload_len: int, object_bytes: int) -> bytes:
    """A head fragment's value as a card stores it (the 96-byte header, then the payload)."""
    payload = hashlib.sha256(fkey).digest() * (payload_len // 32 + 1)
    header = bytearray(objfmt.HEADER_CORE)
    objfmt.fill_header(header, fkey, payload[:payload_len], object_bytes, write_id=7)
    return bytes(header) + payload[:payload_len]


def plant_mix(set_value, fkeys: list[bytes]) -> dict[bytes, bool]:
    """Heads of every kind on a card (``set_value(fkey, bytes)`` stores one): whole, absent,
    truncated (a write cut short), of another size, a damaged header, another key's head.
    Which of them hold ``PAYLOAD`` bytes of their own head."""
    whole = {}
    for i, k in enumerate(fkeys):
        kind = i % 8
        if kind in (0, 1, 2):
            set_value(k, value(k, PAYLOAD, PAYLOAD))
        elif kind == 3:
            set_value(k, value(k, PAYLOAD, PAYLOAD)[:objfmt.HEADER_CORE + PAYLOAD // 2])
        elif kind == 4:
            set_value(k, value(k, 2 * PAYLOAD, 2 * PAYLOAD))
        elif kind == 5:
            set_value(k, b"\0" * 8 + value(k, PAYLOAD, PAYLOAD)[8:])
        elif kind == 6:
            set_value(k, value(fkeys[i - 1], PAYLOAD, PAYLOAD))
        whole[k] = kind in (0, 1, 2)        # kind 7: absent
    return whole


def payload_len(head):
    return PAYLOAD


def one_by_one(card: Card, items, tags=None) -> list:
    """What ``heads`` then ``contains_many`` answer key by key (the base class's way)."""
    out = []
    for i, item in enumerate(items):
        tag = [tags[i]] if tags else None
        head, = card.heads([item], tag)
        held = head is not None and card.contains_many([item], [payload_len(head)], tag)[0]
        out.append(head if held else None)
    return out


def test_resp_card_looks_16k_heads_up_in_one_round_trip(redis_servers):
    server, = redis_servers(1)
    card = RespCard(server.url)
    card.open()
    raw = RespConnection(server.url, 30)
    fkeys = head_keys(N)
    whole = plant_mix(lambda k, v: raw.command(b"SET", RespCard._key(0, k), v), fkeys)
    items = [(0, k) for k in fkeys]
    conn = card._conn()
    conn.sock = turns = Turns(conn.sock)

    got = card.heads_holding(items, payload_len)
    assert turns.turns == 1, f"{turns.turns} round trips for one lookup of {N} heads"
    assert [h is not None for h in got] == [whole[k] for k in fkeys]
    assert sum(h is not None for h in got) == 3 * N // 8
    assert all(h.size == PAYLOAD and h.write_id == 7 for h in got if h is not None)
    assert got == one_by_one(card, items)
    # the base class's way for the same batch: two round trips
    turns.turns = 0
    assert Card.heads_holding(card, items, payload_len) == got
    assert turns.turns == 2
    card.close()
    raw.close()


def cluster_card(cluster) -> tuple[ClusterCard, dict]:
    """A cluster card whose node connections count their round trips (by node port)."""
    card = ClusterCard(cluster.url, io_timeout_s=20)
    counters: dict[int, Turns] = {}
    connect = card._connect

    def counted(addr, timeout):
        conn = connect(addr, timeout)
        conn.sock = counters[addr[1]] = Turns(conn.sock)
        return conn
    card._connect = counted
    card.open()
    return card, counters


def test_cluster_card_looks_16k_heads_up_in_one_round_trip_per_node(redis_cluster):
    cluster = redis_cluster(primaries=3, replicas=0)
    card, counters = cluster_card(cluster)
    fkeys = head_keys(N)
    tags = [b"dialog%d" % (i % 512) for i in range(N)]          # 512 dialogs over the slots
    items = [(0, k) for k in fkeys]

    def set_value(fkey, data, tag_of={k: t for k, t in zip(fkeys, tags)}):
        key = ClusterCard._key(0, fkey, tag_of[fkey])
        card._run(key, lambda c: c.command(b"SET", key, data))
    whole = plant_mix(set_value, fkeys)
    for t in counters.values():
        t.turns = 0

    got = card.heads_holding(items, payload_len, tags)
    nodes = {card.map.primary(key_slot(ClusterCard._key(0, k, t))) for k, t in zip(fkeys, tags)}
    assert len(nodes) == 3, "the heads are spread over every primary"
    assert {port: t.turns for port, t in counters.items() if t.turns} == {port: 1 for _, port in nodes}
    assert [h is not None for h in got] == [whole[k] for k in fkeys]
    assert sum(h is not None for h in got) == 3 * N // 8
    assert got == one_by_one(card, items, tags)
    card.close()


def recv_queue(port: int) -> int:
    """Bytes waiting unread on the server side of connections to ``port`` (ss -tn)."""
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, timeout=10).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.split())


def test_a_node_that_dies_mid_lookup_costs_only_its_own_keys(redis_cluster):
    cluster = redis_cluster(primaries=3, replicas=0)
    card, _ = cluster_card(cluster)
    fkeys = head_keys(4096, b"d")
    items = [(0, k) for k in fkeys]
    for k in fkeys:
        key = ClusterCard._key(0, k)
        card._run(key, lambda c, key=key, k=k: c.command(b"SET", key, value(k, PAYLOAD, PAYLOAD)))
    assert all(card.heads_holding(items, payload_len))         # every node connected, every head there
    node_of = [card.map.primary(key_slot(ClusterCard._key(0, k))) for k in fkeys]
    victim = cluster.primaries()[0]
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        result: list = []
        t = threading.Thread(target=lambda: result.append(card.heads_holding(items, payload_len)))
        t.start()
        deadline = time.monotonic() + 20
        while recv_queue(victim.port) == 0:                     # the lookup reached the stopped node
            assert time.monotonic() < deadline, "the lookup never reached the stopped node"
            time.sleep(0.01)
        assert t.is_alive()
        victim.kill()                                           # SIGKILL: its connections reset
        t.join(30)
        assert not t.is_alive()
    finally:
        if victim.proc is not None:
            victim.kill()
    got, = result
    mine = [a[1] == victim.port for a in node_of]
    assert 0 < sum(mine) < len(fkeys)
    assert [h is None for h in got] == mine, "misses exactly for the dead node's keys"
    assert all(h == (PAYLOAD, 7) for h, m in zip(got, mine) if not m)
    card.close()


def put_objects(client: GatewayClient, keys, size: int) -> None:
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + size] = hashlib.sha256(keys[b.first + j]).digest() * (size // 32)
    for i in range(0, len(keys), 1024):
        assert all(client.put(keys[i:i + 1024], size, fill).result(timeout=120).stored)


def server_keys(raw: RespConnection) -> list[bytes]:
    cursor, out = b"0", []
    while True:
        cursor, keys = raw.command(b"SCAN", cursor, b"MATCH", b"adpkv:[0-9]*", b"COUNT", b"1000")
        out += keys
        if cursor == b"0":
            return out


def test_exist_of_16k_keys_through_a_gateway_answers_what_each_object_is(redis_servers, start_gateway):
    """Objects of 3 fragments: whole, never stored, and partly written (a fragment other
    than the head, or the head, gone from the server): the batch EXIST answers exactly what
    the server holds, and the same as EXIST of one key at a time."""
    server, = redis_servers(1)
    gw = start_gateway(card_dirs=[server.url], storage_backend="resp", fragment_size=1024)
    c = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=5, timeout_s=120), "exist")
    assert c.enabled, c.attach_error
    kb = KeyBuilder("exist16k")
    keys = kb.keys([hashlib.sha256(b"%d" % i).digest() for i in range(N)], [0])
    stored = keys[:3 * N // 4]
    put_objects(c, stored, 3 * 1024)
    raw = RespConnection(server.url, 30)
    by_object: dict[bytes, list[bytes]] = {}
    for k in server_keys(raw):
        by_object.setdefault(k.split(b":", 2)[2][:-2], []).append(k)
    assert len(by_object) == len(stored) and all(len(v) == 3 for v in by_object.values())
    expected = {}
    for i, key in enumerate(keys):
        frags = sorted(by_object.get(key, []), key=lambda k: k[-2:])
        if i % 4 == 1 and frags:
            raw.command(b"DEL", frags[2])          # the last fragment: the head still says whole
        elif i % 4 == 2 and frags:
            raw.command(b"DEL", frags[0])          # the head
        expected[key] = bool(frags) and i % 4 in (0, 3)
    hits = c.exist(keys).result(timeout=120)
    assert hits == [expected[k] for k in keys]
    assert sum(hits) == 3 * N // 8
    sample = keys[::61]
    assert [c.exist([k]).result(timeout=30)[0] for k in sample] == [expected[k] for k in sample]
    c.close()
    raw.close()


def card_objects(port: int) -> int:
    cards = control.request(port, {"op": "STATS"})["stats"]["cards"]
    assert len(cards) == 1
    return cards[0]["objects"]


@pytest.mark.parametrize("kind", ["resp", "cluster"])
def test_usage_leaves_the_cards_own_keys_out(kind, redis_servers, redis_cluster, start_gateway):
    """The serial, the layout record and the namespace claims are keys of the card, not
    objects: a card holding 100 objects counts 100."""
    url = redis_servers(1)[0].url if kind == "resp" else redis_cluster(primaries=3, replicas=0).url
    gw = start_gateway(card_dirs=[url], storage_backend="resp")
    c = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=5, timeout_s=60), "usage")
    assert c.enabled, c.attach_error
    keys = KeyBuilder("usage").keys([hashlib.sha256(b"%d" % i).digest() for i in range(100)], [0])
    put_objects(c, keys, 4096)
    assert card_objects(gw.port) == 100
    c.close()
