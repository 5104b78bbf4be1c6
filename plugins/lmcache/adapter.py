"""``AdpL2Adapter``: adpkv as an L2 tier of LMCache's multiprocess server.

Every operation of the L2 interface becomes one or a few requests of the adpkv
client SDK (``adpkv_core.client.GatewayClient``), which are non-blocking and
complete on the client's I/O thread:

- store  → ``put``: ``on_batch`` copies each MemoryObj into its ring slot
  (one tensor copy, no ``bytes``); the gateway writes the slots to the card.
- lookup → ``exist(lock=True)``: one round trip per task, pins the hits.
- unlock → ``unlock`` of the pins this adapter holds.
- load   → ``get``: the gateway reads into ring slots, ``on_batch`` copies each
  hit straight into the caller's MemoryObj buffer.
- delete → ``delete``; get_usage → ``stats`` (cached briefly).

When LMCache's L1 pool is a shared-memory file (``lmcache server --shm-name``
allocates it in ``/dev/shm``), the adapter registers it with the gateway as a
region and objects inside it skip the ring: loads are read from the card
straight into their L1 buffers and stores written from them (``get_into`` /
``put_from``), one copy in all. Objects elsewhere (anonymous L1 memory, the
server's default and ``lmcache bench l2``'s buffer) go through the ring as above.

Objects of a task that differ in size go out as one request per size. Results
land in per-kind dicts under one lock and the kind's eventfd is signalled;
each result is handed out once. When the gateway is not there, or stops
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
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from lmcache.logging import init_logger

from adpkv_core.attachment import Attachment, RingView, Session
from adpkv_core.client import RingBatch
from adpkv_core.regions import SharedFile, shared_file_of
from adpkv_core.settings import ClientConfig

from ._compat import (
    LMCACHE_VERSION,
    AdapterUsage,
    Bitmap,
    L2AdapterInterface,
    L2StoreResult,
    L2TaskId,
    create_event_notifier,
)
from .config import AdpL2AdapterConfig
from .keys import KeyMapper, MarkBook

logger = init_logger("adpkv_lmcache")

# ---------------------------------------------------------------------------- buffers
def _buffer(obj) -> tuple[int, int, Any]:
    """(address, size, keepalive) of the logical bytes of a MemoryObj (no copy)."""
    size = int(obj.get_size())
    raw = getattr(obj, "raw_data", None)
    if isinstance(raw, torch.Tensor):
        if raw.device.type != "cpu" or not raw.is_contiguous():
            raise ValueError("adpkv L2 adapter needs contiguous host-memory objects")
        if raw.numel() * raw.element_size() < size:
            raise ValueError(f"MemoryObj reports {size} bytes but its buffer holds fewer")
        return raw.data_ptr(), size, raw
    # Other MemoryObj kinds expose their bytes through the buffer protocol.
    arr = np.frombuffer(obj.byte_array, dtype=np.uint8)
    if arr.nbytes < size:
        raise ValueError(f"MemoryObj reports {size} bytes but its buffer holds fewer")
    return arr.ctypes.data, size, arr


def _copier(ring: RingView, bufs: Sequence[tuple], op: str) -> Callable[[RingBatch], bool]:
    """The ``on_batch`` of a ring GET/PUT: objects between the ring slots and LMCache's buffers
    (bufs: (address, size, keepalive)); the closure keeps the buffers referenced while the
    request lives."""
    addrs = [b[0] for b in bufs]
    if op == "PUT":
        return lambda batch: ring.fill(batch, addrs) and bufs is not None
    return lambda batch: ring.drain(batch, addrs) and bufs is not None


def _group_by_size(sizes: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    return groups


def _gather(futures: list[Future], on_all_done: Callable[[], None]) -> None:
    """Call ``on_all_done`` once every future is done (on the thread that finishes last)."""
    if not futures:
        on_all_done()
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_f):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            on_all_done()

    for f in futures:
        f.add_done_callback(one_done)


def _existed(f: Future, n: int) -> list[bool]:
    """PUT only: which keys the gateway had already (``StoreFlags.existed``)."""
    try:
        ex = getattr(f.result(timeout=0), "existed", None)
    except Exception:
        ex = None
    if not isinstance(ex, list) or len(ex) != n:
        return [False] * n
    return [bool(x) for x in ex]


def _flags(f: Future, n: int) -> list[bool]:
    try:
        r = f.result(timeout=0)
    except Exception:
        return [False] * n
    if not isinstance(r, list) or len(r) != n:
        return [False] * n
    return [bool(x) for x in r]


# ---------------------------------------------------------------------------- adapter
class AdpL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter storing objects in an adpkv gateway (see module docstring)."""

    config_class_name = "AdpL2AdapterConfig"

    def __init__(self, config: "AdpL2AdapterConfig | dict | None" = None, l1_memory_desc: Any = None,
                 **kwargs: Any):
        if config is None or isinstance(config, dict):
            config = AdpL2AdapterConfig.from_dict({**(config or {}), **kwargs})
        elif kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        super().__init__(max_capacity_bytes=0)   # the gateway evicts by itself
        self._config = config
        self._l1_memory_desc = l1_memory_desc
        self._l1 = self._find_l1_file(l1_memory_desc) if config.l1_direct else None
        self._keys = KeyMapper(config.namespace, config.key_namespace_from_model)
        self._client_config = ClientConfig.from_settings({**config.client_settings(),
                                                          "namespace": self._keys.namespace})
        self._marks = MarkBook(config.affinity_chunks, config.mark_cache_entries)
        self.engine_id = f"lmcache-{uuid.uuid4().hex[:12]}"

        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()

        self._lock = threading.Lock()
        self._next_task_id: L2TaskId = 0
        self._done_store: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookup: dict[L2TaskId, Bitmap] = {}
        self._done_load: dict[L2TaskId, Bitmap] = {}
        self._in_flight = {"store": 0, "lookup": 0, "load": 0}
        self._counters = {"stores": 0, "stored_keys": 0, "store_failed_keys": 0, "lookups": 0,
                          "lookup_hits": 0, "lookup_keys": 0, "loads": 0, "loaded_keys": 0,
                          "load_missed_keys": 0, "bytes_stored": 0, "bytes_loaded": 0,
                          "region_stored_keys": 0, "region_loaded_keys": 0}
        # pins held on the gateway through this adapter (adpkv key -> count)
        self._held: dict[bytes, int] = {}
        # keys this instance stored: adpkv key -> (cache_salt, size), for per-salt accounting
        self._known: dict[bytes, tuple[str, int]] = {}
        self._usage_cache: Optional[tuple[float, dict]] = None
        self._closed = False
        self._stop = threading.Event()          # set when close() begins: new tasks fail fast
        layout = {"engine": "lmcache", "lmcache_version": LMCACHE_VERSION, "namespace": self._keys.namespace}
        if l1_memory_desc is not None:
            layout["l1_bytes"] = int(getattr(l1_memory_desc, "size", 0) or 0)
        self._attachment = Attachment(self._client_config, self.engine_id, 0, 1, layout,
                                      reconnect_s=config.reconnect_s, on_attach=self._on_attach,
                                      name="adpkv-lmc")
        first = self._attachment.session
        if not first.enabled:
            logger.warning("adpkv L2 adapter: no gateway on %s:%d (%s); lookups miss and stores fail until "
                           "it is reachable", config.host, config.port,
                           first.client.attach_error or "no answer")
        logger.info("AdpL2Adapter %s (lmcache %s): gateway %s:%d, namespace %r, affinity_chunks %d, %s",
                    self.engine_id, LMCACHE_VERSION, config.host, config.port, self._keys.namespace,
                    config.affinity_chunks, "attached" if first.enabled else "NOT attached")

    # ------------------------------------------------------------------ attachments
    def _on_attach(self, s: Session) -> None:
        """Every new attachment (the first, and each after the gateway came back): pins of an
        old one are gone with it; LMCache's L1 pool is registered again (regions go with the
        gateway process)."""
        with self._lock:
            self._held.clear()
        s.state["region"] = None
        if self._l1 is None:
            return
        try:
            s.state["region"] = s.client.register_region(self._l1.path, self._l1.offset, self._l1_memory_desc.size
                                                         ).result(self._config.connect_timeout_s)
        except Exception:
            s.state["region"] = None
        if s.state["region"] is None:
            logger.warning("adpkv L2 adapter: the gateway did not map LMCache's L1 pool %s; "
                           "loads and stores go through the ring", self._l1.path)

    @staticmethod
    def _find_l1_file(desc: Any) -> Optional[SharedFile]:
        """The /dev/shm file of LMCache's L1 pool, when it is one (else None: the ring path)."""
        ptr, size = int(getattr(desc, "ptr", 0) or 0), int(getattr(desc, "size", 0) or 0)
        found = shared_file_of(ptr, size) if ptr and size else None
        if found is not None:
            logger.info("adpkv L2 adapter: LMCache's L1 pool is %s; the gateway reads and writes it directly",
                        found.path)
        elif ptr and size:
            logger.info("adpkv L2 adapter: LMCache's L1 is not in shared memory, so objects go through the "
                        "gateway's ring (one copy more); start the server with --shm-name NAME to let the "
                        "gateway read into L1 directly")
        return found

    def _current(self) -> Optional[Session]:
        """The session a new task uses to its end, or None once close() has begun."""
        return None if self._stop.is_set() else self._attachment.session

    # ------------------------------------------------------------------ bookkeeping
    def _in_l1(self, s: Session, buf: tuple) -> bool:
        return s.state.get("region") is not None and 0 <= buf[0] - self._l1_memory_desc.ptr <= self._l1_memory_desc.size - buf[1]

    def _per_size(self, s: Session, adp: list, bufs: list, op: str) -> list[tuple[list[int], Future]]:
        """One GET or PUT per object size and path (straight to the L1 region, or through the
        ring): ``(indices, future)`` each."""
        marks = self._marks.marks(adp)
        parts: list[tuple[list[int], Future]] = []
        for size, idx in _group_by_size([b[1] for b in bufs]).items():
            direct, ringed = [], []
            for i in idx:
                (direct if self._in_l1(s, bufs[i]) else ringed).append(i)
            for sub in (direct, ringed):
                if not sub:
                    continue
                keys = [adp[i] for i in sub]
                sub_marks = [marks[i] for i in sub] if marks is not None else None
                if sub is direct:
                    at = [bufs[i][0] - self._l1_memory_desc.ptr for i in sub]
                    call = s.client.get_into if op == "GET" else s.client.put_from
                    fut = call(s.state["region"], at, keys, size, marks=sub_marks)
                else:
                    call = s.client.get if op == "GET" else s.client.put
                    fut = call(keys, size, _copier(s.ring, [bufs[i] for i in sub], op), marks=sub_marks)
                parts.append((sub, fut))
            with self._lock:
                self._counters["region_" + ("loaded" if op == "GET" else "stored") + "_keys"] += len(direct)
        return parts

    def _new_task(self, kind: str) -> L2TaskId:
        with self._lock:
            tid = self._next_task_id
            self._next_task_id += 1
            self._in_flight[kind] += 1
        return tid

    def _finish(self, kind: str, tid: L2TaskId, result: Any) -> None:
        with self._lock:
            self._in_flight[kind] -= 1
            if self._closed:
                return
            {"store": self._done_store, "lookup": self._done_lookup, "load": self._done_load}[kind][tid] = result
        efd = {"store": self._store_efd, "lookup": self._lookup_efd, "load": self._load_efd}[kind]
        try:
            efd.notify()
        except OSError:
            pass  # closed under us

    # ------------------------------------------------------------------ event fds
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------------ store
    def submit_store_task(self, keys: list, objects: list) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        tid = self._new_task("store")
        try:
            self._start_store(tid, list(keys), list(objects))
        except Exception:
            logger.exception("adpkv store task %d failed to start", tid)
            self._finish("store", tid, L2StoreResult(False, 0))
        return tid

    def _start_store(self, tid: L2TaskId, keys: list, objects: list) -> None:
        n = len(keys)
        if n == 0:
            self._finish("store", tid, L2StoreResult(True, 0))
            return
        s = self._current()
        if s is None or not s.enabled:
            with self._lock:
                self._counters["store_failed_keys"] += n
            self._finish("store", tid, L2StoreResult(False, 0))
            return
        adp = self._keys.keys(keys)
        bufs = [_buffer(o) for o in objects]
        sizes = [b[1] for b in bufs]
        parts = self._per_size(s, adp, bufs, "PUT")

        def done() -> None:
            stored = [False] * n
            existed = [False] * n
            for idx, fut in parts:
                flags = _flags(fut, len(idx))
                ex = _existed(fut, len(idx))
                for j, i in enumerate(idx):
                    stored[i] = flags[j]
                    existed[i] = flags[j] and ex[j]
            new_keys, new_sizes = [], []
            nbytes = 0
            with self._lock:
                for i, ok in enumerate(stored):
                    if not ok:
                        continue
                    if not existed[i]:     # already stored (keys name content): nothing written
                        nbytes += sizes[i]
                    if adp[i] not in self._known:
                        self._known[adp[i]] = (keys[i].cache_salt, sizes[i])
                        new_keys.append(keys[i])
                        new_sizes.append(sizes[i])
                ok_count = sum(stored)
                self._counters["stores"] += 1
                self._counters["stored_keys"] += ok_count
                self._counters["store_failed_keys"] += n - ok_count
                self._counters["bytes_stored"] += nbytes
            if new_keys:
                try:
                    self._notify_keys_stored(new_keys, new_sizes)
                except Exception:
                    logger.exception("L2 listener failed on stored keys")
            self._finish("store", tid, L2StoreResult(all(stored), nbytes))

        _gather([f for _, f in parts], done)

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._done_store = self._done_store, {}
        return done

    # ------------------------------------------------------------------ lookup and lock
    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: Any = None) -> L2TaskId:
        # group_layout_descs (0.5.6: dict per object group; 0.5.0: one MemoryLayoutDesc) is advisory.
        tid = self._new_task("lookup")
        try:
            self._start_lookup(tid, list(keys))
        except Exception:
            logger.exception("adpkv lookup task %d failed to start", tid)
            self._finish("lookup", tid, Bitmap(len(keys)))
        return tid

    def _start_lookup(self, tid: L2TaskId, keys: list) -> None:
        n = len(keys)
        s = self._current()
        if n == 0 or s is None or not s.enabled:
            self._finish("lookup", tid, Bitmap(n))
            return
        adp = self._keys.keys(keys)
        marks = self._marks.marks_for_lookup(keys, adp)
        fut = s.client.exist(adp, marks=marks, lock=True)

        def done(f: Future) -> None:
            hits = _flags(f, n)
            bm = Bitmap(n)
            hit_idx = [i for i, h in enumerate(hits) if h]
            if hit_idx:
                bm.batched_set(hit_idx)
            with self._lock:
                if self._attachment.session is s:
                    for i in hit_idx:
                        self._held[adp[i]] = self._held.get(adp[i], 0) + 1
                self._counters["lookups"] += 1
                self._counters["lookup_keys"] += n
                self._counters["lookup_hits"] += len(hit_idx)
            self._finish("lookup", tid, bm)

        fut.add_done_callback(done)

    def query_lookup_and_lock_result(self, task_id: L2TaskId):
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list) -> None:
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
    def submit_load_task(self, keys: list, objects: list) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        tid = self._new_task("load")
        try:
            self._start_load(tid, list(keys), list(objects))
        except Exception:
            logger.exception("adpkv load task %d failed to start", tid)
            self._finish("load", tid, Bitmap(len(keys)))
        return tid

    def _start_load(self, tid: L2TaskId, keys: list, objects: list) -> None:
        n = len(keys)
        s = self._current()
        if n == 0 or s is None or not s.enabled:
            if n:
                with self._lock:
                    self._counters["load_missed_keys"] += n
            self._finish("load", tid, Bitmap(n))
            return
        bufs = [_buffer(o) for o in objects]
        sizes = [b[1] for b in bufs]
        parts = self._per_size(s, self._keys.keys(keys), bufs, "GET")

        def done() -> None:
            hits = [False] * n
            for idx, fut in parts:
                for i, ok in zip(idx, _flags(fut, len(idx))):
                    hits[i] = ok
            bm = Bitmap(n)
            hit_idx = [i for i, h in enumerate(hits) if h]
            if hit_idx:
                bm.batched_set(hit_idx)
            with self._lock:
                # Pins stay until LMCache's explicit submit_unlock (GET without unlock=True).
                self._counters["loads"] += 1
                self._counters["loaded_keys"] += len(hit_idx)
                self._counters["load_missed_keys"] += n - len(hit_idx)
                self._counters["bytes_loaded"] += sum(sizes[i] for i in hit_idx)
            if hit_idx:
                try:
                    self._notify_keys_accessed([keys[i] for i in hit_idx])
                except Exception:
                    logger.exception("L2 listener failed on accessed keys")
            self._finish("load", tid, bm)

        _gather([f for _, f in parts], done)

    def query_load_result(self, task_id: L2TaskId):
        with self._lock:
            return self._done_load.pop(task_id, None)

    # ------------------------------------------------------------------ delete / usage / status
    def delete(self, keys: list) -> None:
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

    def _gateway_stats(self) -> Optional[dict]:
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
        if stats:
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
        if not stats:
            return base
        cards = stats.get("cards") or []
        used = sum(int(c.get("used_bytes", 0) or 0) for c in cards)
        cap = sum(int(c.get("capacity_bytes", 0) or 0) for c in cards)
        return AdapterUsage(total_bytes_used=used, total_capacity_bytes=cap,
                            bytes_by_cache_salt=base.bytes_by_cache_salt)

    def report_status(self) -> dict:
        s = self._attachment.session
        attached = s is not None and s.enabled
        with self._lock:
            in_flight = dict(self._in_flight)
            counters = dict(self._counters)
            held = sum(self._held.values())
        healthy = attached and not self._closed
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
            "l1_region": self._l1.path if self._l1 is not None and s is not None and s.state.get("region") is not None
            else None,
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
        if self._closed:
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
        with self._lock:
            self._closed = True
            self._done_store.clear()
            self._done_lookup.clear()
            self._done_load.clear()
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()
        logger.info("AdpL2Adapter %s closed", self.engine_id)
