"""What the region lock (``adpkv_core.memory.region_lock``, issue 25 item 10) costs per object on the
region GET path.

1. ``write``: writes into a /dev/shm file in tasks of 16 (as the gateway's I/O tasks), each a
   ``write_by`` check and a ``pwrite``, bare against inside ``holding`` (one shared OFD lock
   and unlock per task), per object size; median of rounds.
   Skipped on a tree without ``region_lock`` (the code before the lock).
2. ``get_into``: a real gateway (one fs card, page cache hot), ``--objects`` objects stored from a
   /dev/shm region, then ``get_into`` of all of them (jobs of ``--per-request``) per round, every
   byte compared; microseconds per object, median (and best) of rounds. Run it on the tree before and after
   the change (PYTHONPATH) for the before/after figure.

    python benchmarks/region_lock_cost.py --objects 4096 --size 16384 --rounds 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
import uuid

from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops.spawn import GatewayProcess


def write_cost(sizes, n, rounds, per_task=16) -> None:
    try:
        from adpkv_core.memory.region_lock import holding
    except ImportError:
        print("write: no adpkv_core.memory.region_lock in this tree (before the change)")
        return
    path = f"/dev/shm/adpkv-lock-cost-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(sizes) * per_task)
        for size in sizes:
            data = os.urandom(size)
            far = time.monotonic() + 3600
            plain, locked = [], []
            tasks = max(1, n // per_task)
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(tasks):
                    for i in range(per_task):
                        if time.monotonic() < far:
                            os.pwrite(fd, data, i * size)
                plain.append((time.perf_counter() - t0) / (tasks * per_task))
                t0 = time.perf_counter()
                for _ in range(tasks):
                    with holding([(fd, 0, per_task * size)], far):
                        for i in range(per_task):
                            if time.monotonic() < far:
                                os.pwrite(fd, data, i * size)
                locked.append((time.perf_counter() - t0) / (tasks * per_task))
            p, q = statistics.median(plain) * 1e6, statistics.median(locked) * 1e6
            print(f"write {size >> 10:5d} KiB, tasks of {per_task}: check+pwrite {p:7.2f} us, under holding "
                  f"{q:7.2f} us per object (+{q - p:.2f} us)")
    finally:
        os.close(fd)
        os.unlink(path)


def get_into_cost(objects, size, per_request, rounds) -> None:
    card = tempfile.mkdtemp(prefix="adpkv-lock-cost-")
    path = f"/dev/shm/adpkv-lock-cost-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 2 * objects * size)
    buf = mmap.mmap(fd, 2 * objects * size, mmap.MAP_SHARED)
    os.close(fd)
    try:
        with GatewayProcess([card], shared_memory_size=256 << 20) as gw:
            c = GatewayClient(ClientConfig(port=gw.port, timeout_s=30.0), "lock-cost", 0, 1)
            region = c.register_region(path, 0, 2 * objects * size).result(10)
            keys = KeyBuilder("lock-cost").keys([i.to_bytes(8, "big") for i in range(objects)], layers=[0])
            src = os.urandom(objects * size)
            buf[:objects * size] = src
            for k in range(0, objects, per_request):
                part = keys[k:k + per_request]
                assert all(c.put_from(region, [(k + i) * size for i in range(len(part))], part, size)
                           .result(60).stored)
            times = []
            for _ in range(rounds + 1):                      # the first round warms the page cache
                buf[objects * size:] = bytes(objects * size)
                t0 = time.perf_counter()
                futs = [c.get_into(region, [(objects + k + i) * size for i in range(len(keys[k:k + per_request]))],
                                   keys[k:k + per_request], size) for k in range(0, objects, per_request)]
                assert all(f.result(60).all_ok for f in futs)
                times.append((time.perf_counter() - t0) / objects)
                assert buf[objects * size:] == src
            t, best = statistics.median(times[1:]) * 1e6, min(times[1:]) * 1e6
            print(f"get_into {size >> 10} KiB x {objects}: {t:.2f} us per object (best {best:.2f}) "
                  f"(rounds: {', '.join(f'{x * 1e6:.2f}' for x in times[1:])})")
            c.close()
    finally:
        buf.close()
        os.unlink(path)
        shutil.rmtree(card, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=4096)
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--per-request", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writes", type=int, default=20000)
    args = ap.parse_args()
    write_cost([4096, 16384, 65536, 1 << 20], args.writes, args.rounds)
    get_into_cost(args.objects, args.size, args.per_request, args.rounds)


if __name__ == "__main__":
    main()
