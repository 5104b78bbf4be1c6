"""What tenant quotas and progress reporting cost the fs card, against the card's own work.

In one run, sides alternated, medians of ``--repeat`` rounds, on a real fs card (files in
``--dir``, page cache):

- a PUT's card write (``FsCard.write``: header, ``pwritev``, rename, index) of ``--n`` objects of
  ``--size`` bytes: without quotas (the peer), with a quota the namespace stays under
  (accounting only), and with the namespace held at its quota (every write first evicts one of
  its own objects: the index work plus an ``unlink``);
- a GET's card read (``FsCard.read``: locate, which refreshes both LRUs, then read and check) of
  those objects, with and without quotas;
- the index rebuild at start (``FsCard.open`` of the card), which now counts each file for its
  progress report: per file, and ``Progress.advance`` alone.

    python benchmarks/quota_overhead.py [--n 2000] [--size 32768] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from adpkv_core.keys import KeyBuilder, namespace_id
from adpkv_gateway.observe import progress
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.cards.objfile import HEADER_BYTES
from adpkv_gateway.cards.fragments import fragment_key


def one_round(base: str, n: int, size: int, quota_objects) -> tuple[float, float, float]:
    """(µs per write, µs per read, µs per file of the index rebuild) on a fresh card."""
    root = tempfile.mkdtemp(dir=base, prefix="quota-bench-")
    quotas = None if quota_objects is None else {namespace_id("bench"): quota_objects * (HEADER_BYTES + size)}
    try:
        card = FsCard(root + "/card", num_dbs=16, capacity_bytes=1 << 40, quotas=quotas)
        card.open()
        keys = [fragment_key(k, 0) for k in KeyBuilder("bench").keys([i.to_bytes(8, "big") for i in range(n)])]
        buf = memoryview(bytearray(b"\x5a" * size))
        t0 = time.perf_counter()
        for i, fkey in enumerate(keys):
            if not card.write(i % 16, fkey, buf, size):
                raise RuntimeError("not stored")
        t_write = (time.perf_counter() - t0) / n
        out = memoryview(bytearray(size))
        kept = keys[-min(n, quota_objects or n):]
        t0 = time.perf_counter()
        for i, fkey in enumerate(kept):
            if not card.read(0, fkey, out):
                raise RuntimeError("a stored object was missed")
        t_read = (time.perf_counter() - t0) / len(kept)
        card.close()
        again = FsCard(root + "/card", num_dbs=16, capacity_bytes=1 << 40, quotas=quotas)
        t0 = time.perf_counter()
        again.open()
        t_index = (time.perf_counter() - t0) / max(1, again.usage().objects)
        again.close()
        return t_write * 1e6, t_read * 1e6, t_index * 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)


def advance_cost(n: int = 200_000) -> float:
    with progress.track("bench", n, "calls", stream=open("/dev/null", "w")) as p:
        t0 = time.perf_counter()
        for _ in range(n):
            p.advance()
        return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    a = ap.parse_args()
    sides = {"no quotas": None, "quota not reached": a.n * 2, "at its quota (evicts one per write)": a.n // 4}
    runs: dict[str, list] = {name: [] for name in sides}
    order = list(sides)
    for rnd in range(a.repeat):
        for name in order[rnd % 3:] + order[:rnd % 3]:      # each side first, second, last in turn
            runs[name].append(one_round(a.dir, a.n, a.size, sides[name]))
    med = {name: [statistics.median(col) for col in zip(*r)] for name, r in runs.items()}
    peer = med["no quotas"]
    print(f"fs card, {a.n} objects of {a.size} bytes, page cache, median of {a.repeat} (sides alternated)")
    print(f"{'side':38s} {'write µs':>9s} {'x peer':>7s} {'read µs':>8s} {'x peer':>7s} {'index µs/file':>14s}")
    for name, (w, r, ix) in med.items():
        print(f"{name:38s} {w:9.1f} {w / peer[0]:7.3f} {r:8.1f} {r / peer[1]:7.3f} {ix:14.1f}")
    adv = advance_cost()
    print(f"Progress.advance: {adv:.3f} µs per file = {adv / peer[2]:.4f} of the index rebuild's "
          f"{peer[2]:.1f} µs per file")


if __name__ == "__main__":
    main()
