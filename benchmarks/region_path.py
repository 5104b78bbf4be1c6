"""The gateway's region path alone (what ``AdpSecondaryTier`` asks of it), against the disk and
copy floors measured in the same run; no vLLM needed (for a host without it).

A gateway with one fs card; a registered /dev/shm region of 2 x ``--rows`` rows of 1 MiB; per
round: ``put_from`` of every row (jobs of 16 rows, all in flight), ``get_into`` of every row into
the other half of the region with the page cache hot, then again after ``sync; echo 1 >
/proc/sys/vm/drop_caches`` (root only); each load's rows compared byte for byte with the stored
ones. Prints GB/s, the gateway process's CPU seconds per GiB, and each figure as a multiple of
the floors of ``vllm_tiering.physical_limits`` (best of before/after): vLLM's ``fs`` tier moves
its rows by O_DIRECT, and ran at 74-132 % (median about 100 %) of the O_DIRECT floors in
docs/benchmarks.md, so ``x O_DIRECT`` is about ``x vLLM fs`` on the same disk.

    python benchmarks/region_path.py --rows 2048 [--dir /tmp/region-path] [--gateway thread_pool_size=16]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_tiering import drop_caches, physical_limits  # noqa: E402

ROW, JOB = 1 << 20, 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/adpkv-region-path")
    ap.add_argument("--rows", type=int, default=2048, help="rows of 1 MiB per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gateway", default="", help="extra gateway settings, e.g. thread_pool_size=16")
    args = ap.parse_args(argv)
    from adpkv_core.client import GatewayClient
    from adpkv_core.settings import ClientConfig
    from adpkv_gateway.ops.spawn import GatewayProcess
    n, d = args.rows, args.dir
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    before = physical_limits(os.path.join(d, "limits"), n * ROW, ROW, 16)
    print("floors before, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in before.items()), flush=True)
    settings = dict(kv.split("=", 1) for kv in filter(None, args.gateway.split(",")))
    gw = GatewayProcess([os.path.join(d, "card")], log_path=os.path.join(d, "gateway.log"),
                        shared_memory_size=64 << 20, **settings).start()
    region = f"/dev/shm/adpkv-region-path-{os.getpid()}"
    fd = os.open(region, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    res: dict[str, list[tuple[float, float]]] = {"store": [], "load hot": [], "load dropped": []}

    def cpu() -> float:
        f = open(f"/proc/{gw.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    try:
        os.ftruncate(fd, 2 * n * ROW)
        for at in range(0, n * ROW, 256 << 20):
            os.pwrite(fd, os.urandom(min(256 << 20, n * ROW - at)), at)
        c = GatewayClient(ClientConfig(port=gw.port, timeout_s=120), "region-path")
        rid = c.register_region(region, 0, 2 * n * ROW).result(10)

        def run(name: str, keys: list[bytes]) -> None:
            load = name != "store"
            if load:
                for at in range(n * ROW, 2 * n * ROW, 256 << 20):
                    os.pwrite(fd, bytes(min(256 << 20, 2 * n * ROW - at)), at)
            fn = c.get_into if load else c.put_from
            c0, t0 = cpu(), time.perf_counter()
            futs = [fn(rid, [((n if load else 0) + i) * ROW for i in range(j, min(j + JOB, n))], keys[j:j + JOB], ROW)
                    for j in range(0, n, JOB)]
            done = [f.result(300) for f in futs]
            seconds, cpu_s = time.perf_counter() - t0, cpu() - c0
            ok = sum(sum(r.ok) for r in done)
            if ok != n:
                raise RuntimeError(f"{name}: {ok} of {n} rows")
            if load and os.pread(fd, n * ROW, n * ROW) != os.pread(fd, n * ROW, 0):
                raise RuntimeError(f"{name}: a loaded row differs from the stored row")
            res[name].append((n * ROW / seconds / 1e9, cpu_s / (n * ROW / 2**30)))
            print(f"  {name}: {res[name][-1][0]:.2f} GB/s, gateway {res[name][-1][1]:.2f} CPU-s/GiB", flush=True)
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}", flush=True)
            keys = [hashlib.sha256(b"%d/%d" % (rnd, i)).digest()[:28] for i in range(n)]
            run("store", keys)
            run("load hot", keys)
            if drop_caches():
                run("load dropped", keys)
        c.close()
    finally:
        gw.stop()
        os.close(fd)
        os.unlink(region)
    after = physical_limits(os.path.join(d, "limits"), n * ROW, ROW, 16)
    print("floors after, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in after.items()), flush=True)
    best = {k: max(v, after.get(k, 0.0)) for k, v in before.items()}
    vs = {"store": "write O_DIRECT", "load hot": "read O_DIRECT", "load dropped": "read O_DIRECT"}
    print(f"\n{os.cpu_count()} cores, gateway {settings or 'defaults'}, {n} rows of 1 MiB, medians of "
          f"{args.rounds} rounds, every loaded row checked:")
    for name, runs in res.items():
        if runs:
            gb = statistics.median(r[0] for r in runs)
            extra = f", {gb / best['page cache -> region']:.0%} of page cache -> region" if name == "load hot" else ""
            print(f"  {name}: {gb:.2f} GB/s = {gb / best[vs[name]]:.2f}x {vs[name]}{extra}; gateway "
                  f"{statistics.median(r[1] for r in runs):.2f} CPU-s/GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
