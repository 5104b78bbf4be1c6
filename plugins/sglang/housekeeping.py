"""Housekeeping of the SGLang backend: what it counts and reports, and ``clear``.

- ``Tally``: the backend's counters (``AdpHiCacheStorage.counters``) and the samples of
  SGLang's ``StorageMetrics`` (pages per batch, GiB/s) that ``get_stats()`` hands out
  and resets. Samples are kept only with SGLang's metrics on
  (``enable_storage_metrics``), at most ``METRICS_CAP`` per series between two
  ``get_stats()`` calls.
- ``clear``: SGLang's ``POST /hicache/storage-backend/clear``: CLEAN of the gateway's
  cards (the gateway refuses it on shared storage).

Threads: ``Tally.count`` / ``record`` run on the SGLang thread that made the request
(prefetch, prefetch I/O, backup), without a lock: they are diagnostics, and two threads
counting at once may lose an increment (never a page). ``get_stats`` runs on
SGLang's metrics thread. ``clear`` runs on the HTTP server's thread and blocks until the
gateway answered (at most ``timeout_s``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from adpkv_core.attachment import Session

logger = logging.getLogger("adpkv.sglang")

METRICS_CAP = 10000

COUNTERS = ("exist_requests", "get_requests", "put_requests", "pages_read", "pages_written",
            "pages_skipped_nonwriter", "pages_rewritten", "groups_rejected",
            "pages_read_in_place", "pages_written_in_place")     # in place: a pool in shared memory (shm)


class Tally:
    """Counters and ``StorageMetrics`` samples of one backend instance."""

    def __init__(self, enable_metrics: bool):
        self.enable_metrics = bool(enable_metrics)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def record(self, kind: str, pages: int, seconds: float, page_bytes: int) -> None:
        """One batch of ``kind`` (``prefetch`` or ``backup``): pages moved and its bandwidth."""
        if not self.enable_metrics or pages <= 0:
            return
        pgs, bw = self._metrics[kind + "_pgs"], self._metrics[kind + "_bandwidth"]
        if len(pgs) < METRICS_CAP:
            pgs.append(pages)
            bw.append(pages * page_bytes / (1 << 30) / max(seconds, 1e-9))

    def storage_metrics(self):
        """SGLang's ``StorageMetrics`` of the samples since the last call (None without SGLang's
        metrics module)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        m = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(m, name).extend(values)
            values.clear()
        return m


def clear(live: Callable[[], Optional[Session]]) -> bool:
    """Delete every object on the gateway's cards (``live()``: the backend's session, or None);
    False (logged) without a gateway, when the gateway refuses (shared storage), or on an error."""
    try:
        s = live()
        if s is None:
            logger.warning("adpkv: clear: no gateway; nothing was deleted")
            return False
        deleted = s.client.clean().result()
        if deleted is None:        # the client logged the gateway's reason
            logger.warning("adpkv: clear refused by the gateway; nothing was deleted")
            return False
        logger.info("adpkv: cleared the gateway's cards (%d objects)", deleted)
        return True
    except Exception:
        logger.exception("adpkv: clear failed")
        return False
