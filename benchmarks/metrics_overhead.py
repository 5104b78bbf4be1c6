"""What the metrics cost the card I/O path, against the I/O they account for.

Every card I/O ends in ``CardStats.record`` (gateway/store/object_store.py), which also counts the I/O in
the card's latency buckets (under the lock it takes anyway). This measures, in one run and
alternating the sides (medians of ``--repeat`` rounds):

- ``record`` as the gateway runs it (counters + latency buckets), and the same counters without
  the buckets (a ``CardStats`` whose bucket step is skipped: what the I/O path paid before);
- ``prometheus_client.Histogram.observe``, the library's own instrument: what the buckets would
  cost as one (the reason they are kept in ``CardStats``);
- the cheapest real card I/O it accounts for: ``os.preadv`` of one object from the page cache
  into a buffer (4 KiB, and the 128 KiB of a typical vLLM chunk layer), the floor of a hot
  fs-card read;
- the exposition the gateway renders once a second (status file, /metrics) for ``--cards``
  cards, off the I/O path.

It prints the added cost as a fraction of each read: the share of a hot read the metrics take.

    python benchmarks/metrics_overhead.py [--n 200000] [--repeat 5] [--cards 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import msgspec
from prometheus_client import Histogram

from adpkv_core.wire.protocol import GatewayStats

from adpkv_gateway.observe.latency import IO_LATENCY_BUCKETS
from adpkv_gateway.observe.metrics import GatewayMetrics
from adpkv_gateway.store.card_stats import CardStats


class CountersOnly(CardStats):
    """``CardStats.record`` as it was before the latency buckets (the counters only)."""

    def record(self, write: bool, ok: bool, nbytes: int, seconds: float) -> None:
        with self.lock:
            if write:
                self.writes += 1
                self.bytes_written += nbytes if ok else 0
                self.write_errors += 0 if ok else 1
            else:
                self.reads += 1
                self.bytes_read += nbytes if ok else 0
                self.read_errors += 0 if ok else 1
            self.io_seconds += seconds
            self.io_count += 1
            self.io_max_s = max(self.io_max_s, seconds)


def per_call(fn, n: int) -> float:
    """Seconds per call of ``fn(i)`` over ``n`` calls."""
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n


def pread_cost(size: int, n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "obj")
        with open(path, "wb") as fh:
            fh.write(os.urandom(size))
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(size)
        try:
            os.preadv(fd, [buf], 0)                 # into the page cache
            return per_call(lambda i: os.preadv(fd, [buf], 0), n)
        finally:
            os.close(fd)


class _Card:
    def __init__(self, serial: str):
        self.serial, self.device = serial, f"/cards/{serial}"


def figures(cards: int) -> GatewayStats:
    """The STATS figures of a busy gateway with ``cards`` cards and three namespaces."""
    card = {"device": "/cards/x", "kind": "fs", "io_seconds": 100.0, "io_count": 2 * 10 ** 6, "io_max_seconds": 0.1,
            "active": True, "strikes": 0, "oldest_io_age_s": 0.0, "reads": 10 ** 6, "writes": 10 ** 6,
            "bytes_read": 10 ** 12, "bytes_written": 10 ** 12, "read_errors": 0, "write_errors": 0,
            "evicted": 10 ** 5, "used_bytes": 10 ** 12, "capacity_bytes": 2 * 10 ** 12, "objects": 10 ** 7}
    return msgspec.convert({
            "port": 1, "uptime_s": 1.0, "storage_slots": 16, "num_dbs": 1, "shared_storage": False, "replicas": 1,
            "regions": 0, "objects": {}, "namespace_names": {}, "version": "0", "work": [], "layout_change": None,
            "fingerprint": "0123456789abcdef", "placement": "dialog", "ring_size": 1 << 30, "ring_in_use": 0,
            "requests_in_flight": 3, "pinned": 100, "sessions": 4,
            "request_latency": {"get": ([10] * 18, 1.5), "put": ([10] * 18, 2.5)},
            "engine": {"id": "e", "world": 8, "ranks": list(range(8)), "namespace": "ns0"},
            "counters": {"get_requests": 10 ** 6, "put_requests": 10 ** 6, "exist_requests": 10 ** 6},
            "objects_by_namespace": {f"ns{i}": {"hits": 10 ** 6, "misses": 10 ** 5, "stored": 10 ** 6,
                                                "store_failed": 0, "restored_bytes": 10 ** 12,
                                                "stored_bytes": 10 ** 12} for i in range(3)},
            "cards": [{"serial": f"FS{i:014d}", **card} for i in range(cards)]}, GatewayStats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="calls per measurement")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cards", type=int, default=4)
    args = ap.parse_args()
    stats, before = CardStats(), CountersOnly()
    hist = Histogram("bench_seconds", "", registry=None, buckets=IO_LATENCY_BUCKETS)
    rounds: dict[str, list[float]] = {"record (counters + buckets)": [], "record before (counters)": [],
                                      "prometheus Histogram.observe": [], "pread 4 KiB": [], "pread 128 KiB": []}
    for _ in range(args.repeat):           # alternate the sides, medians at the end
        rounds["record (counters + buckets)"].append(
            per_call(lambda i: stats.record(False, True, 4096, 0.0003), args.n))
        rounds["record before (counters)"].append(per_call(lambda i: before.record(False, True, 4096, 0.0003), args.n))
        rounds["prometheus Histogram.observe"].append(per_call(lambda i: hist.observe(0.0003), args.n))
        rounds["pread 4 KiB"].append(pread_cost(4096, args.n // 4))
        rounds["pread 128 KiB"].append(pread_cost(128 << 10, args.n // 20))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    for k, v in med.items():
        print(f"{k:30s} {v * 1e6:8.3f} us per call")
    added = med["record (counters + buckets)"] - med["record before (counters)"]
    print(f"added by the latency buckets: {added * 1e6:.3f} us per card I/O "
          f"(a Histogram.observe would add {med['prometheus Histogram.observe'] * 1e6:.3f} us)")
    for size in ("pread 4 KiB", "pread 128 KiB"):
        print(f"added / {size:13s} = {added / med[size]:.3f}   "
              f"(Histogram.observe / {size}: {med['prometheus Histogram.observe'] / med[size]:.3f})")
    cards = [_Card(f"FS{i:014d}") for i in range(args.cards)]
    per_card = [CardStats() for _ in cards]
    for st in per_card:
        for i in range(1000):
            st.record(i % 2 == 0, True, 4096, 0.0001 * (i % 50))
    metrics = GatewayMetrics(cards, per_card)
    metrics.update(figures(args.cards))
    n = 200
    render = per_call(lambda i: metrics.exposition(), n)
    size = len(metrics.exposition())
    print(f"exposition: {render * 1e3:.2f} ms per render ({size} bytes, {args.cards} cards), once a second "
          f"on the pool: {render:.4f} of one core")


if __name__ == "__main__":
    main()
