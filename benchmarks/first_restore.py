"""The first restore of an engine against its next ones: what mapping its ring costs the gateway.

Each engine that attaches gets a ring of its own (``shared_memory_size``), and the gateway's I/O
processes, which read a GET's objects straight into the ring, map it the first time a read task
names it. This measures, through a real gateway process (fs card, ``io_processes``), for rings of
growing size: a fresh engine (a new client, so a new ring) GETs objects another engine stored, twice;
the first GET pays whatever the readers do on their first task for that ring, the second is the
peer measured in the same run (the same objects, page cache hot, readers warm). As in an engine,
whose first restore comes long after it attached, each GET waits until the gateway has populated
the new ring (its shared memory grown by the ring: ``RssShmem``), and each engine's ring is
unmapped before the next attaches. Printed per ring size: the medians over ``--engines`` fresh
engines, and first / second.

    python benchmarks/first_restore.py --ring-gib 1,2,4 --io-processes 2 --mib 64 --engines 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops.spawn import GatewayProcess

MiB = 1 << 20
GiB = 1 << 30


def shmem_bytes(pid: int) -> int:
    """The process's resident shared memory (``RssShmem``): the rings it has populated."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem in /proc/PID/status")


def wait_until(cond, what: str, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {deadline_s} s")
        time.sleep(0.01)


def timed_get(client: GatewayClient, keys: list[bytes], obj: int) -> float:
    t0 = time.perf_counter()
    hits = client.get(keys, obj, lambda b: None).result(300).hits
    dt = time.perf_counter() - t0
    if not all(hits):
        raise RuntimeError("a GET missed objects that were stored")
    return dt


def ring_size(gib: float, args) -> dict:
    card = os.path.join(args.dir, f"card-{gib}")
    shutil.rmtree(card, ignore_errors=True)
    gw = GatewayProcess(card, shared_memory_size=int(gib * GiB), io_processes=args.io_processes,
                        log_path=card + ".log").start(timeout_s=120)
    obj = MiB
    keys = KeyBuilder("first-restore").keys([b"chunk-%d" % c for c in range(args.mib)], [0])
    firsts, seconds = [], []
    try:
        store = GatewayClient(ClientConfig(port=gw.port, timeout_s=300), "first-restore-store")
        if not all(store.put(keys, obj, lambda b: None).result(300).stored):
            raise RuntimeError("store failed")
        pid, ring = gw.proc.pid, int(gib * GiB)
        before = shmem_bytes(pid)
        store.close()
        wait_until(lambda: shmem_bytes(pid) <= before - ring * 0.98, "the storing engine's ring was not unmapped")
        for i in range(args.engines):
            before = shmem_bytes(pid)
            client = GatewayClient(ClientConfig(port=gw.port, timeout_s=300), f"first-restore-{i}")
            if not client.enabled:
                raise RuntimeError("the engine did not attach")
            wait_until(lambda: shmem_bytes(pid) >= before + ring * 0.98, "the gateway did not populate the ring")
            firsts.append(timed_get(client, keys, obj))
            seconds.append(timed_get(client, keys, obj))
            client.close()
            wait_until(lambda: shmem_bytes(pid) <= before + ring * 0.02, "the engine's ring was not unmapped")
    finally:
        gw.stop(timeout_s=120)
        shutil.rmtree(card, ignore_errors=True)
    first, second = statistics.median(firsts), statistics.median(seconds)
    row = {"ring_gib": gib, "objects_mib": args.mib, "io_processes": args.io_processes,
           "first_s": firsts, "second_s": seconds, "first_median_s": first, "second_median_s": second,
           "first_over_second": first / second}
    print(f"ring {gib:g} GiB: first GET of a fresh engine {first * 1e3:.1f} ms, its second {second * 1e3:.1f} ms "
          f"({args.mib} MiB, {args.io_processes} I/O processes, medians of {args.engines} engines): "
          f"first / second {first / second:.1f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/adpkv-first-restore")
    ap.add_argument("--ring-gib", default="1,2,4", help="ring sizes (shared_memory_size), GiB")
    ap.add_argument("--io-processes", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64, help="objects of 1 MiB each GET reads")
    ap.add_argument("--engines", type=int, default=3, help="fresh engines per ring size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    rows = [ring_size(float(g), args) for g in args.ring_gib.split(",") if g]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
