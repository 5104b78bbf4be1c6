"""Tenant quotas (``namespace_quotas``) with real gateway processes on real fs cards.

Two tenants (key namespaces) write and read at the same time through one gateway, as two
ranks of one engine: tenant ``a`` far past its quota, tenant ``b`` with none. ``a`` evicts
only its own objects (its own LRU); every object of ``b`` is still there with its bytes;
every hit of either is byte-checked while evictions run. Quotas and usage survive a
restart (index rebuild), and a quota lowered at a restart trims only its own namespace.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adpkv_core.client import GatewayClient
from adpkv_core.keys import namespace_id
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards.quotas import quotas_by_id
from adpkv_gateway.config import parse_quotas

from ..adversary import as_nobody
from ..rankproc import make_keys, pattern

OBJ = 64 * 1024
ON_DISK = OBJ + 4096                       # the fs card's 4 KiB header
QUOTA_OBJECTS = 24
QUOTA = QUOTA_OBJECTS * ON_DISK
A_ID, B_ID = namespace_id("tenant-a").hex(), namespace_id("tenant-b").hex()


def stats(port):
    return control.request(port, {"op": "STATS"}, timeout_s=10)["stats"]


def _client(port, engine, rank, world):
    return GatewayClient(ClientConfig(port=port, timeout_s=60.0, busy_wait_s=0), engine, rank=rank, world_size=world)


def _put(client, keys):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
    return client.put(keys, OBJ, fill).result().stored


def _get(client, keys, wrong: list):
    """Hits of ``keys``; any hit whose bytes differ from what was stored goes to ``wrong``."""
    def check(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride
                if bytes(client.ring[o:o + OBJ]) != pattern(keys[b.first + j], 0, OBJ):
                    wrong.append(keys[b.first + j].hex())
    return client.get(keys, OBJ, check).result().hits


WINDOW = 64


def _tenant(port, engine, rank, world, keys, rereads, out_q):
    """One rank writing its tenant's keys 8 at a time: it reads back the ``WINDOW`` keys
    before them (being evicted meanwhile: a miss or exact bytes), PUTs them, reads them.
    Then it reads all its keys ``rereads`` times. Every hit is byte-checked. Reports
    (rank, stored, hits of the just stored, wrong bytes)."""
    try:
        client = _client(port, engine, rank, world)
        wrong: list = []
        stored = newest_hits = 0
        for start in range(0, len(keys), 8):
            part = keys[start:start + 8]
            _get(client, keys[max(0, start - WINDOW):start], wrong)
            stored += sum(_put(client, part))
            newest_hits += sum(_get(client, part, wrong))
        for _ in range(rereads):
            _get(client, keys, wrong)
        out_q.put((rank, stored, newest_hits, wrong))
        client.close()
    except Exception:
        out_q.put((rank, None, None, traceback.format_exc()))


def _run_tenants(port, jobs, engine):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tenant, args=(port, engine, rank, len(jobs), keys, rereads, q))
             for rank, (keys, rereads) in enumerate(jobs)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r in results:
        assert r[1] is not None, r[3]
    return results


def _read_all(port, keys, engine):
    """Hits of ``keys`` read by a fresh engine, and the keys whose bytes were wrong."""
    client = _client(port, engine, 0, 1)
    wrong: list = []
    try:
        hits = _get(client, keys, wrong)
    finally:
        client.close()
    return hits, wrong


def _tenant_row(s, tid):
    rows = [t for t in s["tenants"] if t["id"] == tid]
    assert len(rows) == 1, f"namespace id {tid} is not in STATS' tenants: {s['tenants']}"
    return rows[0]


@pytest.mark.parametrize("fragment_size", [0, 16 * 1024], ids=["whole", "4-fragments"])
def test_a_tenant_over_its_quota_evicts_only_its_own_objects_under_load(start_gateway, fragment_size):
    on_disk = ON_DISK if not fragment_size else (OBJ // fragment_size) * (4096 + fragment_size)
    quota = QUOTA_OBJECTS * on_disk
    gw = start_gateway(namespace_quotas=f"tenant-a={quota}", capacity_bytes=64 << 20, thread_pool_size=4,
                       fragment_size=fragment_size)
    a_keys = make_keys(8 * QUOTA_OBJECTS, namespace="tenant-a")          # 8x its quota
    b_keys = make_keys(3 * QUOTA_OBJECTS, namespace="tenant-b")          # no quota; 3x a's quota
    (_, a_stored, a_newest, a_wrong), (_, b_stored, b_newest, b_wrong) = _run_tenants(
        gw.port, [(a_keys, 0), (b_keys, 6)], engine="two-tenants")
    assert not a_wrong and not b_wrong, "a hit returned other bytes than were stored"
    assert a_stored == len(a_keys), "a tenant over its quota still stores (evicting its own)"
    assert a_newest == len(a_keys), "what a tenant just stored must be readable at once"
    assert b_stored == len(b_keys)

    s = stats(gw.port)
    a, b = _tenant_row(s, A_ID), _tenant_row(s, B_ID)
    assert a["namespace"] == "tenant-a" and a["quota_bytes"] == quota
    assert a["used_bytes"] <= quota and a["objects"] <= QUOTA_OBJECTS
    assert a["evicted"] >= len(a_keys) - QUOTA_OBJECTS
    assert b["quota_bytes"] == 0 and b["evicted"] == 0
    assert b["objects"] == len(b_keys) and b["used_bytes"] == len(b_keys) * on_disk
    assert s["cards"][0]["used_bytes"] == a["used_bytes"] + b["used_bytes"]

    b_hits, b_wrong = _read_all(gw.port, b_keys, "reader-b")
    assert all(b_hits) and not b_wrong, "the tenant within bounds lost objects or bytes"
    a_hits, a_wrong = _read_all(gw.port, a_keys, "reader-a")
    assert not a_wrong
    assert sum(a_hits) == a["objects"] and sum(a_hits) <= QUOTA_OBJECTS
    assert all(a_hits[-8:]), "the tenant's most recently used objects must be the ones kept"
    assert not any(a_hits[:len(a_keys) - 8 - WINDOW]), "the tenant's least recently used objects must be gone"

    # survives a restart (kill -9: the index is rebuilt from the files), then a lower quota
    gw.restart(hard=True)
    s2 = stats(gw.port)
    assert _tenant_row(s2, A_ID)["used_bytes"] == a["used_bytes"]
    assert _tenant_row(s2, B_ID)["used_bytes"] == b["used_bytes"]
    a_after, wrong = _read_all(gw.port, a_keys, "reader-a2")
    assert a_after == a_hits and not wrong
    gw.settings["namespace_quotas"] = f"tenant-a={quota // 4}"
    gw.restart()
    s3 = stats(gw.port)
    assert _tenant_row(s3, A_ID)["used_bytes"] <= quota // 4
    assert _tenant_row(s3, B_ID)["used_bytes"] == b["used_bytes"]
    a_low, wrong = _read_all(gw.port, a_keys, "reader-a3")
    assert not wrong and 0 < sum(a_low) <= QUOTA_OBJECTS // 4
    # the index is rebuilt in the order the files were written: the last PUT's objects stay
    assert not any(a_low[:-8]), "a lowered quota keeps the most recently written objects"
    b_hits, b_wrong = _read_all(gw.port, b_keys, "reader-b2")
    assert all(b_hits) and not b_wrong


def test_a_tenant_whose_objects_are_pinned_is_refused_not_another_evicted(start_gateway):
    gw = start_gateway(namespace_quotas=f"tenant-a={4 * ON_DISK}")
    a_keys = make_keys(6, namespace="tenant-a")
    b_keys = make_keys(6, namespace="tenant-b")
    client = _client(gw.port, "pins", 0, 1)
    try:
        assert all(_put(client, b_keys))
        assert all(_put(client, a_keys[:4]))
        assert all(client.exist(a_keys[:4], lock=True).result())      # pinned: may not be evicted
        assert not any(_put(client, a_keys[4:])), "over its quota with all its objects pinned: not stored"
        wrong: list = []
        assert all(_get(client, a_keys[:4], wrong)) and all(_get(client, b_keys, wrong)) and not wrong
        client.unlock(a_keys[:4]).result()
        assert all(_put(client, a_keys[4:])), "unpinned, its own least recently used objects make room"
        hits = _get(client, a_keys, wrong)
        assert sum(hits[:4]) == 2 and all(hits[4:]) and not wrong
        assert all(_get(client, b_keys, wrong)) and not wrong
    finally:
        client.close()


def test_usage_lists_tenants_with_their_quotas(start_gateway, tmp_path):
    status = tmp_path / "adpkv.prom"
    gw = start_gateway(namespace_quotas=f"tenant-a={QUOTA},id:{'00' * 8}=4096", status_file=str(status))
    client = _client(gw.port, "usage", 0, 1)
    try:
        assert all(_put(client, make_keys(3, namespace="tenant-a")))
        assert all(_put(client, make_keys(2, namespace="tenant-b")))
    finally:
        client.close()
    out = subprocess.run([sys.executable, "-m", "adpkv_gateway.ops.cli", "usage", "--port", str(gw.port)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    a_line = next(l for l in lines if "tenant-a" in l)
    assert f"{3 * ON_DISK / (1 << 20):.2f} MiB ({3 * ON_DISK} bytes), 3 objects" in a_line, a_line
    assert f"quota {QUOTA / (1 << 20):.2f} MiB ({QUOTA} bytes) per card" in a_line, a_line
    assert "0 evicted over quota, 0 by the card's LRU" in a_line
    b_line = next(l for l in lines if f"id:{B_ID}" in l)          # known by its id only
    assert f"({2 * ON_DISK} bytes)" in b_line and "no quota" in b_line
    assert any(f"id:{'00' * 8}" in l and "quota 0.00 MiB (4096 bytes) per card" in l for l in lines), \
        "an unused quota is listed"

    # the same in the metrics (the status file, parsed by prometheus_client's own parser)
    want = {("namespace_used_bytes", "tenant-a"): 3 * ON_DISK, ("namespace_objects", "tenant-a"): 3,
            ("namespace_quota_bytes", "tenant-a"): QUOTA, ("namespace_used_bytes", f"id:{B_ID}"): 2 * ON_DISK,
            ("namespace_quota_bytes", f"id:{'00' * 8}"): 4096, ("namespace_quota_evicted_total", "tenant-a"): 0}
    deadline = time.monotonic() + 30
    while True:
        got = {}
        if status.exists():
            for family in text_string_to_metric_families(status.read_text()):
                for sample in family.samples:
                    if sample.name.startswith("adpkv_gateway_namespace_"):
                        got[(sample.name[len("adpkv_gateway_"):], sample.labels["namespace"])] = sample.value
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {k: got.get(k) for k in want} == want


@pytest.mark.parametrize("bad", ["tenant-a", "tenant-a=-5", "tenant-a=lots", "=5", "id:12=5"])
def test_a_bad_quota_is_refused_with_the_reason(bad, tmp_path):
    with pytest.raises(ValueError, match="namespace_quotas"):
        parse_quotas(bad)
    from adpkv_gateway.ops.spawn import free_port
    out = subprocess.run([sys.executable, "-m", "adpkv_gateway.loop.main", "--storage-devices", str(tmp_path / "c"),
                          "--port", str(free_port()), "--namespace-quotas", bad],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "namespace_quotas" in out.stderr + out.stdout
    assert not (tmp_path / "c").exists(), "a refused setting changes nothing"


def test_quotas_from_yaml_and_by_id():
    assert parse_quotas({"tenant-a": 100, f"id:{B_ID}": "200"}) == {"tenant-a": 100, f"id:{B_ID}": 200}
    assert quotas_by_id(parse_quotas(f"tenant-a=100,id:{B_ID}=200")) == {
        namespace_id("tenant-a"): 100, namespace_id("tenant-b"): 200}


def _stats_of_another_user(port):
    return control.request(port, {"op": "STATS"})["stats"]


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, the other user as 65534")
def test_another_user_sees_no_other_tenants_usage(root_engine):
    gw, rank, keys = root_engine
    root_id = namespace_id("root-tenant").hex()
    assert _tenant_row(stats(gw.port), root_id)["objects"] == 4          # the operator sees it
    seen = as_nobody(_stats_of_another_user, gw.port)
    assert seen["tenants"] == [] and seen["namespace_names"] == {}
    assert root_id not in repr(seen)


def test_a_resp_card_says_quotas_do_not_bind_it_and_still_serves(redis_servers, start_gateway):
    server, = redis_servers(1)
    gw = start_gateway(card_dirs=[server.url], storage_backend="resp", namespace_quotas=f"tenant-a={ON_DISK}")
    assert gw.log().count("namespace_quotas do not apply to " + server.url) == 1
    client = _client(gw.port, "resp", 0, 1)
    try:
        keys = make_keys(3, namespace="tenant-a")
        assert all(_put(client, keys))
        wrong: list = []
        assert all(_get(client, keys, wrong)) and not wrong, "the Redis server holds them; nothing is evicted"
    finally:
        client.close()
    assert stats(gw.port)["tenants"] == [], "no usage per namespace from a card without an index"


def test_the_default_namespace_is_named(gateway):
    client = _client(gateway.port, "unnamed", 0, 1)     # no namespace set: keys in "default"
    try:
        assert all(_put(client, make_keys(2, namespace="default")))
    finally:
        client.close()
    row = _tenant_row(stats(gateway.port), namespace_id("default").hex())
    assert row["namespace"] == "default" and row["objects"] == 2
