"""Benchmarks of the resp card (Redis-protocol servers as cards).

1. Client choice: SET/GET of 128 KiB, 1 MiB and 3 MiB values against one
   redis-server with redis-py (pure-Python parser), redis-py with hiredis, and
   adpkv's RespConnection (recv_into straight into a preallocated buffer).
2. Through a gateway: restore GB/s of one long dialog on 1, 2 and 4 cards with
   dialog and stripe placement; store GB/s with replicas 1 and 2; and a raw
   client loop (RespConnection, the same threads) against the same servers.
3. ``--exist``: the round trip of an EXIST of 16k keys (half of them stored, 1 KiB
   objects) through a gateway on one resp card and on a cluster card of 3 primaries,
   against its peer measured in the same run: redis-py (with hiredis) pipelined EXISTS of
   the same keys on the same servers (``RedisCluster`` pipeline for the cluster).

Run: python benchmarks/resp_cards.py [--mib 256]   (needs redis-server; prints a table)
     python benchmarks/resp_cards.py --exist [--exist-keys 16384] [--repeats 15]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from adpkv_core.affinity import dialog_marks
from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.cards.resp.conn import RespConnection
from adpkv_gateway.ops.spawn import GatewayProcess, RedisServer

MiB = 1 << 20
THREADS = 4          # I/O threads of the gateway and of the raw loop (this is a 2-core machine)


def client_choice(url: str, total: int) -> None:
    import redis
    from redis._parsers import _HiredisParser as HiredisParser
    from redis._parsers import _RESP2Parser as PythonParser
    print("client choice (one connection, sequential SET then GET):")
    for size in (128 * 1024, MiB, 3 * MiB):
        n = max(8, total // size)
        payload = os.urandom(size)
        row = []
        for name, make in (("redis-py", lambda: redis.Redis.from_url(url, parser_class=PythonParser)),
                           ("redis-py+hiredis", lambda: redis.Redis.from_url(url, parser_class=HiredisParser))):
            r = make()
            t0 = time.perf_counter()
            for i in range(n):
                r.set(b"bench:%d" % i, payload)
            t_set = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n):
                assert len(r.get(b"bench:%d" % i)) == size
            t_get = time.perf_counter() - t0
            row.append((name, n * size / t_set / 1e9, n * size / t_get / 1e9))
            r.close()
        conn = RespConnection(url, 30)
        buf = memoryview(bytearray(size))
        head = memoryview(bytearray(0))
        t0 = time.perf_counter()
        for i in range(n):
            conn.set_value(b"bench:%d" % i, [memoryview(payload)])
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            assert conn.get_into(b"bench:%d" % i, head, buf) == size
        t_get = time.perf_counter() - t0
        row.append(("adpkv RespConnection", n * size / t_set / 1e9, n * size / t_get / 1e9))
        conn.command(b"FLUSHALL")
        conn.close()
        for name, s, g in row:
            print(f"  {size // 1024:5d} KiB  {name:22s} SET {s:5.2f} GB/s  GET {g:5.2f} GB/s")


def dialog_keys(chunks: int, layers: int):
    hashes, parent = [], b""
    for c in range(chunks):
        parent = hashlib.sha256(parent + str(c).encode()).digest()
        hashes.append(parent)
    kb = KeyBuilder("bench")
    return kb.keys(hashes, range(layers)), dialog_marks(hashes, 1) * layers


def through_gateway(urls, placement: str, replicas: int, obj: int, chunks: int, layers: int, tmp: str):
    gw = GatewayProcess(urls, log_path=os.path.join(tmp, f"gw-{placement}-{replicas}-{len(urls)}.log"),
                        storage_backend="resp", key_placement=placement, replicas=replicas,
                        shared_memory_size=512 * MiB, thread_pool_size=THREADS).start()
    try:
        c = GatewayClient(ClientConfig(port=gw.port, timeout_s=120), f"bench-{time.monotonic_ns()}")
        keys, marks = dialog_keys(chunks, layers)
        per = chunks
        src = memoryview(os.urandom(obj * per))

        def fill(b):
            c.ring[b.offset:b.offset + b.count * obj] = src[:b.count * obj]

        t0 = time.perf_counter()
        futs = [c.put(keys[i:i + per], obj, fill, marks=marks[i:i + per]) for i in range(0, len(keys), per)]
        assert all(all(f.result().stored) for f in futs)
        t_store = time.perf_counter() - t0
        dst = memoryview(bytearray(obj * per))

        def copy(b):
            dst[:b.count * obj] = c.ring[b.offset:b.offset + b.count * obj]

        t0 = time.perf_counter()
        futs = [c.get(keys[i:i + per], obj, copy, marks=marks[i:i + per]) for i in range(0, len(keys), per)]
        assert all(f.result().all_ok for f in futs)
        t_restore = time.perf_counter() - t0
        c.close()
        control_clean = RespConnection(urls[0], 30)
        for u in urls:
            RespConnection(u, 30).command(b"FLUSHALL")
        control_clean.close()
        total = obj * len(keys)
        return total / t_store / 1e9, total / t_restore / 1e9
    finally:
        gw.stop()


def raw_loop(urls, obj: int, count: int, threads: int = 4):
    """SET then GET the same bytes with RespConnection from a thread pool, no gateway."""
    payload = memoryview(os.urandom(obj))

    def conn_for(i, cache={}):
        import threading
        k = (threading.get_ident(), i % len(urls))
        if k not in cache:
            cache[k] = RespConnection(urls[i % len(urls)], 30)
        return cache[k]

    def put(i):
        conn_for(i).set_value(b"raw:%d" % i, [payload])

    def get(i):
        buf = memoryview(bytearray(obj))
        conn_for(i).get_into(b"raw:%d" % i, memoryview(bytearray(0)), buf)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(put, range(count)))
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(get, range(count)))
        t_get = time.perf_counter() - t0
    for u in urls:
        RespConnection(u, 30).command(b"FLUSHALL")
    return obj * count / t_set / 1e9, obj * count / t_get / 1e9


def exist_round_trip(url: str, cluster: bool, n: int, repeats: int, tmp: str) -> None:
    """EXIST of ``n`` keys (every other one stored) through a gateway on the card ``url``, and
    redis-py's pipelined EXISTS of the same keys' heads on the same servers: medians and p90
    of ``repeats`` round trips each, after one warm-up."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster as PyCluster

    from adpkv_gateway.cards.resp.card import RespCard
    from adpkv_gateway.cards.resp.cluster import ClusterCard
    from adpkv_gateway.cards.fragments import db_hash, fragment_key
    gw = GatewayProcess([url], log_path=os.path.join(tmp, f"gw-exist-{cluster}.log"), storage_backend="resp",
                        shared_memory_size=128 * MiB, thread_pool_size=THREADS, num_dbs=16).start()
    try:
        c = GatewayClient(ClientConfig(port=gw.port, timeout_s=120), f"bench-exist-{time.monotonic_ns()}")
        keys = KeyBuilder("bench-exist").keys([hashlib.sha256(b"%d" % i).digest() for i in range(n)], [0])
        stored = keys[::2]
        obj = 1024

        def fill(b):
            pass
        for i in range(0, len(stored), 1024):
            assert all(c.put(stored[i:i + 1024], obj, fill).result(timeout=300).stored)

        def timed(fn) -> list[float]:
            fn()
            out = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out

        def gateway_exist():
            hits = c.exist(keys).result(timeout=120)
            assert sum(hits) == len(stored), f"{sum(hits)} of {len(stored)} found"
        t_gw = timed(gateway_exist)
        heads = [(db_hash(k) % 16, fragment_key(k, 0)) for k in keys]
        if cluster:
            server_keys = [ClusterCard._key(db, fkey) for db, fkey in heads]
            seeds = url[len("redis+cluster://"):].split(",")
            peer = PyCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in (s.rsplit(":", 1) for s in seeds)])
        else:
            server_keys = [RespCard._key(db, fkey) for db, fkey in heads]
            peer = redis.Redis.from_url(url)

        def peer_exists():
            p = peer.pipeline(transaction=False)
            for k in server_keys:
                p.exists(k)
            assert sum(p.execute()) == len(stored)
        t_peer = timed(peer_exists)
        peer.close()
        c.close()
    finally:
        gw.stop()
    med_gw, med_peer = statistics.median(t_gw), statistics.median(t_peer)

    def p90(ts):
        return sorted(ts)[int(0.9 * (len(ts) - 1))]
    what = "cluster card, 3 primaries" if cluster else "resp card, 1 server"
    print(f"  {what:26s} gateway EXIST {med_gw * 1e3:7.1f} ms p50 {p90(t_gw) * 1e3:7.1f} ms p90 | "
          f"redis-py pipelined EXISTS {med_peer * 1e3:7.1f} ms p50 {p90(t_peer) * 1e3:7.1f} ms p90 | "
          f"gateway / peer x{med_gw / med_peer:.2f}", flush=True)


def exist_main(n: int, repeats: int) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import redis
    from redis_cluster import RedisCluster
    print(f"EXIST of {n} keys ({n // 2} stored, 1 KiB objects), {repeats} round trips each; machine: "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, redis-py "
          f"{redis.__version__}; code: {os.path.dirname(sys.modules['adpkv_gateway'].__file__)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(os.path.join(tmp, "r")).start()
        try:
            exist_round_trip(server.url, False, n, repeats, tmp)
        finally:
            server.kill()
        cluster = RedisCluster(os.path.join(tmp, "c"), primaries=3, replicas=0).start()
        try:
            exist_round_trip(cluster.url, True, n, repeats, tmp)
        finally:
            cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per measurement (MiB)")
    ap.add_argument("--obj-kib", type=int, default=1024)
    ap.add_argument("--exist", action="store_true", help="only the round trip of a large EXIST (section 3)")
    ap.add_argument("--exist-keys", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if args.exist:
        exist_main(args.exist_keys, args.repeats)
        return
    tmp = tempfile.mkdtemp(prefix="adpkv-resp-bench-")
    servers = [RedisServer(os.path.join(tmp, f"r{i}")).start() for i in range(4)]
    try:
        client_choice(servers[0].url, args.mib * MiB)
        obj = args.obj_kib * 1024
        layers = 8
        chunks = max(1, args.mib * MiB // obj // layers)
        print(f"\nthrough the gateway: one dialog of {chunks} chunks x {layers} layers, {obj // 1024} KiB objects")
        for n in (1, 2, 4):
            for placement in ("dialog", "stripe"):
                s, r = through_gateway([x.url for x in servers[:n]], placement, 1, obj, chunks, layers, tmp)
                print(f"  {n} card(s) {placement:6s}: store {s:5.2f} GB/s  restore {r:5.2f} GB/s")
        s1, _ = through_gateway([x.url for x in servers], "stripe", 1, obj, chunks, layers, tmp)
        s2, r2 = through_gateway([x.url for x in servers], "stripe", 2, obj, chunks, layers, tmp)
        print(f"  4 cards stripe: store replicas=1 {s1:5.2f} GB/s, replicas=2 {s2:5.2f} GB/s "
              f"(x{s2 / s1:.2f}); restore with replicas=2 {r2:5.2f} GB/s")
        rs, rg = raw_loop([x.url for x in servers], obj, chunks * layers)
        gs, gr = through_gateway([x.url for x in servers], "stripe", 1, obj, chunks, layers, tmp)
        print(f"  raw RespConnection loop, 4 servers, {THREADS} threads: SET {rs:5.2f} GB/s  GET {rg:5.2f} GB/s")
        print(f"  gateway vs raw (4 cards, stripe): store x{gs / rs:.2f}  restore x{gr / rg:.2f}")
    finally:
        for s in servers:
            s.kill()


if __name__ == "__main__":
    main()
