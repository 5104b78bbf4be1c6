"""SGLang's v2 storage calls (hybrid models): the auxiliary host pools, a mixin of the facade.

``HybridPools`` holds what SGLang's ``HiCacheStorage`` v2 interface asks of a backend:

- ``register_mem_host_pool_v2``: every auxiliary pool (Mamba, SWA, DSA indexer, draft, ...)
  becomes a ``pools.HostPool``; the first one turns the model hybrid: every object is
  stamped from then on (``groups``), the KV pool's own objects too (``_make_kv_pool``).
- ``batch_exists_v2``: one EXIST over the KV pages and every pool's pages, answered by
  SGLang's hit policies (``hitpolicy``).
- ``batch_set_v2`` / ``batch_get_v2``: one PUT / GET per pool (``transfers``); KV pages handed
  over as a pool take the facade's v1 path. All or nothing per page group: a pool's page is
  loaded only when its stamp names its key and its write is its group's (``groups``).

Contract with the class it is mixed into (``backend.AdpHiCacheStorage``, which lists it
before ``HiCacheStorage`` so these methods are the ones SGLang calls):

- it sets, before any v2 call, the attributes annotated on ``HybridPools`` below
  (``pools``, ``kv``, ``hybrid``, ... : the facade's ``__init__`` and
  ``register_mem_pool_host``); this mixin changes only ``pools``, ``hybrid`` and
  ``_unknown_pools`` (and ``kv`` through ``_make_kv_pool``);
- it provides ``_live()`` (the session a call uses to its end, or None: misses),
  ``_pages(pool, host_indices, keys)`` (that session, the pages' starts and storage keys, or None),
  ``_marks(keys, extra_info)`` (dialog marks or None), ``_kv_keys(keys)`` (the KV pages'
  storage keys), ``_make_kv_pool()`` (rebuild ``kv``, stamped once ``hybrid``) and SGLang's
  ``batch_get_v1`` / ``batch_set_v1``;
- every v2 call here turns any failure into SGLang's miss/failure value, as the facade's do.

Threads: as the facade's (module docstring of ``backend``): ``batch_exists_v2`` on SGLang's
prefetch thread, ``batch_get_v2`` on the prefetch I/O thread, ``batch_set_v2`` on the backup
thread; the registration calls on the scheduler's thread before any of them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import numpy as np

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from adpkv_core.attachment import Attachment, Session

from . import groups, hitpolicy, transfers
from .config import SglangSettings
from .housekeeping import Tally
from .pools import HostPool, page_io
from .shm import ShmRegions

if TYPE_CHECKING:   # as SGLang's hicache_storage does: imported at run time it would be circular
    from sglang.srt.mem_cache.pool_host import HostKVCache

logger = logging.getLogger("adpkv.sglang")


class HybridPools:
    """The v2 calls of ``AdpHiCacheStorage`` (see the module docstring for the contract)."""

    # the facade's state these calls use (set by AdpHiCacheStorage; what they change: module docstring)
    settings: SglangSettings
    storage_config: HiCacheStorageConfig
    is_mla: bool
    is_writer: bool
    interface_v1: bool
    mem_pool_host: Optional[HostKVCache]   # None until register_mem_pool_host
    kv: Optional[HostPool]
    pools: dict[str, HostPool]
    hybrid: bool
    write_ids: groups.WriteIds
    regions: ShmRegions
    _unknown_pools: set[str]
    _attachment: Optional[Attachment]
    _tally: Tally
    # and its methods these calls use
    _live: Callable[[], Optional[Session]]
    _pages: Callable[[Optional[HostPool], object, Sequence[str]],
                     Optional[tuple[Session, np.ndarray, list[bytes]]]]
    _marks: Callable[[Sequence[str], Optional[HiCacheStorageExtraInfo]], Optional[list[int]]]
    _kv_keys: Callable[[Sequence[str]], list[bytes]]
    _make_kv_pool: Callable[[], None]
    batch_get_v1: Callable[..., List[bool]]
    batch_set_v1: Callable[..., List[bool]]

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """An auxiliary pool of a hybrid model (SGLang's v2 registration); the KV pool itself
        moves through v1 and is registered by ``register_mem_pool_host``."""
        # the facade lists HiCacheStorage right after this mixin (module docstring): what super() reaches
        HiCacheStorage.register_mem_host_pool_v2(self, host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value:
            if host_pool is not self.mem_pool_host:
                logger.warning("adpkv: a KV pool registered through v2 that is not the anchor pool; "
                               "KV pages move through v1 with the anchor pool")
            return
        try:
            hp = HostPool(name, host_pool, page_io(host_pool), self.settings, self.storage_config,
                          getattr(host_pool, "storage_format_tag", None), stamped=True, is_kv=False)
        except Exception:
            logger.exception("adpkv: host pool %s (%s) cannot be stored; its pages always miss",
                             name, type(host_pool).__name__)
            self.pools.pop(name, None)
            return
        self.pools[name] = hp
        self.regions.add_pool(hp)
        if not self.hybrid:
            self.hybrid = True
            had_kv = self.kv is not None and self._attachment is not None and self._attachment.enabled
            self._make_kv_pool()     # KV objects carry stamps from now on (their own namespace)
            if had_kv and self.interface_v1:
                logger.warning("adpkv: pool %s registered after the KV pool was in use: KV pages now carry "
                               "page-group stamps, in a namespace of their own (earlier KV pages miss)", name)
        logger.info("adpkv: pool %s: %s pages of %d bytes (%s, %s), namespace %s", name, hp.kind,
                    hp.io.page_bytes, "zero copy" if hp.io.zero_copy else "flat pages",
                    "one object for all ranks" if hp.replicated else f"rank shard {hp.shard}",
                    hp.keys.namespace)

    def on_host_pools_registered(self) -> None:
        if self.pools:
            logger.info("adpkv: hybrid model: KV + %s; %s", ", ".join(sorted(self.pools)),
                        "each page group checked against its KV pages" if self.interface_v1 else
                        "without interface_v1 auxiliary pages are checked window by window only")

    def _bound_kv(self, hp: HostPool) -> Optional[HostPool]:
        """The KV pool whose pages' write ids this rank checks ``hp``'s page groups against, or
        None: it needs stamped KV pages written by the same rank as the group (an MLA model's KV
        pages are written by the storage writer only, its rank-sharded states by every rank)."""
        kv = self.kv
        if kv is not None and kv.stamped and (hp.replicated or not self.is_mla or self.is_writer):
            return kv
        return None

    @staticmethod
    def _closing_pages(t: PoolTransfer, keys: Sequence[str]) -> Optional[list[str]]:
        """The page hash of the KV page each of ``keys``' pages belongs to (None: no KV page):
        the window's last page for trailing pools, the page itself for pools beside the KV pages."""
        if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            return [keys[-1]] * len(keys)
        if t.indices_from_pool == PoolName.KV:
            return list(keys)
        return None

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """One EXIST for the KV pages and every pool's pages; SGLang's hit policies over them
        (``hitpolicy``): the usable prefix is the longest one restorable in every pool."""
        if not keys:
            return PoolTransferResult(0, {}, [])
        try:
            s = self._live()
            if s is None:
                return PoolTransferResult(0, {}, [])
            marks = self._marks(keys, extra_info)
            asked: list[bytes] = self._kv_keys(keys)
            all_marks = list(marks) if marks is not None else None
            spans: list[tuple[PoolTransfer, Optional[int], int]] = []   # (transfer, first in asked or None, count)
            for t in pool_transfers or []:
                if str(t.name) == PoolName.KV.value:
                    continue                     # the KV pages themselves: counted above
                hp = self.pools.get(str(t.name))
                pool_keys = list(t.keys or keys) if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS else keys
                if hp is None:
                    spans.append((t, None, len(pool_keys)))
                    continue
                spans.append((t, len(asked), len(pool_keys)))
                asked += hp.storage_keys(pool_keys)
                if all_marks is not None:
                    pool_marks = self._marks(pool_keys, extra_info) if pool_keys is not keys else marks
                    # marked as the KV keys were (same extra_info, and those marks were not None)
                    assert pool_marks is not None
                    all_marks += pool_marks
            self._tally.count("exist_requests")
            found = s.client.exist(asked, all_marks).result()
            presences = []
            for t, at, count in spans:
                present = [False] * count if at is None else [bool(x) for x in found[at:at + count]]
                presences.append(hitpolicy.PoolPresence(
                    t.name, t.hit_policy, present, window=len(t.keys) if t.keys else 1,
                    block_pages=t.block_pages, group_pages=t.group_pages))
            return hitpolicy.restorable([bool(x) for x in found[:len(keys)]], presences)
        except Exception:
            logger.exception("adpkv: batch_exists_v2 failed; reporting no hits")
            return PoolTransferResult(0, {}, [])

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Every pool's pages, stamped with the write id of their page group; the KV pages they
        belong to are bound to it for the ``batch_set_v1`` that follows (``groups``)."""
        return self._each_pool(transfers, extra_info, self.batch_set_v1, self._set_pool)

    def _set_pool(self, t: PoolTransfer, keys: list[str], extra_info) -> List[bool]:
        n = len(keys)
        hp = self.pools.get(str(t.name))
        if hp is None:
            if str(t.name) not in self._unknown_pools:
                self._unknown_pools.add(str(t.name))
                logger.warning("adpkv: batch_set_v2 for pool %s, which was not registered (or could not be "
                               "stored): its pages are not stored", t.name)
            return [False] * n
        if hp.replicated and not self.is_writer:
            self._tally.count("pages_skipped_nonwriter", n)
            return [True] * n
        try:
            got = self._pages(hp, t.host_indices, keys)
            if got is None:
                return [False] * n
            s, starts, skeys = got
            write_id = self.write_ids.group_id(keys[-1])
            stored, existed = transfers.write_pages(s, hp, starts, skeys, self._marks(keys, extra_info),
                                                    groups.Stamps(skeys, [write_id] * n), False, self._tally,
                                                    regions=self.regions)
            closing = self._closing_pages(t, keys)
            kv = self._bound_kv(hp)
            if closing is not None and kv is not None and self.is_writer:
                # the KV pages of what this write stored carry its write id (a page whose pool
                # object was stored already belongs to that earlier write: not bound)
                new = [st and not ex for st, ex in zip(stored, existed)]
                if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    pages = closing[-1:] if all(new) else []
                else:
                    pages = [c for c, fresh in zip(closing, new) if fresh]
                if pages:
                    self.write_ids.bind(kv.storage_keys(pages), write_id)
            return stored
        except Exception:
            logger.exception("adpkv: batch_set_v2 of %d pages of pool %s failed", n, t.name)
            return [False] * n

    def _drop_stale(self, s: Session, hp: HostPool, keys: list[bytes], marks: Optional[list[int]]) -> None:
        """Delete pool objects of a mixed page group, so the next backup of the prefix stores
        the group whole (objects are never overwritten: a key names its content)."""
        self._tally.count("groups_rejected")
        logger.warning("adpkv: %d page(s) of pool %s belong to another write than their page group; "
                       "not loaded%s", len(keys), hp.name,
                       "" if (self.is_writer or not hp.replicated) else " (the storage writer rank drops them)")
        if self.is_writer or not hp.replicated:
            s.client.delete(keys, marks).result()

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Every pool's pages into its host pool; a page counts as loaded only when its stamp
        names its key and its group is whole: one write id over a window, the same as the KV
        page it belongs to where this instance loaded that page (``groups``)."""
        return self._each_pool(transfers, extra_info, self.batch_get_v1, self._get_pool)

    @staticmethod
    def _each_pool(transfers: List[PoolTransfer], extra_info, kv_v1, per_pool) -> dict[str, List[bool]]:
        """Each transfer's pages by its pool, results by pool name: KV pages handed over as a
        pool take the v1 path (``kv_v1``), every other pool ``per_pool``."""
        results: dict[str, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            if not keys:
                results[t.name] = []
            elif str(t.name) == PoolName.KV.value:
                results[t.name] = kv_v1(keys, t.host_indices, extra_info)
            else:
                results[t.name] = per_pool(t, keys, extra_info)
        return results

    def _get_pool(self, t: PoolTransfer, keys: list[str], extra_info) -> List[bool]:
        n = len(keys)
        hp = self.pools.get(str(t.name))
        if hp is None:
            return [False] * n
        try:
            got = self._pages(hp, t.host_indices, keys)
            if got is None:
                return [False] * n
            s, starts, skeys = got
            stamps = groups.Stamps(skeys)
            marks = self._marks(keys, extra_info)
            hits, held = transfers.read_pages(s, hp, starts, skeys, marks, stamps, self._tally,
                                              regions=self.regions)
            ids = stamps.write_ids().tolist()
            valid = stamps.valid().tolist()
            # stale: found, but not of this page group's write (another key's bytes, another
            # write than the KV page it belongs to, a window of two writes)
            stale = [h and not v for h, v in zip(hits, valid)]
            closing = self._closing_pages(t, keys)
            kv = self._bound_kv(hp)
            if closing is not None and kv is not None:
                kv_ids = self.write_ids.loaded(kv.storage_keys(closing))
                stale = [st or (h and k is not None and k != w) for st, h, k, w in zip(stale, hits, kv_ids, ids)]
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES and all(hits) and len(set(ids)) > 1:
                stale = list(hits)
            ok = [h and not st for h, st in zip(hits, stale)]
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES and not all(ok):
                ok = [False] * n            # a window is whole, from one write, or not there
            elif t.hit_policy == PoolHitPolicy.BLOCK_GROUPS and t.group_pages > 0:
                g = int(t.group_pages)
                for i in range(0, n, g):
                    if not all(ok[i:i + g]):
                        ok[i:i + g] = [False] * len(ok[i:i + g])
            hp.io.finish_get(starts, held, ok)
            if any(stale):
                picked = [i for i, st in enumerate(stale) if st]
                self._drop_stale(s, hp, [skeys[i] for i in picked],
                                 None if marks is None else [marks[i] for i in picked])
            return ok
        except Exception:
            logger.exception("adpkv: batch_get_v2 of %d pages of pool %s failed", n, t.name)
            return [False] * n
