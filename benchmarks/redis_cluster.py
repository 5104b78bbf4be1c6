"""The cluster card (issue 18): 1 MiB objects through a gateway on a Redis Cluster vs the
same cluster driven directly by redis-py's cluster client (``redis.cluster.RedisCluster``
with hiredis, pipelined: the peer a user would write), in the same run, on clusters of 1,
2 and 3 primaries (no replicas, so the figures are the client's and the servers', not
the replication's).

Per path and cluster size: store and restore GB/s, and CPU seconds per GiB moved of the
gateway process (all its threads) and the engine side (the client that fills and checks
the ring) vs the direct client's own process, and of the redis-servers. Then the client
choice itself, in one process and one thread: the card's own RESP client
(``ClusterCard.write``/``read``: ``sendmsg`` from and ``recv_into`` the buffer; and
``read_many`` of 8 objects at a time, as the gateway's I/O tasks call it) vs redis-py's
``RedisCluster.set``/``get``.

Run: python benchmarks/redis_cluster.py [--mib 256] [--batch 32] [--primaries 1,2,3]
(needs redis-server and redis-cli; prints a table)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from adpkv_core.client import GatewayClient          # noqa: E402
from adpkv_core.keys import KeyBuilder                # noqa: E402
from adpkv_core.settings import ClientConfig          # noqa: E402
from adpkv_gateway.ops.spawn import GatewayProcess        # noqa: E402
from redis_cluster import RedisCluster                # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def redis_cpu(cluster: RedisCluster) -> float:
    return sum(proc_cpu(n.proc.pid) for n in cluster.live())


class Meter:
    """Wall time and CPU seconds of this process, the gateway and the redis-servers."""

    def __init__(self, cluster: RedisCluster, gw_pid: int | None):
        self.cluster, self.gw_pid = cluster, gw_pid

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.g0 = proc_cpu(self.gw_pid) if self.gw_pid else 0.0
        self.r0 = redis_cpu(self.cluster)
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.client = time.process_time() - self.c0
        self.gateway = (proc_cpu(self.gw_pid) - self.g0) if self.gw_pid else 0.0
        self.redis = redis_cpu(self.cluster) - self.r0


def row(label: str, op: str, nbytes: int, m: Meter, gateway: bool) -> dict:
    gib = nbytes / GiB
    r = {"path": label, "op": op, "GB/s": nbytes / m.wall / 1e9, "wall_s": m.wall,
         "gateway_cpu_s_per_GiB": m.gateway / gib if gateway else None,
         "client_cpu_s_per_GiB": m.client / gib, "redis_cpu_s_per_GiB": m.redis / gib}
    gw = f"{r['gateway_cpu_s_per_GiB']:6.2f}" if gateway else "     -"
    print(f"  {label:<22} {op:<8} {r['GB/s']:6.2f} GB/s   cpu s/GiB: gateway {gw}  "
          f"client {r['client_cpu_s_per_GiB']:5.2f}  redis {r['redis_cpu_s_per_GiB']:5.2f}", flush=True)
    return r


def through_gateway(cluster: RedisCluster, n: int, batch: int, payload: bytes, tmp: str) -> list[dict]:
    gw = GatewayProcess([cluster.url], log_path=os.path.join(tmp, "gateway.log"), storage_backend="resp",
                        shared_memory_size=max(256 * MiB, 4 * batch * MiB))
    gw.start()
    try:
        c = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=5, timeout_s=120), "bench")
        assert c.enabled, c.attach_error
        kb = KeyBuilder("bench-cluster")
        keys = kb.keys([hashlib.sha256(b"%d" % i).digest() for i in range(n)], [0])
        out = []

        def fill(b):
            for j in range(b.count):
                o = b.offset + j * b.stride
                c.ring[o:o + MiB] = payload

        with Meter(cluster, gw.proc.pid) as m:
            stored = 0
            for i in range(0, n, batch):
                stored += sum(c.put(keys[i:i + batch], MiB, fill).result(timeout=300).stored)
        assert stored == n, f"{stored} of {n} stored"
        out.append(row("gateway (cluster card)", "store", n * MiB, m, True))
        wrong = []

        def check(b):
            for j in range(b.count):
                o = b.offset + j * b.stride
                if not b.hits[j] or c.ring[o:o + 64] != payload[:64]:
                    wrong.append(b.first + j)

        with Meter(cluster, gw.proc.pid) as m:
            for i in range(0, n, batch):
                c.get(keys[i:i + batch], MiB, check).result(timeout=300)
        assert not wrong, f"{len(wrong)} objects missed or wrong"
        out.append(row("gateway (cluster card)", "restore", n * MiB, m, True))
        c.close()
        return out
    finally:
        gw.stop()


def direct_redis_py(cluster: RedisCluster, n: int, batch: int, payload: bytes) -> list[dict]:
    from redis.cluster import ClusterNode, RedisCluster as PyCluster
    nodes = [ClusterNode("127.0.0.1", node.port) for node in cluster.primaries()]
    rc = PyCluster(startup_nodes=nodes)
    keys = [b"direct:{%d}" % i for i in range(n)]
    out = []
    with Meter(cluster, None) as m:
        for i in range(0, n, batch):
            p = rc.pipeline(transaction=False)
            for k in keys[i:i + batch]:
                p.set(k, payload)
            assert all(p.execute())
    out.append(row("redis-py RedisCluster", "store", n * MiB, m, False))
    with Meter(cluster, None) as m:
        for i in range(0, n, batch):
            p = rc.pipeline(transaction=False)
            for k in keys[i:i + batch]:
                p.get(k)
            got = p.execute()
            assert all(len(v) == MiB and v[:64] == payload[:64] for v in got)
    out.append(row("redis-py RedisCluster", "restore", n * MiB, m, False))
    for i in range(0, n, batch):
        p = rc.pipeline(transaction=False)
        for k in keys[i:i + batch]:
            p.delete(k)
        p.execute()
    rc.close()
    return out


def client_choice(cluster: RedisCluster, n: int, payload: bytes) -> list[dict]:
    """One thread, one object at a time: the card's own client vs redis-py's cluster client."""
    from redis.cluster import ClusterNode, RedisCluster as PyCluster

    from adpkv_gateway.cards.resp.cluster import ClusterCard
    from adpkv_gateway.cards.fragments import fragment_key
    out = []
    card = ClusterCard(cluster.url)
    card.open()
    fkeys = [fragment_key(hashlib.sha256(b"c%d" % i).digest()[:28], 0) for i in range(n)]
    view = memoryview(payload)
    buf = memoryview(bytearray(MiB))
    with Meter(cluster, None) as m:
        for k in fkeys:
            assert card.write(0, k, view, MiB)
    out.append(row("own client (card)", "SET", n * MiB, m, False))
    with Meter(cluster, None) as m:
        for k in fkeys:
            assert card.read(0, k, buf)
    out.append(row("own client (card)", "GET", n * MiB, m, False))
    bufs = [memoryview(bytearray(MiB)) for _ in range(8)]
    with Meter(cluster, None) as m:
        for i in range(0, n, 8):
            got = card.read_many([(0, k, b, b"") for k, b in zip(fkeys[i:i + 8], bufs)])
            assert all(r is True for r in got), got
    out.append(row("own client (card)", "GET x8", n * MiB, m, False))
    card.delete_many([(0, k) for k in fkeys])
    card.close()
    rc = PyCluster(startup_nodes=[ClusterNode("127.0.0.1", node.port) for node in cluster.primaries()])
    keys = [b"choice:{%d}" % i for i in range(n)]
    with Meter(cluster, None) as m:
        for k in keys:
            rc.set(k, payload)
    out.append(row("redis-py RedisCluster", "SET", n * MiB, m, False))
    with Meter(cluster, None) as m:
        for k in keys:
            assert len(rc.get(k)) == MiB
    out.append(row("redis-py RedisCluster", "GET", n * MiB, m, False))
    for k in keys:
        rc.delete(k)
    rc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB stored and restored per path and cluster size")
    ap.add_argument("--batch", type=int, default=32, help="objects per request / pipeline")
    ap.add_argument("--primaries", default="1,2,3")
    args = ap.parse_args()
    import redis
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"redis-py {redis.__version__}; {args.mib} x 1 MiB objects, batches of {args.batch}")
    payload = os.urandom(MiB)
    results = {}
    for p in [int(x) for x in args.primaries.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            cluster = RedisCluster(os.path.join(tmp, "c"), primaries=p, replicas=0).start()
            try:
                print(f"{p} primar{'y' if p == 1 else 'ies'}:")
                rows = through_gateway(cluster, args.mib, args.batch, payload, tmp)
                rows += direct_redis_py(cluster, args.mib, args.batch, payload)
                if p == max(int(x) for x in args.primaries.split(",")):
                    print("  client choice (one thread, one object at a time):")
                    rows += client_choice(cluster, min(args.mib, 128), payload)
                results[p] = rows
            finally:
                cluster.stop()
    print("ratios gateway / redis-py (GB/s):")
    for p, rows in results.items():
        by = {(r["path"], r["op"]): r for r in rows}
        s = by[("gateway (cluster card)", "store")]["GB/s"] / by[("redis-py RedisCluster", "store")]["GB/s"]
        g = by[("gateway (cluster card)", "restore")]["GB/s"] / by[("redis-py RedisCluster", "restore")]["GB/s"]
        print(f"  {p} primaries: store {s:.2f}x, restore {g:.2f}x")


if __name__ == "__main__":
    main()
