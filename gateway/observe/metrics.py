"""The gateway's metrics: one ``prometheus_client`` registry per gateway, rendered into the
status file (for the node exporter's textfile collector) and, when ``metrics_port`` is set,
served at ``http://metrics_address:metrics_port/metrics``.

Two kinds of collectors feed the registry:

- the gateway's figures (what STATS answers, taken once a second by the loop and the pool):
  every function of ``FROM_FIGURES`` maps those figures to metric families
  (``gateway/observe/status.py`` holds the gateway's own, with the names the specification defines);
- what the I/O threads count as it happens: each card's I/O latency buckets per operation
  (``CardStats.latency``, ``gateway/observe/latency.py``: kept under the card's counter lock, cheaper on
  the I/O path than a ``prometheus_client.Histogram``, see benchmarks/metrics_overhead.py),
  exported by ``CardLatencyCollector`` as a histogram under the card's current serial, at each
  scrape. (The requests' latency is a figure: ``stats.py`` copies it on the loop.)

To add metrics, either append ``fn(figures) -> iterable of metric families`` to
``FROM_FIGURES`` (the figures are what STATS answers, ``adpkv_core.wire.protocol.GatewayStats``:
put what you need into it there and in ``gateway/loop/stats.py``), or register a ``prometheus_client`` collector of your own on
``Gateway.metrics.registry`` (an object whose ``collect()`` yields metric families; it runs in
the status writer's pool thread and in the /metrics server's thread, so it must only read
state that is safe to read from there).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, generate_latest, start_http_server, write_to_textfile
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from adpkv_core.wire.protocol import GatewayStats

from adpkv_gateway.observe.latency import histogram_buckets
from adpkv_gateway.observe.status import FAMILIES, PREFIX

logger = logging.getLogger("adpkv.gateway.metrics")

IO_OPS = ("read", "write")

FigureFamilies = Callable[[GatewayStats], Iterable[Metric]]
FROM_FIGURES: list[FigureFamilies] = list(FAMILIES)     # gateway/observe/status.py's, and whoever adds metrics


class FiguresCollector:
    """The families of ``FROM_FIGURES`` over the latest figures (none before the first), after
    ``adpkv_gateway_up`` (1 while the gateway serves, 0 once it stopped: the last status file
    a stop writes says so) and ``adpkv_gateway_updated_timestamp_seconds`` (the Unix time the
    figures were taken, once a second while the gateway runs: a value that stops moving is a
    gateway that died or hangs; deploy/prometheus/adpkv-alerts.yaml)."""

    def __init__(self) -> None:
        self.figures: Optional[GatewayStats] = None
        self.taken = 0.0
        self.up = True

    def collect(self) -> Iterable[Metric]:
        figures = self.figures
        if figures is None:
            return
        yield GaugeMetricFamily(PREFIX + "up", "The gateway is serving (0: it stopped)", int(self.up))
        yield GaugeMetricFamily(PREFIX + "updated_timestamp_seconds", "Unix time the gateway took these figures "
                                "(once a second while it runs)", self.taken)
        for families in FROM_FIGURES:
            yield from families(figures)


class CardLatencyCollector:
    """``adpkv_gateway_storage_io_seconds{group=<card serial>, op=read|write}``: each card's
    latency buckets (``CardStats.latency``) as a Prometheus histogram, labelled with the card's
    serial as it is now (a card that was not available at start gets its serial when it joins)."""

    def __init__(self, cards: Sequence, card_stats: Sequence):
        self.cards = cards
        self.card_stats = card_stats

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(PREFIX + "storage_io_seconds",
                                       "Card I/O latency by card and operation (a batched read: "
                                       "each fragment its share)", labels=["group", "op"])
        for card, stats in zip(self.cards, self.card_stats):
            for op in IO_OPS:
                counts, seconds = stats.latency(op)
                family.add_metric([card.serial or card.device, op], histogram_buckets(counts), seconds)
        yield family


def status_file_problem(path: str) -> str:
    """Why the gateway could not write its status file at ``path`` ("" when it can): its
    directory is missing, is no directory, or this user may not create files in it (the
    file is replaced by a rename within the directory)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a directory"
        return f"status_file {path}: its directory {directory} {what}; create it, or set status_file elsewhere"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (f"status_file {path}: this user (uid {os.geteuid()}) may not create files in {directory}; "
                "give it write access, or set status_file elsewhere")
    if os.path.isdir(path):
        return f"status_file {path} is a directory; name a file (the node exporter reads *.prom)"
    return ""


class GatewayMetrics:
    """The registry of one gateway and where it goes: the status file and /metrics."""

    def __init__(self, cards: Sequence, card_stats: Sequence):
        self.registry = CollectorRegistry(auto_describe=False)
        self._figures = FiguresCollector()
        self.registry.register(self._figures)
        self.registry.register(CardLatencyCollector(cards, card_stats))
        self._server: Optional[Any] = None     # the WSGI server of /metrics, once serving
        self._server_thread: Optional[threading.Thread] = None

    def update(self, figures: GatewayStats) -> None:
        """The gateway's latest figures (what STATS answers); any thread."""
        self._figures.figures = figures
        self._figures.taken = time.time()

    def stopped(self) -> None:
        """The gateway stopped serving: ``adpkv_gateway_up`` is 0 from now on."""
        self._figures.up = False

    def exposition(self) -> bytes:
        """The Prometheus text exposition of everything in the registry."""
        return generate_latest(self.registry)

    def write_textfile(self, path: str) -> None:
        """Replace ``path`` atomically with the exposition (the node exporter's textfile
        collector reads files ending in ``.prom``)."""
        write_to_textfile(path, self.registry)

    def serve(self, address: str, port: int) -> None:
        """Serve ``/metrics`` on ``address:port`` from a thread of its own. A port that cannot
        be had leaves the gateway serving without it (one warning): metrics never stop the cache."""
        try:
            self._server, self._server_thread = start_http_server(port, address, self.registry)
        except OSError as exc:
            logger.warning("Metrics endpoint off: cannot listen on %s:%d: %s", address, port, exc)
            return
        logger.info("Metrics at http://%s:%d/metrics", address, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._server_thread is not None:
                self._server_thread.join(5)
            self._server = self._server_thread = None
