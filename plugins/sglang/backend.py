"""``AdpHiCacheStorage``: adpkv as SGLang's HiCache L3 storage (the ``dynamic`` backend; the facade).

SGLang builds it as ``AdpHiCacheStorage(storage_config, kwargs)`` and hands it the
host KV pool through ``register_mem_pool_host``. Each scheduler rank has its own
instance and attaches to the gateway as one rank of the server's engine
(``engine_id``, default ``sglang-<parent pid>``), with independent requests.

This module is SGLang's ``HiCacheStorage`` interface: set-up (pool geometry, key
namespace, attachment), keys and dialog marks, and the turning of every failure into
SGLang's miss/failure values. The work is in:

- ``transfers``: the data paths. v1 (``interface_v1``, what SGLang's cache controller
  calls with batches of at most 128 pages): ``batch_get_v1`` is one GET whose ring
  batches are copied straight into the pool pages (``pages.PageGeometry``),
  ``batch_set_v1`` one PUT filled from the pool pages (after one EXIST that skips
  pages stored already, with ``skip_existing``). The generic path (``get``/``set``/``batch_get``/``batch_set``) moves the same
  objects (flat data pages) as tensors. ``batch_exists`` is one EXIST: the number of
  consecutive hits from the start.
- ``hybrid``: the v2 calls (hybrid models: ``register_mem_host_pool_v2``, ``batch_exists_v2``,
  ``batch_get_v2``, ``batch_set_v2``), a mixin of this class (its contract is written there):
  every auxiliary pool (Mamba, SWA, DSA indexer, draft, ...) is a ``pools.HostPool``;
  ``batch_exists_v2`` is one EXIST over the KV pages and every pool's pages, answered by
  SGLang's hit policies (``hitpolicy``); gets and sets are one GET / PUT per pool. All or
  nothing per page group: ``groups`` (write ids stamped on every object of a hybrid model,
  checked on read).
- ``housekeeping``: counters, SGLang's ``StorageMetrics``, ``clear``.
- ``pages``: where a page's bytes lie in a host pool; ``config``: settings, namespace.

Threads: SGLang calls ``batch_exists`` on its prefetch thread, ``batch_get_v1`` on the
prefetch I/O thread, ``batch_set_v1`` on the backup thread; each call blocks until its
requests resolved (bounded by the client's ``timeout_s``) and never returns while a
copy into or out of the pool could still run. The copies themselves run on the
client's I/O thread (``transfers``).

Keys: ``KeyBuilder(namespace).key(page_hash + shard, layer=0)``; the namespace holds
the model identity and the page format, the shard the TP rank for MHA (every rank
its own heads) and nothing for MLA (one object per page, written by the
storage-writer rank only). With ``hicache_storage_pass_prefix_keys`` SGLang passes
the page hashes before a batch; they give the dialog mark of every key, so a
dialog's pages stay on one card.

Failures never reach SGLang: without a gateway, ``batch_exists`` says 0, gets
fail per key and sets report failure. The rank holds its gateway through
``adpkv_core.attachment.Attachment``: its watcher thread re-attaches once the
gateway answers again (``reconnect_s``, doubling to 60 s, the policy of every
adapter); each call takes the current attachment at its start and keeps it to
its end.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from adpkv_core.affinity import dialog_marks
from adpkv_core.attachment import Attachment, Session
from adpkv_core.wire.protocol import GatewayStats
from adpkv_core.keys import KIND_KV, KeyBuilder
from adpkv_core.settings import parse_bool

from . import groups, housekeeping, hitpolicy, transfers
from .config import SglangSettings, key_namespace, shard_suffix
from .hybrid import HybridPools
from .pages import PageGeometry, UnsupportedPool
from .pools import HostPool, SegmentPages
from .shm import ShmRegions

logger = logging.getLogger("adpkv.sglang")


def _engine_rank(storage_config) -> tuple[int, int]:
    """This process's rank and the world of the server: torch.distributed's when it is up
    (unique over TP, PP, DP, CP), else from the storage config."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        pass
    tp, tps = int(storage_config.tp_rank), int(storage_config.tp_size)
    pp, pps = int(storage_config.pp_rank), int(storage_config.pp_size)
    cp, cps = int(getattr(storage_config, "attn_cp_rank", 0)), int(getattr(storage_config, "attn_cp_size", 1))
    return (pp * cps + cp) * tps + tp, tps * pps * cps


class AdpHiCacheStorage(HybridPools, HiCacheStorage):
    """SGLang HiCache storage backend on an adpkv gateway (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.settings = SglangSettings.from_storage_config(storage_config)
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(getattr(storage_config, "is_storage_writer",
                                      not self.is_mla or storage_config.tp_rank == 0))
        self.rank, self.world = _engine_rank(storage_config)
        self.shard = shard_suffix(storage_config)
        # SGLang's generic path (no interface_v1) calls batch_get/batch_set without prefix keys:
        # marks then would differ between writes and lookups, so dialog marks only with interface_v1
        extra = storage_config.extra_config or {}
        self.interface_v1 = parse_bool(extra.get("interface_v1", False), "interface_v1")
        self.use_marks = self.interface_v1
        self.mem_pool_host = None
        self.geometry: Optional[PageGeometry] = None
        self.page_bytes = 0
        self._logical_pool = False
        self._keys: Optional[KeyBuilder] = None    # once the host pool tells the page format
        self.kv: Optional[HostPool] = None         # the KV pool's pages (v1), once registered
        self.pools: dict[str, HostPool] = {}       # the auxiliary pools (v2), by SGLang's pool name
        self.hybrid = False                        # auxiliary pools registered: every object stamped
        self.write_ids = groups.WriteIds()
        self.regions = ShmRegions()                # pools in shared memory: moved by the gateway in place
        self._prefix_keys_on = self.settings.prefix_keys   # SGLang passes prefix keys (see _marks)
        self._unknown_pools: set[str] = set()              # warned about once
        self._attachment: Optional[Attachment] = None   # made at the first attach
        self._lock = threading.Lock()
        self._closed = False
        self._tally = housekeeping.Tally(bool(getattr(storage_config, "enable_storage_metrics", False)))
        self.counters = self._tally.counters
        logger.info("adpkv HiCache backend: rank %d/%d of engine %s, gateway %s:%d, %s%s",
                    self.rank, self.world, self.settings.engine_id, self.settings.client.host,
                    self.settings.client.port, "MLA" if self.is_mla else "MHA",
                    "" if self.is_writer else " (not the storage writer: reads only)")

    # ------------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        geo = None
        try:
            geo = PageGeometry(mem_pool_host)
        except UnsupportedPool as exc:
            if getattr(mem_pool_host, "kv_buffer", None) is None:
                self._logical_pool = True   # a logical anchor pool (no KV bytes of its own)
                logger.info("adpkv: host pool %s holds no KV bytes; v1 calls are no-ops",
                            type(mem_pool_host).__name__)
            else:
                logger.error("adpkv: the host pool cannot be used for storage (%s); L3 stays off", exc)
        self.geometry = geo
        desc = geo.describe() if geo is not None else None
        self.page_bytes = geo.page_bytes if geo is not None else 0
        self._keys = KeyBuilder(key_namespace(self.settings, self.storage_config, desc,
                                              getattr(mem_pool_host, "storage_format_tag", None)))
        self._make_kv_pool()
        logger.info("adpkv: %s pages of %d bytes, namespace %s", desc and desc["layout"],
                    self.page_bytes, self._keys.namespace)
        self._attach()

    def _make_kv_pool(self) -> None:
        """The KV pool's pages for v1, stamped once the model is hybrid (``groups``)."""
        geo, pool = self.geometry, self.mem_pool_host
        if self.kv is not None:
            self.regions.forget(self.kv)
        self.kv = None if geo is None else HostPool(
            PoolName.KV, pool, SegmentPages(geo), self.settings, self.storage_config,
            getattr(pool, "storage_format_tag", None), stamped=self.hybrid and self.interface_v1, is_kv=True)
        if self.kv is not None:
            self.regions.add_pool(self.kv)

    def _layout_info(self) -> dict:
        info = {"engine": "sglang", "attention": "mla" if self.is_mla else "mha",
                "tp_rank": int(self.storage_config.tp_rank), "tp_size": int(self.storage_config.tp_size)}
        if self.geometry is not None:
            info.update(self.geometry.describe())
        return info

    def _attach(self) -> Optional[Session]:
        """Attach now (blocking up to connect_timeout_s when no gateway answers); later calls
        return the attachment's session (the watcher re-attaches by itself)."""
        with self._lock:
            if self._closed:
                return None
            a = self._attachment
            if a is None:
                a = self._attachment = Attachment(
                    self.settings.client, self.settings.engine_id, self.rank, self.world,
                    self._layout_info, reconnect_s=self.settings.reconnect_s, attach_now=False,
                    name="adpkv-sglang", on_attach=self.regions.register_all)
        s = a.attach()
        if s is not None and s.enabled and s.number == 1:
            logger.info("adpkv: attached to the gateway on port %d as rank %d/%d",
                        self.settings.client.port, self.rank, self.world)
        return s

    def _live(self) -> Optional[Session]:
        """The attached session a call uses to its end, or None (misses)."""
        if self._attachment is None:
            if self.mem_pool_host is not None or self._closed:
                return None
            self._attach()   # generic use without a host pool: attach at the first call
        a = self._attachment
        s = a.refresh() if a is not None else None
        return s if s is not None and s.enabled else None

    # ------------------------------------------------------------------ keys
    def _key_list(self, keys: Sequence[str]) -> list[bytes]:
        if self._keys is None:   # used without a host pool: no page format, a namespace of its own
            self._keys = KeyBuilder(key_namespace(self.settings, self.storage_config, None))
        key, shard = self._keys.key, self.shard
        return [key(f"{k}{shard}", 0, KIND_KV) for k in keys]

    def _marks(self, keys: Sequence[str], extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[list[int]]:
        """The dialog mark of every key, from SGLang's prefix keys (None without them).

        Same marks as ``dialog_marks(prefix_keys + keys, affinity_chunks)``; only the
        first ``affinity_chunks`` hashes of the dialog matter, so only those are hashed.
        SGLang's hybrid controller passes no prefix keys in a hit query at the root (it drops
        an empty list); once the deployment is known to pass them (``prefix_keys`` setting, or
        any call that brought them), such a call starts at the root.
        """
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if prefix is not None:
            self._prefix_keys_on = True
        elif extra_info is not None and self.hybrid and self._prefix_keys_on:
            prefix = []
        if prefix is None or not self.use_marks:
            return None
        n = self.settings.client.affinity_chunks
        start = len(prefix)
        head = list(prefix[:n]) + list(keys[:max(0, n - start)])
        marks = dialog_marks(head, n)
        last = len(marks) - 1
        return [marks[min(start + i, last)] for i in range(len(keys))]

    def _pages(self, hp: Optional[HostPool], host_indices: torch.Tensor,
               keys: Sequence[str]) -> Optional[tuple[Session, np.ndarray, list[bytes]]]:
        """What a call moving ``keys``' pages of ``hp`` needs: the session it uses to its end,
        the pages' starts in the pool, their storage keys; None (every page misses / is not
        stored) without the pool or without a gateway."""
        s = self._live()
        if hp is None or s is None:
            return None
        return s, hp.starts(host_indices, len(keys)), hp.storage_keys(keys)

    def _kv_keys(self, keys: Sequence[str]) -> list[bytes]:
        """The KV pages' keys of the zero-copy path (stamped ones once the model is hybrid)."""
        if self.kv is not None and self.interface_v1:
            return self.kv.storage_keys(keys)
        return self._key_list(keys)

    # ------------------------------------------------------------------ v1 (zero copy)
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        if not keys:
            return 0
        try:
            s = self._live()
            if s is None:
                return 0
            self._tally.count("exist_requests")
            hits = s.client.exist(self._kv_keys(keys), self._marks(keys, extra_info)).result()
            return hitpolicy.leading_run(hits)
        except Exception:
            logger.exception("adpkv: batch_exists failed; reporting no hits")
            return 0

    def _v1_pages(self, what: str, keys: List[str], host_indices: torch.Tensor,
                  move: Callable[[HostPool, Session, np.ndarray, List[bytes]], List[bool]]) -> List[bool]:
        """The frame of ``batch_get_v1`` / ``batch_set_v1``: no keys, nothing; a logical pool:
        all done (it holds no KV bytes of its own); else ``move(kv pool, session, page
        starts, storage keys)`` over the KV pool's pages of ``host_indices`` (``_pages``), and
        all False when there is no session or anything fails (logged)."""
        n = len(keys)
        if n == 0:
            return []
        if self._logical_pool:
            return [True] * n
        try:
            kv = self.kv
            got = self._pages(kv, host_indices, keys)
            if kv is None or got is None:
                return [False] * n
            s, starts, skeys = got
            return move(kv, s, starts, skeys)
        except Exception:
            logger.exception("adpkv: %s of %d pages failed", what, n)
            return [False] * n

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        def load(kv: HostPool, s: Session, starts: np.ndarray, skeys: List[bytes]) -> List[bool]:
            stamps = groups.Stamps(skeys) if kv.stamped else None
            hits, held = transfers.read_pages(s, kv, starts, skeys, self._marks(keys, extra_info), stamps,
                                              self._tally, regions=self.regions)
            if stamps is not None:
                hits = [h and bool(v) for h, v in zip(hits, stamps.valid())]
                self.write_ids.note_loaded(skeys, stamps.write_ids().tolist(), hits)
            return hits

        return self._v1_pages("batch_get_v1", keys, host_indices, load)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if keys and not self._logical_pool and not self.is_writer:
            # MLA: the storage-writer rank stores the (replicated) page for everyone
            self._tally.count("pages_skipped_nonwriter", len(keys))
            return [True] * len(keys)

        def store(kv: HostPool, s: Session, starts: np.ndarray, skeys: List[bytes]) -> List[bool]:
            stamps, rewrite = None, None
            if kv.stamped:
                # pages closing a page group carry that group's write id (written even when stored)
                bound = self.write_ids.take_bound(skeys)
                fresh = self.write_ids.fresh_id()
                stamps = groups.Stamps(skeys, [fresh if w is None else w for w in bound])
                rewrite = [w is not None for w in bound]
            stored, _ = transfers.write_pages(s, kv, starts, skeys, self._marks(keys, extra_info), stamps,
                                              self.settings.skip_existing, self._tally, rewrite,
                                              regions=self.regions)
            return stored

        return self._v1_pages("batch_set_v1", keys, host_indices, store)

    # ------------------------------------------------------------------ generic path
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        n = len(keys)
        if n == 0:
            return []
        try:
            targets = list(target_locations) if target_locations is not None else [None] * n
            if len(targets) != n:
                raise ValueError(f"{len(targets)} targets for {n} keys")
            for i, t in enumerate(targets):
                if t is None:
                    if not self.page_bytes:
                        raise ValueError("no target and no host pool to size it")
                    targets[i] = self._dummy_page()
            s = self._live()
            if s is None:
                return [None] * n
            return transfers.get_values(s, self._key_list(keys), targets, self._tally)
        except Exception:
            logger.exception("adpkv: batch_get of %d keys failed", n)
            return [None] * n

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        n = len(keys)
        if n == 0:
            return True
        if not self.is_writer:
            self._tally.count("pages_skipped_nonwriter", n)
            return True
        try:
            vals = list(values) if values is not None else []
            if len(vals) != n or any(not isinstance(v, torch.Tensor) for v in vals):
                raise ValueError("batch_set needs one tensor per key")
            s = self._live()
            if s is None:
                return False
            return transfers.set_values(s, self._key_list(keys), vals, self._tally)
        except Exception:
            logger.exception("adpkv: batch_set of %d keys failed", n)
            return False

    def _dummy_page(self) -> torch.Tensor:
        pool = self.mem_pool_host
        if pool is not None:
            try:
                return pool.get_dummy_flat_data_page()
            except Exception:
                pass
        return torch.empty(self.page_bytes, dtype=torch.uint8)

    # ------------------------------------------------------------------ housekeeping
    def clear(self) -> bool:
        """Delete every object on the gateway's cards (refused on shared storage)."""
        return housekeeping.clear(self._live)

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (pages per batch, GiB/s)."""
        return self._tally.storage_metrics()

    def gateway_stats(self) -> Optional[GatewayStats]:
        """The gateway's own STATS (cards, objects, counters); None without a gateway."""
        s = self._live()
        return s.client.stats().result() if s is not None else None

    @property
    def attached(self) -> bool:
        a = self._attachment
        return a is not None and a.enabled

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            a = self._attachment
        if a is not None:
            try:
                a.close()
            except Exception:
                logger.exception("adpkv: closing the gateway client failed")
        self.regions.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
