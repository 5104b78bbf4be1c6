"""Latency histograms as the gateway counts them: durations per bucket and their sum, kept
where they happen (a card's I/O under its counters' lock, a request's on the loop) at a fraction
of the cost of a ``prometheus_client.Histogram`` (benchmarks/metrics_overhead.py), and handed to
the exposition (``gateway/observe/metrics.py``, ``gateway/observe/status.py``) as histogram buckets."""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence

# Upper bounds (seconds) of the latency buckets: a page-cache read of a small
# object (tens of microseconds) to a card or a request past any sane io_timeout_ms.
IO_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                      0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BUCKET_BOUNDS = [str(float(b)) for b in IO_LATENCY_BUCKETS] + ["+Inf"]     # the histograms' "le" labels


class LatencyBuckets:
    """Durations counted per bucket of ``IO_LATENCY_BUCKETS`` (the first bound at or above each,
    the last slot for those above every bound) and their sum. Not locked: its owner holds a lock
    or is one thread."""

    __slots__ = ("counts", "seconds")

    def __init__(self):
        self.counts = [0] * (len(IO_LATENCY_BUCKETS) + 1)
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(IO_LATENCY_BUCKETS, seconds)] += 1
        self.seconds += seconds

    def copy(self) -> tuple[list[int], float]:
        return list(self.counts), self.seconds


def histogram_buckets(counts: Sequence[int]) -> list[tuple[str, int]]:
    """``HistogramMetricFamily`` buckets (cumulative, by ``le``) of ``LatencyBuckets`` counts."""
    return list(zip(BUCKET_BOUNDS, itertools.accumulate(counts)))


