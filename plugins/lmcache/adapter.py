"""``AdpL2Adapter``: adpkv as an L2 tier of LMCache's multiprocess server (the facade).

This module is LMCache's ``L2AdapterInterface`` and nothing else: it maps each call
to requests of the adpkv client SDK and keeps the adapter's own state (pins held,
keys stored per ``cache_salt``, counters, the attachment). Its helpers:

- ``copies``: how a task's MemoryObjs reach the gateway: straight to and from
  LMCache's L1 pool when that is a shared-memory region the gateway registered
  (``get_into`` / ``put_from``), otherwise by ring copies in ``on_batch``; one
  request per object size and path;
- ``tasks``: the tasks, one ``adpkv_core.jobs.JobBook`` per kind (ids, results
  handed out once), the three eventfds, and the reading of a finished task per object;
- ``keys``: ObjectKey → adpkv key, and the dialog marks learned from lookups.

The mapping: store → ``put`` / ``put_from``; lookup → one ``exist(lock=True)``
round trip that pins the hits; unlock → ``unlock`` of the pins this adapter holds;
load → ``get`` / ``get_into`` into the caller's MemoryObjs; delete → ``delete``;
get_usage → ``stats`` (cached briefly). When the gateway is not there, or stops
answering, the client turns itself off: lookups and loads miss, stores report
failure, nothing raises into LMCache. The adapter holds its gateway through
``adpkv_core.attachment.Attachment``: its watcher thread re-attaches once the
gateway answers again (``reconnect_s``, doubling to 60 s, the policy of every
adapter) and registers the L1 region on every new attachment before any task
sees it; a task keeps the attachment it started on to its end.

One adpkv gateway serves one engine: each adapter instance attaches as its own
engine (``lmcache-<uuid>``, rank 0 of world 1) and sends independent requests
(no collective tag).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

from lmcache.logging import init_logger

from adpkv_core.attachment import Attachment, Session
from adpkv_core.wire.protocol import GatewayStats
from adpkv_core.settings import ClientConfig

from ._compat import (
    LMCACHE_VERSION,
    AdapterUsage,
    Bitmap,
    L2AdapterInterface,
    L2StoreResult,
    L2TaskId,
    memory_tags,
)
from .config import AdpL2AdapterConfig
from .copies import L1Pool, buffer_of, send
from .keys import KeyMapper, MarkBook
from .tasks import FinishedTask, Task, Tasks, merged_flags, merged_stores

if TYPE_CHECKING:      # the base interface's own types (LMCache imports them the same way)
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

logger = init_logger("adpkv_lmcache")


# ---------------------------------------------------------------------------- adapter
class AdpL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter storing objects in an adpkv gateway (see the module docstring).

    Thread contract (LMCache's ``L2AdapterInterface``): LMCache's store controller and
    prefetch controller call from two threads, so every method is thread-safe. The
    ``submit_*`` calls, ``submit_unlock``, the ``pop``/``query`` calls and the event fd
    getters never block: they send requests and return; a finished task is accounted for on
    the client's I/O thread (``tasks.Tasks``: its kind's book's ``on_finish``) and translated
    into LMCache's result when LMCache collects it. ``delete`` is synchronous (LMCache's
    eviction controller; up to ``timeout_s``), ``get_usage`` asks the gateway at most
    every ``usage_refresh_s`` (up to 1 s), ``close`` waits for the attachment to close.
    Nothing raises into LMCache from a task: a task that cannot run completes as a
    failure (store) or misses (lookup, load).
    """

    config_class_name = "AdpL2AdapterConfig"

    def __init__(self, config: "AdpL2AdapterConfig | dict | None" = None, l1_memory_desc: Any = None,
                 **kwargs: Any):
        if config is None or isinstance(config, dict):
            config = AdpL2AdapterConfig.from_dict({**(config or {}), **kwargs})
        elif kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        super().__init__(max_capacity_bytes=0)   # the gateway evicts by itself
        self._config = config
        self._l1 = L1Pool(l1_memory_desc, config.l1_direct)
        self._keys = KeyMapper(config.namespace, config.key_namespace_from_model)
        self._client_config = ClientConfig.from_settings({**config.client_settings(),
                                                          "namespace": self._keys.namespace})
        self._marks = MarkBook(config.affinity_chunks, config.mark_cache_entries)
        self.engine_id = f"lmcache-{uuid.uuid4().hex[:12]}"
        self._tasks = Tasks({"store": self._store_finished, "lookup": self._lookup_finished,
                             "load": self._load_finished})

        self._lock = threading.Lock()           # guards _counters, _held, _known
        self._counters = {"stores": 0, "stored_keys": 0, "store_failed_keys": 0, "lookups": 0,
                          "lookup_hits": 0, "lookup_keys": 0, "loads": 0, "loaded_keys": 0,
                          "load_missed_keys": 0, "bytes_stored": 0, "bytes_loaded": 0,
                          "region_stored_keys": 0, "region_loaded_keys": 0}
        # pins held on the gateway through this adapter (adpkv key -> count)
        self._held: dict[bytes, int] = {}
        # keys this instance stored: adpkv key -> (cache_salt, size), for per-salt accounting
        self._known: dict[bytes, tuple[str, int]] = {}
        self._usage_cache: Optional[tuple[float, GatewayStats]] = None
        self._stop = threading.Event()          # set when close() begins: new tasks fail fast
        layout: dict[str, str | int] = {"engine": "lmcache", "lmcache_version": LMCACHE_VERSION,
                                        "namespace": self._keys.namespace}
        if l1_memory_desc is not None:
            layout["l1_bytes"] = int(getattr(l1_memory_desc, "size", 0) or 0)
        self._attachment = Attachment(self._client_config, self.engine_id, 0, 1, layout,
                                      reconnect_s=config.reconnect_s, on_attach=self._on_attach,
                                      name="adpkv-lmc")
        first = self._attachment.session
        # attach_now (the default): the constructor attached, so a session is installed (enabled
        # or not); only close() takes it away
        assert first is not None
        if not first.enabled:
            logger.warning("adpkv L2 adapter: no gateway on %s:%d (%s); lookups miss and stores fail until "
                           "it is reachable", config.host, config.port,
                           first.client.attach_error or "no answer")
        logger.info("AdpL2Adapter %s (lmcache %s): gateway %s:%d, namespace %r, affinity_chunks %d, %s",
                    self.engine_id, LMCACHE_VERSION, config.host, config.port, self._keys.namespace,
                    config.affinity_chunks, "attached" if first.enabled else "NOT attached")

    # ------------------------------------------------------------------ attachments
    def _on_attach(self, s: Session) -> None:
        """Every new attachment (the first, and each after the gateway came back), before any
        task sees it: pins of an old one are gone with it; LMCache's L1 pool is registered
        again (regions go with the gateway process). Runs on the constructor's thread, then
        on the attachment's watcher thread; may block up to ``connect_timeout_s``."""
        with self._lock:
            self._held.clear()
        self._l1.register(s, self._config.connect_timeout_s)

    def _current(self) -> Optional[Session]:
        """The session a new task uses to its end, or None once close() has begun."""
        return None if self._stop.is_set() else self._attachment.session

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counters[name] += d

    # ------------------------------------------------------------------ event fds
    def get_store_event_fd(self) -> int:
        return self._tasks.fd("store")

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._tasks.fd("lookup")

    def get_load_event_fd(self) -> int:
        return self._tasks.fd("load")

    # ------------------------------------------------------------------ store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        try:
            return self._start_store(list(keys), list(objects))
        except Exception:
            tid = self._tasks.submit("store", [], Task(list(keys)), failed=True)
            logger.exception("adpkv store task %d failed to start", tid)
            return tid

    def _start_store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        n = len(keys)
        if n == 0:
            return self._tasks.submit("store", [], Task(keys))
        s = self._current()
        if s is None or not s.enabled:
            self._count(store_failed_keys=n)
            return self._tasks.submit("store", [], Task(keys), failed=True)
        adp = self._keys.keys(keys)
        bufs = [buffer_of(o) for o in objects]
        parts, direct = send(s, self._l1, "PUT", adp, self._marks.marks(adp), bufs)
        self._count(region_stored_keys=direct)
        task = Task(keys, adp, [b[1] for b in bufs], [idx for idx, _ in parts], s)
        return self._tasks.submit("store", [f for _, f in parts], task)

    @staticmethod
    def _stored(job: FinishedTask) -> tuple[list[bool], list[bool], int]:
        """``(stored, existed, bytes written)`` of a finished store task: an object the gateway
        held already (keys name content) was not written again and counts no bytes."""
        stored, existed = merged_stores(job)
        nbytes = sum(size for ok, held, size in zip(stored, existed, job.meta.sizes) if ok and not held)
        return stored, existed, nbytes

    def _store_finished(self, job: FinishedTask) -> None:
        """A store task finished (the client's I/O thread): counters, keys per salt, listeners.
        A task that sent no request was counted when it was submitted."""
        if not job.results:
            return
        t = job.meta
        stored, _, nbytes = self._stored(job)
        new_keys, new_sizes = [], []
        with self._lock:
            for i, ok in enumerate(stored):
                if ok and t.adp[i] not in self._known:
                    self._known[t.adp[i]] = (t.keys[i].cache_salt, t.sizes[i])
                    new_keys.append(t.keys[i])
                    new_sizes.append(t.sizes[i])
            ok_count = sum(stored)
            self._counters["stores"] += 1
            self._counters["stored_keys"] += ok_count
            self._counters["store_failed_keys"] += len(stored) - ok_count
            self._counters["bytes_stored"] += nbytes
        if new_keys:
            try:
                self._notify_keys_stored(new_keys, new_sizes)
            except Exception:
                logger.exception("L2 listener failed on stored keys")

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        out = {}
        for job in self._tasks.pop_all("store"):
            stored, _, nbytes = self._stored(job)
            out[job.id] = L2StoreResult(not job.failed and all(stored), nbytes)
        return out

    # ------------------------------------------------------------------ lookup and lock
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: "dict[int, MemoryLayoutDesc] | MemoryLayoutDesc | None" = None
                                    ) -> L2TaskId:
        # group_layout_descs (0.5.6: dict per object group; 0.5.0: one MemoryLayoutDesc) is advisory.
        try:
            return self._start_lookup(list(keys))
        except Exception:
            tid = self._tasks.submit("lookup", [], Task(list(keys)), failed=True)
            logger.exception("adpkv lookup task %d failed to start", tid)
            return tid

    def _start_lookup(self, keys: list[ObjectKey]) -> L2TaskId:
        n = len(keys)
        s = self._current()
        if n == 0 or s is None or not s.enabled:
            return self._tasks.submit("lookup", [], Task(keys))
        adp = self._keys.keys(keys)
        marks = self._marks.marks_for_lookup(keys, adp)
        fut = s.client.exist(adp, marks=marks, lock=True)
        return self._tasks.submit("lookup", [fut], Task(keys, adp, covers=[range(n)], session=s))

    def _lookup_finished(self, job: FinishedTask) -> None:
        """A lookup task finished (the client's I/O thread, or inline when its EXIST resolved at
        once): the pins it took, while its attachment is the current one; counters."""
        if not job.results:
            return
        t = job.meta
        hits = [i for i, h in enumerate(merged_flags(job)) if h]
        with self._lock:
            if self._attachment.session is t.session:
                for i in hits:
                    self._held[t.adp[i]] = self._held.get(t.adp[i], 0) + 1
            self._counters["lookups"] += 1
            self._counters["lookup_keys"] += len(t.keys)
            self._counters["lookup_hits"] += len(hits)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Optional[Bitmap]:
        job = self._tasks.pop("lookup", task_id)
        return _bitmap(job) if job is not None else None

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        try:
            adp = self._keys.keys(keys)
            release = []
            with self._lock:
                for k in adp:
                    c = self._held.get(k, 0)
                    if c <= 0:
                        continue   # not pinned through us (a miss, or already released by its load)
                    if c == 1:
                        del self._held[k]
                    else:
                        self._held[k] = c - 1
                    release.append(k)
            s = self._current()   # pins are released by this explicit unlock only (GETs keep them)
            if release and s is not None and s.enabled:
                s.client.unlock(release)
            # A gateway that went away took its pins with it; nothing to retry.
        except Exception:
            logger.exception("adpkv unlock failed")

    # ------------------------------------------------------------------ load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        try:
            return self._start_load(list(keys), list(objects))
        except Exception:
            tid = self._tasks.submit("load", [], Task(list(keys)), failed=True)
            logger.exception("adpkv load task %d failed to start", tid)
            return tid

    def _start_load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        n = len(keys)
        s = self._current()
        if n == 0 or s is None or not s.enabled:
            if n:
                self._count(load_missed_keys=n)
            return self._tasks.submit("load", [], Task(keys))
        bufs = [buffer_of(o) for o in objects]
        adp = self._keys.keys(keys)
        parts, direct = send(s, self._l1, "GET", adp, self._marks.marks(adp), bufs)
        self._count(region_loaded_keys=direct)
        task = Task(keys, adp, [b[1] for b in bufs], [idx for idx, _ in parts], s)
        return self._tasks.submit("load", [f for _, f in parts], task)

    def _load_finished(self, job: FinishedTask) -> None:
        """A load task finished (the client's I/O thread): counters, listeners. Pins stay until
        LMCache's explicit submit_unlock (GET without unlock=True)."""
        if not job.results:
            return
        t = job.meta
        hits = [i for i, h in enumerate(merged_flags(job)) if h]
        with self._lock:
            self._counters["loads"] += 1
            self._counters["loaded_keys"] += len(hits)
            self._counters["load_missed_keys"] += len(t.keys) - len(hits)
            self._counters["bytes_loaded"] += sum(t.sizes[i] for i in hits)
        if hits:
            try:
                self._notify_keys_accessed([t.keys[i] for i in hits])
            except Exception:
                logger.exception("L2 listener failed on accessed keys")

    def query_load_result(self, task_id: L2TaskId) -> Optional[Bitmap]:
        job = self._tasks.pop("load", task_id)
        return _bitmap(job) if job is not None else None

    # ------------------------------------------------------------------ LMCache >= 0.5.7
    def get_memory_tags(self) -> Any:
        """Where the objects live (LMCache >= 0.5.7, prefetch target filtering and L1-L2
        affinity): ``STORAGE``, ``LOCAL``, or ``REMOTE`` when the adapter's spec says
        ``"shared": true`` (LMCache's own field of every ``--l2-adapter``, which its storage
        manager hands the adapter through ``set_backend_identity``: cards shared with other
        hosts, such as a shared file system or a Redis server or cluster; ``_compat.memory_tags``)."""
        return memory_tags(bool(getattr(self, "_shared", False)))

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """Mark ``keys`` accessed without moving bytes (LMCache >= 0.5.7: a load served from L1
        refreshes L2's recency too). LMCache's eviction listeners learn of the access; the
        gateway keeps its own LRU, which its reads refresh (a lookup does not), so nothing goes
        to it. Never blocks, never raises into LMCache."""
        if not keys:
            return
        try:
            self._notify_keys_accessed(list(keys))
        except Exception:
            logger.exception("L2 listener failed on touched keys")

    # ------------------------------------------------------------------ delete / usage / status
    def delete(self, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        try:
            adp = self._keys.keys(keys)
            s = self._current()
            if s is not None and s.enabled:
                try:
                    s.client.delete(adp, marks=self._marks.marks(adp)).result(timeout=self._config.timeout_s)
                except Exception as exc:
                    logger.warning("adpkv delete of %d keys failed: %s", len(adp), exc)
                    return
            gone_keys, gone_sizes = [], []
            with self._lock:
                for k, a in zip(keys, adp):
                    info = self._known.pop(a, None)
                    if info is not None:
                        gone_keys.append(k)
                        gone_sizes.append(info[1])
            if gone_keys:
                self._notify_keys_deleted(gone_keys, gone_sizes)
        except Exception:
            logger.exception("adpkv delete failed")

    def _gateway_stats(self) -> Optional[GatewayStats]:
        now = time.monotonic()
        cached = self._usage_cache
        if cached is not None and now - cached[0] < self._config.usage_refresh_s:
            return cached[1]
        s = self._current()
        if s is None or not s.enabled:
            return cached[1] if cached else None
        try:
            stats = s.client.stats().result(timeout=min(1.0, self._config.timeout_s))
        except Exception:
            stats = None
        if stats is not None:
            self._usage_cache = (now, stats)
            return stats
        return cached[1] if cached else None

    def get_usage(self) -> AdapterUsage:
        """Bytes on the gateway's cards (all cards, from STATS) and this instance's bytes per cache_salt.

        The per-salt split is what this adapter instance stored (the gateway does
        not know salts); objects the gateway evicts on its own stay counted there
        until deleted through LMCache.
        """
        base = super().get_usage()
        stats = self._gateway_stats()
        if stats is None:
            return base
        used = sum(c.used_bytes for c in stats.cards)
        cap = sum(c.capacity_bytes for c in stats.cards)
        return AdapterUsage(total_bytes_used=used, total_capacity_bytes=cap,
                            bytes_by_cache_salt=base.bytes_by_cache_salt)

    def report_status(self) -> dict:
        s = self._attachment.session
        attached = s is not None and s.enabled
        in_flight = self._tasks.in_flight()
        with self._lock:
            counters = dict(self._counters)
            held = sum(self._held.values())
        healthy = attached and not self._tasks.closed
        status = {
            "is_healthy": healthy,
            "type": "AdpL2Adapter",
            "engine_id": self.engine_id,
            "gateway": f"{self._config.host}:{self._config.port}",
            "attached": attached,
            "namespace": self._keys.namespace,
            "affinity_chunks": self._config.affinity_chunks,
            "reconnects": self._attachment.reattaches,
            "in_flight": in_flight,
            "pinned_keys": held,
            "known_marks": len(self._marks),
            "l1_region": self._l1.path if s is not None and self._l1.region(s) is not None else None,
            "counters": counters,
        }
        if s is not None and s.client.attach_error:
            status["attach_error"] = s.client.attach_error
        if not healthy:
            status["extra_warning"] = ("adpkv gateway not attached: lookups miss and stores fail; "
                                       "LMCache serves from L1")
        return status

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        if self._tasks.closed:
            return
        self._stop.set()
        s = self._attachment.session
        with self._lock:
            held = list(self._held)
            self._held.clear()
        if held and s is not None and s.enabled:
            try:
                s.client.unlock(held).result(timeout=1.0)
            except Exception:
                pass
        self._attachment.close()   # fails what is still in flight: the callbacks record misses
        self._tasks.close()
        logger.info("AdpL2Adapter %s closed", self.engine_id)


def _bitmap(job: FinishedTask) -> Bitmap:
    """LMCache's result of a lookup or load task: its objects found / read."""
    bm = Bitmap(len(job.meta.keys))
    hits = [i for i, h in enumerate(merged_flags(job)) if h]
    if hits:
        bm.batched_set(hits)
    return bm
