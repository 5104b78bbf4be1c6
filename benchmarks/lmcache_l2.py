"""`lmcache bench l2`: the adpkv L2 adapter vs LMCache's own `fs` adapter, same disk, alternating.

Run with the lmcache venv::

    $(bash tools/venv.sh lmcache)/bin/python benchmarks/lmcache_l2.py --dir /path/on/the/disk --repeats 5

Each repeat runs LMCache's benchmark once per adapter (order alternates: ABAB...), with 1 MiB
objects, 4 x 32 keys in flight and `--no-skip-verify`. Before every run the adapter's store is
emptied (fs: the directory is removed; adpkv: CLEAN), so every store writes and every load reads
back what was just written. The gateway's fs card runs without O_DIRECT, like LMCache's fs adapter,
so both read back through the page cache. Prints medians, the per-repeat figures and the ratio
adpkv/fs; `--json` writes everything. `--breakdown` adds where the adpkv load time goes (gateway
GET alone vs. the ring → L1 copy) measured with the client SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def bench_once(spec: dict, args, out_json: str) -> dict:
    if args.l1 == "shm":
        launcher = [sys.executable, os.path.join(HERE, "lmcache_bench_shm_l1.py")]
    else:
        launcher = [os.path.join(os.path.dirname(sys.executable), "lmcache")]
    cmd = [*launcher, "bench", "l2",
           "--l2-adapter", json.dumps(spec), "--num-keys", str(args.num_keys), "--in-flight", str(args.in_flight),
           "--data-size-kb", str(args.data_size_kb), "--rounds", str(args.rounds),
           "--warmup-rounds", str(args.warmup_rounds), "--no-skip-verify", "--format", "json",
           "--output", out_json, "-q"]
    if args.odirect:
        cmd += ["--l1-align-bytes", "4096"]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"lmcache bench l2 failed ({r.returncode}) for {spec['type']}:\n{r.stdout[-3000:]}\n"
                         f"{r.stderr[-3000:]}")
    metrics = json.load(open(out_json))["metrics"]
    ops = {m["operation"].lower(): m for k, m in metrics.items() if k.startswith("op_")}
    for op in ("store", "load"):
        if ops[op]["total_success"] != ops[op]["total_keys"]:
            raise SystemExit(f"{spec['type']}: {op} succeeded for {ops[op]['total_success']} of "
                             f"{ops[op]['total_keys']} keys")
    return {op: ops[op]["throughput_avg_mbps"] / 1000.0 for op in ("store", "load")}   # MB/s → GB/s


def breakdown(port: int, object_bytes: int, n_objects: int, per_request: int, repeats: int = 3) -> dict:
    """Load path of the adapter, taken apart with the client SDK: gateway GET alone, then with the copy."""
    import ctypes

    import numpy as np
    from concurrent.futures import wait

    from adpkv_core.client import GatewayClient
    from adpkv_core.keys import KeyBuilder
    from adpkv_core.settings import ClientConfig

    libc = ctypes.CDLL(None)
    memmove = libc.memmove
    memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    c = GatewayClient(ClientConfig(port=port), engine_id="lmc-breakdown", rank=0, world_size=1)
    try:
        ring = np.frombuffer(c.ring, dtype=np.uint8)
        ra = ring.ctypes.data
        src = np.random.randint(0, 255, n_objects * object_bytes, dtype=np.uint8)
        dst = np.ones(n_objects * object_bytes, dtype=np.uint8)
        kb = KeyBuilder("lmc-breakdown")
        keys = [kb.key(i.to_bytes(8, "big")) for i in range(n_objects)]
        copy_s = [0.0]

        def putter(base):
            def f(b):
                for j in range(b.count):
                    memmove(ra + b.offset + j * b.stride, src.ctypes.data + (base + b.first + j) * object_bytes,
                            object_bytes)
            return f

        def getter(base, do_copy):
            def f(b):
                t = time.perf_counter()
                if do_copy:
                    for j in range(b.count):
                        memmove(dst.ctypes.data + (base + b.first + j) * object_bytes, ra + b.offset + j * b.stride,
                                object_bytes)
                copy_s[0] += time.perf_counter() - t
            return f

        groups = range(n_objects // per_request)
        wait([c.put(keys[g * per_request:(g + 1) * per_request], object_bytes, putter(g * per_request))
              for g in groups])
        res: dict = {"get_only_gbps": [], "get_with_copy_gbps": [], "copy_only_gbps": []}
        total = n_objects * object_bytes
        for _ in range(repeats):
            for do_copy in (False, True):
                copy_s[0] = 0.0
                t = time.perf_counter()
                wait([c.get(keys[g * per_request:(g + 1) * per_request], object_bytes,
                            getter(g * per_request, do_copy)) for g in groups])
                dt = time.perf_counter() - t
                res["get_with_copy_gbps" if do_copy else "get_only_gbps"].append(total / dt / 1e9)
                if do_copy:
                    res["copy_only_gbps"].append(total / copy_s[0] / 1e9)
        ok = bool(np.array_equal(src, dst))
        c.clean().result(timeout=30)
    finally:
        c.close()
    out = {k: round(statistics.median(v), 2) for k, v in res.items()}
    out["byte_exact"] = ok
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir in /tmp)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-keys", type=int, default=32)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--data-size-kb", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--ring-mib", type=int, default=512, help="gateway ring (shared_memory_size) in MiB")
    p.add_argument("--io-processes", type=int, default=0, help="gateway io_processes (fs reads in processes)")
    p.add_argument("--odirect", action="store_true",
                   help="both bypass the page cache: the gateway's fs card with o_direct, LMCache fs with "
                        "use_odirect (and 4 KiB-aligned L1 buffers)")
    p.add_argument("--l1", choices=("anon", "shm"), default="anon",
                   help="the benchmark's L1 buffer: anonymous memory (lmcache bench l2 as shipped) or a "
                        "/dev/shm file like the LMCache server's L1 pool (lmcache_bench_shm_l1.py); with "
                        "shm the adpkv adapter has the gateway read and write L1 directly")
    p.add_argument("--breakdown", action="store_true", help="also take the adpkv load path apart")
    p.add_argument("--json", default=None, help="write all figures to this file")
    args = p.parse_args()

    from adpkv_gateway.ops.control import request
    from adpkv_gateway.ops.spawn import GatewayProcess

    root = args.dir or tempfile.mkdtemp(prefix="adpkv-lmc-bench-")
    os.makedirs(root, exist_ok=True)
    card = os.path.join(root, "adpkv-card")
    fs_dir = os.path.join(root, "lmcache-fs")
    out_json = os.path.join(root, "bench.json")
    gw = GatewayProcess(card, shared_memory_size=args.ring_mib << 20, o_direct=bool(args.odirect),
                        io_processes=args.io_processes,
                        log_path=os.path.join(root, "gateway.log")).start()
    specs = {
        "adpkv": {"type": "plugin", "module_path": "adpkv_lmcache", "class_name": "AdpL2Adapter",
                  "adapter_params": {"port": gw.port, "namespace": "lmcache-bench"}},
        "fs": {"type": "fs", "base_path": fs_dir, "use_odirect": bool(args.odirect)},
    }
    runs: dict = {"adpkv": [], "fs": []}
    try:
        for rep in range(args.repeats):
            order = ("adpkv", "fs") if rep % 2 == 0 else ("fs", "adpkv")
            for name in order:
                if name == "fs":
                    shutil.rmtree(fs_dir, ignore_errors=True)
                else:
                    reply = request(gw.port, {"op": "CLEAN"}, timeout_s=60)
                    assert reply is not None and reply.get("op") == "OK", reply
                r = bench_once(specs[name], args, out_json)
                runs[name].append(r)
                print(f"repeat {rep + 1}/{args.repeats} {name:5s}: store {r['store']:.2f} GB/s  "
                      f"load {r['load']:.2f} GB/s", flush=True)
        result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "dir": root, "runs": runs}
        med = {n: {op: statistics.median(x[op] for x in runs[n]) for op in ("store", "load")} for n in runs}
        result["median_gbps"] = med
        result["ratio_adpkv_over_fs"] = {op: med["adpkv"][op] / med["fs"][op] for op in ("store", "load")}
        # ratio per repeat (adjacent runs share the machine's mood)
        result["ratio_per_repeat"] = {op: [a[op] / f[op] for a, f in zip(runs["adpkv"], runs["fs"])]
                                      for op in ("store", "load")}
        if args.breakdown:
            n_obj = args.num_keys * args.in_flight
            result["adpkv_load_breakdown"] = breakdown(gw.port, args.data_size_kb << 10, n_obj, args.num_keys)
        print()
        print(f"{'':8s}{'store GB/s':>12s}{'load GB/s':>12s}")
        for n in ("adpkv", "fs"):
            print(f"{n:8s}{med[n]['store']:12.2f}{med[n]['load']:12.2f}")
        ratio = result["ratio_adpkv_over_fs"]
        print(f"{'ratio':8s}{ratio['store']:12.2f}{ratio['load']:12.2f}   (adpkv / fs, medians of {args.repeats})")
        if args.breakdown:
            print("adpkv load path:", result["adpkv_load_breakdown"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        gw.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
