"""What the region lock (``adpkv_core.region_lock``, issue 25 item 10) costs per object on the
region GET path.

1. ``write``: one write into a /dev/shm file, ``os.pwrite`` alone against ``write_before``
   (shared OFD lock, ``write_by`` check, ``pwrite``, unlock), per object size; median of rounds.
   Skipped on a tree without ``region_lock`` (the code before the lock).
2. ``get_into``: a real gateway (one fs card, page cache hot), ``--objects`` objects stored from a
   /dev/shm region, then ``get_into`` of all of them (jobs of ``--per-request``) per round, every
   byte compared; microseconds per object, median of rounds. Run it on the tree before and after
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
from adpkv_gateway.spawn import GatewayProcess


def write_cost(sizes, n, rounds) -> None:
    try:
        from adpkv_core.region_lock import write_before
    except ImportError:
        print("write: no adpkv_core.region_lock in this tree (before the change)")
        return
    path = f"/dev/shm/adpkv-lock-cost-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(sizes) * 64)
        for size in sizes:
            data = os.urandom(size)
            far = time.monotonic() + 3600
            plain, locked = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for i in range(n):
                    os.pwrite(fd, data, (i % 64) * size)
                plain.append((time.perf_counter() - t0) / n)
                t0 = time.perf_counter()
                for i in range(n):
                    write_before(fd, data, (i % 64) * size, far)
                locked.append((time.perf_counter() - t0) / n)
            p, q = statistics.median(plain) * 1e6, statistics.median(locked) * 1e6
            print(f"write {size >> 10:5d} KiB: pwrite {p:7.2f} us, write_before {q:7.2f} us (+{q - p:.2f} us)")
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
                assert all(all(f.result(60)) for f in futs)
                times.append((time.perf_counter() - t0) / objects)
                assert buf[objects * size:] == src
            t = statistics.median(times[1:]) * 1e6
            print(f"get_into {size >> 10} KiB x {objects}: {t:.2f} us per object "
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
