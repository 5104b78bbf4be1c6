"""The I/O counters of one card, and its latency histogram per operation: kept by the store
(``ObjectStore.stats``, one per card) from the I/O threads and, a task at a time, from the loop
for the I/O processes' reads; read by STATS, the status file and ``/metrics``."""

from __future__ import annotations

import bisect
import functools
import itertools
import threading
import time
from typing import Sequence

from adpkv_gateway.observe.latency import IO_LATENCY_BUCKETS, LatencyBuckets

_bucket = functools.partial(bisect.bisect_left, IO_LATENCY_BUCKETS)     # a duration's latency bucket


class CardStats:
    """I/O counters of one card (updated from the I/O threads), and its latency histogram per
    operation (``latency.LatencyBuckets``, under the counters' own lock: +0.6 us per I/O where a
    ``prometheus_client.Histogram.observe`` adds 1.6; exported by ``metrics.CardLatencyCollector``
    through ``latency``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reads = self.writes = self.read_errors = self.write_errors = 0
        self.bytes_read = self.bytes_written = 0
        self.io_seconds = 0.0
        self.io_count = 0
        self.io_max_s = 0.0
        self._latency = {"read": LatencyBuckets(), "write": LatencyBuckets()}
        self._inflight: dict[int, float] = {}
        self._ids = itertools.count()

    def begin(self) -> int:
        with self.lock:
            token = next(self._ids)
            self._inflight[token] = time.monotonic()
            return token

    def end(self, token: int, write: bool, ok: bool, nbytes: int) -> float:
        seconds = self.finish(token)
        self.record(write, ok, nbytes, seconds)
        return seconds

    def finish(self, token: int) -> float:
        """End an I/O begun with ``begin`` without accounting it (``record`` does, e.g. for
        each fragment of a batched read); its seconds."""
        with self.lock:
            return time.monotonic() - self._inflight.pop(token)

    def record_reads(self, seconds: Sequence[float], nbytes: int, errors: int) -> None:
        """Account finished reads at once (an I/O process's task): ``seconds`` each, ``nbytes``
        read by those that succeeded, ``errors`` of them failed."""
        if not seconds:
            return
        total, slowest = sum(seconds), max(seconds)
        with self.lock:
            self.reads += len(seconds)
            self.bytes_read += nbytes
            self.read_errors += errors
            self.io_seconds += total
            self.io_count += len(seconds)
            self.io_max_s = max(self.io_max_s, slowest)
            latency = self._latency["read"]
            counts = latency.counts
            for bucket in map(_bucket, seconds):
                counts[bucket] += 1
            latency.seconds += total

    def record(self, write: bool, ok: bool, nbytes: int, seconds: float) -> None:
        """Account one finished I/O (timed elsewhere, e.g. in an I/O process)."""
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
            self._latency["write" if write else "read"].add(seconds)

    def latency(self, op: str) -> tuple[list[int], float]:
        """``op``'s (``read`` or ``write``) I/O count per latency bucket (the last: above every
        bound) and their total seconds, taken together."""
        with self.lock:
            return self._latency[op].copy()

    def oldest_io_age(self) -> float:
        with self.lock:
            return time.monotonic() - min(self._inflight.values()) if self._inflight else 0.0
