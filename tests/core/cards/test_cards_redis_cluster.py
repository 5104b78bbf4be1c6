"""The cluster card (issue 18): one card that is a whole Redis Cluster
(``redis+cluster://host:port,...``), tested against a real cluster of redis-server
processes (3 primaries + 3 replicas, cluster-node-timeout 1 s, created by
``redis-cli --cluster create``) through real gateways: byte-exact store and restore,
a restarted gateway, kill -9 of a primary during reads and writes (the replica's
promotion is picked up without a restart), live resharding to a 4th primary, and two
gateways sharing the cluster. Every wait polls with a deadline."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from adpkv_core.affinity import dialog_marks
from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards.base import Read
from adpkv_gateway.cards.resp.cluster_map import key_slot

from ..rankproc import pattern

OBJ = 64 * 1024
FRAG = 16 * 1024          # 4 fragments per object, all in the object's slot


class Workload:
    """Dialogs keyed as an engine would; every object's bytes follow from its key, so any
    byte restored can be checked."""

    def __init__(self, namespace: str, n: int = 30, chunks: int = 2, layers: int = 2, seed: str = "d"):
        kb = KeyBuilder(namespace)
        self.dialogs = []
        for d in range(n):
            hashes, parent = [], b""
            for c in range(chunks):
                parent = hashlib.sha256(parent + f"{seed}{d}/{c}".encode()).digest()
                hashes.append(parent)
            self.dialogs.append((kb.keys(hashes, range(layers)), dialog_marks(hashes, 1) * layers))

    @property
    def objects(self) -> int:
        return sum(len(k) for k, _ in self.dialogs)

    def store(self, client: GatewayClient) -> int:
        stored = 0
        for keys, marks in self.dialogs:
            def fill(b, keys=keys):
                for j in range(b.count):
                    o = b.offset + j * b.stride
                    client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
            r = client.put(keys, OBJ, fill, marks=marks).result(timeout=60)
            stored += sum(r.stored)
        return stored

    def restore(self, client: GatewayClient) -> tuple[int, int]:
        """(hits, wrong objects) over all objects."""
        hits = wrong = 0
        for keys, marks in self.dialogs:
            bad = []

            def check(b, keys=keys):
                for j in range(b.count):
                    if b.hits[j]:
                        o = b.offset + j * b.stride
                        if bytes(client.ring[o:o + OBJ]) != pattern(keys[b.first + j], 0, OBJ):
                            bad.append(j)
            hits += sum(client.get(keys, OBJ, check, marks=marks).result(timeout=60).hits)
            wrong += len(bad)
        return hits, wrong


def client(port: int, engine: str) -> GatewayClient:
    c = GatewayClient(ClientConfig(port=port, busy_wait_s=5, timeout_s=60), engine)
    assert c.enabled, c.attach_error
    return c


def stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


def poll(pred, timeout, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def cluster_gateway(start_gateway, cluster, **kw):
    kw.setdefault("fragment_size", FRAG)
    return start_gateway(card_dirs=[cluster.url], storage_backend="resp", **kw)


def test_cluster_urls_and_key_slots(monkeypatch, tmp_path):
    from adpkv_gateway.cards.base import CardError
    from adpkv_gateway.cards.resp.cluster_map import parse_cluster_url
    assert parse_cluster_url("redis+cluster://a:7000,b:7001") == ([("a", 7000), ("b", 7001)], None)
    assert parse_cluster_url("redis+cluster://:p%40ss@a:7000,b") == ([("a", 7000), ("b", 6379)], "p@ss")
    monkeypatch.setenv("ADPKV_RESP_PASSWORD", "from-env")
    assert parse_cluster_url("redis+cluster://a:1")[1] == "from-env"
    monkeypatch.delenv("ADPKV_RESP_PASSWORD")
    (tmp_path / "pw").write_text("from-file\n")
    monkeypatch.setenv("ADPKV_RESP_PASSWORD_FILE", str(tmp_path / "pw"))
    assert parse_cluster_url("redis+cluster://a:1")[1] == "from-file"
    for bad in ("rediss+cluster://a:1", "redis+cluster://", "redis+cluster://a:b"):
        with pytest.raises(CardError):
            parse_cluster_url(bad)
    # the slots Redis documents: CRC16/XMODEM of the hash tag, or of the whole key
    assert key_slot(b"foo") == 12182 and key_slot(b"123456789") == 0x31C3
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers") == key_slot(b"user1000")
    import binascii
    assert key_slot(b"foo{}{bar}") == binascii.crc_hqx(b"foo{}{bar}", 0) % 16384     # empty tag: whole key
    assert key_slot(b"foo{{bar}}zap") == key_slot(b"{bar")                          # first { to the next }


def test_store_restore_byte_exact_and_a_restarted_gateway_finds_everything(redis_cluster, start_gateway, tmp_path):
    cluster = redis_cluster()
    status = tmp_path / "status.prom"
    gw = cluster_gateway(start_gateway, cluster, status_file=str(status))
    w = Workload("m", n=30)
    c = client(gw.port, "e1")
    assert w.store(c) == w.objects
    assert w.restore(c) == (w.objects, 0)
    c.close()
    # every fragment of one object in one slot; objects spread over every primary
    card = stats(gw.port)["cards"][0]
    assert card["kind"] == "resp-cluster" and card["active"]
    assert card["cluster_state"] == "ok"
    roles = sorted(n["role"] for n in card["cluster_nodes"])
    assert roles == ["primary"] * 3 + ["replica"] * 3, card["cluster_nodes"]
    assert all(p.dbsize() > 0 for p in cluster.primaries()), "objects must spread over every primary"
    from adpkv_gateway.cards.resp.cluster import ClusterCard
    from adpkv_gateway.cards.fragments import fragment_key
    key = w.dialogs[0][0][0]
    assert len({key_slot(ClusterCard._key(i, fragment_key(key, i))) for i in range(4)}) == 1
    k0 = ClusterCard._key(0, fragment_key(key, 0))
    assert int(cluster.primaries()[0].command(b"CLUSTER", b"KEYSLOT", k0)) == key_slot(k0)
    assert poll(lambda: status.exists() and 'adpkv_gateway_cluster_state_ok' in status.read_text(), 10)
    text = status.read_text()
    assert f'adpkv_gateway_cluster_state_ok{{group="{card["serial"]}"}} 1' in text
    assert text.count("adpkv_gateway_cluster_node_up{") == 6
    # a restarted gateway finds everything (the serial lives in the cluster)
    gw.stop()
    gw2 = cluster_gateway(start_gateway, cluster)
    assert stats(gw2.port)["cards"][0]["serial"] == card["serial"]
    c = client(gw2.port, "e2")
    assert w.restore(c) == (w.objects, 0)
    assert Workload("other").restore(c)[0] == 0, "another namespace must not hit"
    c.close()


class Traffic(threading.Thread):
    """One engine that keeps storing new dialogs and restoring ``old`` until stopped:
    records (time, hits of old, wrong objects) per round and PUT results."""

    def __init__(self, port: int, old: Workload):
        super().__init__(daemon=True)
        self.port, self.old = port, old
        self.rounds: list[tuple[float, int, int]] = []
        self.stored = self.offered = 0
        self.stop_ev = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        try:
            c = client(self.port, "traffic")
            i = 0
            while not self.stop_ev.is_set():
                fresh = Workload("m", n=2, seed=f"t{i}")
                self.stored += fresh.store(c)
                self.offered += fresh.objects
                t = time.monotonic()          # a round is dated by the start of its restore
                hits, wrong = self.old.restore(c)
                self.rounds.append((t, hits, wrong))
                i += 1
            c.close()
        except BaseException as exc:      # reported by the test
            self.error = exc

    def finish(self):
        self.stop_ev.set()
        self.join(timeout=120)
        assert not self.is_alive(), "traffic did not stop"
        assert self.error is None, repr(self.error)
        assert sum(r[2] for r in self.rounds) == 0, "wrong bytes were restored"

    def wait_rounds(self, n: int, timeout: float) -> bool:
        start = len(self.rounds)
        return bool(poll(lambda: len(self.rounds) >= start + n or self.error is not None, timeout, 0.05))


def test_kill_9_of_a_primary_during_reads_and_writes(redis_cluster, start_gateway):
    cluster = redis_cluster()
    # WAIT 1 after every object: what a PUT reported stored is on a replica, so it must
    # survive the primary's death
    gw = cluster_gateway(start_gateway, cluster, resp_wait_ms=300, io_timeout_ms=2000)
    old = Workload("m", n=30)
    c = client(gw.port, "loader")
    assert old.store(c) == old.objects
    c.close()
    victim = max(cluster.primaries(), key=lambda n: n.dbsize())
    assert victim.dbsize() > 0
    heir, = cluster.replica_of(victim)
    traffic = Traffic(gw.port, old)
    traffic.start()
    assert traffic.wait_rounds(2, 60)
    killed_at = time.monotonic()
    victim.kill()
    # the replica is promoted by the cluster (cluster-node-timeout 1 s) ...
    assert poll(lambda: heir.role() == "master", 30), "the replica was not promoted"
    promoted_at = time.monotonic()
    # ... and the gateway, not restarted, hits every object again
    back = poll(lambda: next((t for t, h, _ in traffic.rounds if t > killed_at and h == old.objects), None), 30, 0.05)
    assert back, f"objects did not come back after the promotion: {traffic.rounds[-5:]}"
    assert traffic.wait_rounds(2, 60)
    traffic.finish()
    after = [(t, h) for t, h, _ in traffic.rounds if t > killed_at]
    during = [h for t, h in after if t < back]
    window = back - killed_at
    print(f"\nfailover window seen by the engine: {window:.2f} s (promotion after "
          f"{promoted_at - killed_at:.2f} s); hits per round in the window {during} of {old.objects}")
    # a dead primary costs only its slots: the rounds in the window still hit elsewhere
    assert all(h > 0 for h in during), during
    assert all(h == old.objects for t, h in after if t >= back), "hits must stay whole after the failover"
    card = stats(gw.port)["cards"][0]
    assert card["active"], "one node down must not take the card out of service"
    assert card["cluster_counters"]["node_errors"] > 0
    assert traffic.stored > 0
    c = client(gw.port, "after")
    assert old.restore(c) == (old.objects, 0)
    fresh = Workload("m", n=10, seed="after")
    fresh_stored = fresh.store(c)
    c.close()
    print(f"after the failover: {fresh_stored} of {fresh.objects} new objects stored with resp_wait_ms "
          f"(the promoted primary has no replica left: WAIT 1 cannot be met on its slots)")
    assert 0 < fresh_stored < fresh.objects, "resp_wait_ms: a shard without a replica must store nothing"
    assert stats(gw.port)["cards"][0]["cluster_counters"]["wait_short"] > 0
    assert "does not answer" in gw.log()


def test_live_resharding_to_a_fourth_primary_during_reads_and_writes(redis_cluster, start_gateway):
    cluster = redis_cluster()
    gw = cluster_gateway(start_gateway, cluster)
    old = Workload("m", n=60)
    c = client(gw.port, "loader")
    assert old.store(c) == old.objects
    c.close()
    traffic = Traffic(gw.port, old)
    traffic.start()
    assert traffic.wait_rounds(1, 60)
    started = time.monotonic()
    new = cluster.add_primary_and_rebalance()        # MIGRATE of about a quarter of the slots, live
    done = time.monotonic()
    assert traffic.wait_rounds(2, 60)
    traffic.finish()
    assert new.dbsize() > 0, "the resharding moved no key to the new primary"
    resharding_rounds = [h for t, h, _ in traffic.rounds if started <= t <= done + 0.01]
    print(f"\nresharding took {done - started:.1f} s; {len(resharding_rounds)} restore rounds during it, "
          f"hits {resharding_rounds} of {old.objects}")
    assert all(h == old.objects for _, h, _ in traffic.rounds), "every restore must hit through the resharding"
    assert traffic.stored == traffic.offered, "every PUT through the resharding must be stored"
    counters = stats(gw.port)["cards"][0]["cluster_counters"]
    assert counters["moved"] + counters["ask"] > 0, counters
    c = client(gw.port, "after")
    assert old.restore(c) == (old.objects, 0)
    c.close()
    assert sorted(n["role"] for n in stats(gw.port)["cards"][0]["cluster_nodes"]).count("primary") == 4


def test_two_gateways_share_one_cluster(redis_cluster, start_gateway):
    cluster = redis_cluster()
    seeds = cluster.url[len("redis+cluster://"):].split(",")
    gw1 = cluster_gateway(start_gateway, cluster, shared_storage=True)
    gw2 = start_gateway(card_dirs=["redis+cluster://" + ",".join(reversed(seeds))], storage_backend="resp",
                        fragment_size=FRAG, shared_storage=True)
    s1, s2 = stats(gw1.port), stats(gw2.port)
    assert s1["fingerprint"] == s2["fingerprint"] and s1["cards"][0]["serial"] == s2["cards"][0]["serial"]
    w = Workload("shared", n=20)
    c = client(gw1.port, "pod1")
    assert w.store(c) == w.objects
    c.close()
    c = client(gw2.port, "pod2")
    assert w.restore(c) == (w.objects, 0)
    c.close()
    assert control.request(gw2.port, {"op": "CLEAN"})["code"] == "CLEAN_REFUSED"


def stored_keys(cluster) -> dict[bytes, int]:
    """Every fragment key the cluster holds, with its slot as the cluster computes it
    (``CLUSTER KEYSLOT``), listed node by node."""
    out = {}
    for node in cluster.primaries():
        for k in node.command(b"KEYS", b"adpkv:{*", timeout=5) or []:
            out[k] = int(node.command(b"CLUSTER", b"KEYSLOT", k))
    return out


def object_of(cluster_key: bytes) -> bytes:
    """The object key in ``adpkv:{<16 hex>}:<db>:<fragment key>``."""
    return cluster_key[len(b"adpkv:{") + 16 + len(b"}:000:"):][:-2]


@pytest.mark.parametrize("placement", ["dialog", "stripe"])
def test_hash_tags_follow_key_placement(redis_cluster, start_gateway, placement):
    """dialog: every object of a dialog in one slot (the hash tag from the dialog mark);
    stripe: a dialog's objects over several slots, each object's fragments in one. Both
    restore byte-exact, EXIST finds, DELETE removes every fragment."""
    cluster = redis_cluster()
    gw = cluster_gateway(start_gateway, cluster, key_placement=placement)
    w = Workload("tags", n=8, chunks=2, layers=2)
    c = client(gw.port, "e")
    assert w.store(c) == w.objects
    assert w.restore(c) == (w.objects, 0)
    keys = stored_keys(cluster)
    assert len(keys) == w.objects * OBJ // FRAG
    slots_of: dict[bytes, set] = {}
    for k, slot in keys.items():
        assert slot == key_slot(k)
        slots_of.setdefault(object_of(k), set()).add(slot)
    assert all(len(s) == 1 for s in slots_of.values()), "an object's fragments must share one slot"
    dialog_slots = [set().union(*(slots_of[k] for k in dkeys)) for dkeys, _ in w.dialogs]
    if placement == "dialog":
        assert all(len(s) == 1 for s in dialog_slots), dialog_slots
        assert len(set().union(*dialog_slots)) > 1, "dialogs must spread over slots"
    else:
        assert all(len(s) > 1 for s in dialog_slots), dialog_slots
    for dkeys, marks in w.dialogs[:2]:
        assert [bool(x) for x in c.exist(dkeys, marks=marks).result(timeout=30)] == [True] * len(dkeys)
    dkeys, marks = w.dialogs[0]
    assert c.delete(dkeys, marks=marks).result(timeout=30) == len(dkeys)
    assert len(stored_keys(cluster)) == len(keys) - len(dkeys) * OBJ // FRAG
    hits, wrong = w.restore(c)
    assert (hits, wrong) == (w.objects - len(dkeys), 0)
    c.close()


def test_batched_reads_check_every_fragment_and_follow_redirections(redis_cluster):
    """ClusterCard.read_many: one pipeline per node; a corrupt or missing value is a miss,
    a GET sent to the wrong node (a stale slot map: MOVED) still reads the right bytes."""
    from adpkv_gateway.cards.resp.cluster import ClusterCard
    from adpkv_gateway.cards.fragments import fragment_key
    cluster = redis_cluster()
    card = ClusterCard(cluster.url)
    card.open()
    try:
        objs = [hashlib.sha256(b"o%d" % i).digest()[:28] for i in range(12)]
        tags = [b"", b"", b"", b"dialog-1"] * 3
        frags = [(fragment_key(o, f), t) for o, t in zip(objs, tags) for f in range(2)]
        for fk, t in frags:
            assert card.write(0, fk, memoryview(pattern(fk, 0, FRAG)), FRAG * 2, tag=t)
        assert len({key_slot(ClusterCard._key(0, fk, t)) for fk, t in frags if t}) == 1

        def read_all():
            bufs = [memoryview(bytearray(FRAG)) for _ in frags]
            got = card.read_many([(0, fk, b, t, None) for (fk, t), b in zip(frags, bufs)])
            return got, bufs
        got, bufs = read_all()
        assert got == [Read.HIT] * len(frags)
        assert all(bytes(b) == pattern(fk, 0, FRAG) for (fk, _), b in zip(frags, bufs))
        # the tag is part of the key: without it, the dialog's fragments are not found
        assert card.read_many([(0, fk, memoryview(bytearray(FRAG)), b"", None) for fk, t in frags if t]) == \
            [Read.ABSENT] * sum(1 for _, t in frags if t)
        # one byte flipped in a stored value, one value removed: misses, the rest served
        bad_key = ClusterCard._key(0, frags[1][0], frags[1][1])
        node = next(n for n in cluster.primaries() if n.command(b"EXISTS", bad_key) == 1)
        value = bytearray(node.command(b"GET", bad_key))
        value[-1] ^= 1
        assert node.command(b"SET", bad_key, bytes(value)) == b"OK"
        assert card.delete(0, frags[4][0], frags[4][1])
        got, bufs = read_all()
        assert [i for i, v in enumerate(got) if v is not Read.HIT] == [1, 4]
        assert got[1] is Read.BAD_CHECKSUM and got[4] is Read.ABSENT
        # a stale slot map: every slot points at one node; the others answer MOVED
        wrong = card.map.primary(key_slot(bad_key))
        card.map._slots = [wrong] * len(card.map._slots)
        moved = card.counters["moved"]
        got, bufs = read_all()
        assert [i for i, v in enumerate(got) if v is not Read.HIT] == [1, 4]
        assert card.counters["moved"] > moved
        assert all(bytes(b) == pattern(fk, 0, FRAG) for (fk, _), b, v in zip(frags, bufs, got) if v is Read.HIT)
    finally:
        card.close()


def test_a_corrupt_fragment_in_a_batched_read_removes_its_object(redis_cluster, start_gateway):
    """store.read_many through Card.read_many: a fragment that fails its checksum is a miss
    for its object (never wrong bytes) and the object is removed from the cluster, whole."""
    cluster = redis_cluster()
    gw = cluster_gateway(start_gateway, cluster)
    w = Workload("corrupt", n=4)
    c = client(gw.port, "e")
    assert w.store(c) == w.objects
    keys = stored_keys(cluster)
    victim_obj = w.dialogs[1][0][0]
    victim = next(k for k in keys if object_of(k) == victim_obj and not k.endswith(b"\0\0"))
    node = next(n for n in cluster.primaries() if n.command(b"EXISTS", victim) == 1)
    value = bytearray(node.command(b"GET", victim))
    value[len(value) // 2] ^= 0x40
    assert node.command(b"SET", victim, bytes(value)) == b"OK"
    assert w.restore(c) == (w.objects - 1, 0)
    left = stored_keys(cluster)
    assert not [k for k in left if object_of(k) == victim_obj], "the broken object must be removed whole"
    assert len(left) == len(keys) - OBJ // FRAG
    assert w.store(c) == w.objects       # stored again (the others exist already)
    assert w.restore(c) == (w.objects, 0)
    c.close()
