"""The host pools the backend moves pages of, and how their pages meet the ring.

SGLang registers its KV pool through ``register_mem_pool_host`` and every pool of a
hybrid model (Mamba states, SWA, DSA indexer, draft, ...) through
``register_mem_host_pool_v2(pool, name)``. Each becomes a ``HostPool``: its name, its
page copies (``PageIO``), its key builder and its shard:

- ``SegmentPages``: the pool's pages are affine segments (``pages.PageGeometry``): the
  ring copies read and write the pool memory itself, one ``memmove`` per segment per page.
- ``FlatPages``: pools without page buffer metadata (e.g. DSA ``layer_first``, Mamba pools
  with side states) move SGLang's own flat data page of each page (``get_data_page`` /
  ``set_from_flat_data_page``): one temporary page per page, as SGLang's own backends do.

Both store a page in SGLang's flat-data-page format; with stamps (``groups``) the
object's last 16 bytes are its stamp, copied from/to a ``groups.Stamps`` row.

Keys: ``KeyBuilder(namespace).key(page_hash + shard, 0, kind)``. The namespace holds the
deployment's identity (``config.key_namespace``) and the pool's: its name, its page
format, its first layer (the layer group; the PP stage is in the identity). The shard says
the TP rank where the pool is sharded over ranks (MHA KV, SWA, Mamba states: every rank
its own part) and is empty where every rank holds the same page (MLA latent pages, DSA
indexer pages: stored once, by the storage writer, read by every rank).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from adpkv_core.keys import KIND_AUX, KIND_KV, KeyBuilder

from .config import key_namespace
from .groups import STAMP_BYTES, Stamps
from .pages import PageGeometry, UnsupportedPool, describe_pool, page_starts, pool_kind

logger = logging.getLogger("adpkv.sglang")


# pools whose page is the same on every TP rank of an MLA model
REPLICATED_KINDS = ("mla", "indexer")


class SegmentPages:
    """Pages of a pool with page buffer metadata: copies straight to and from its memory."""

    def __init__(self, geo: PageGeometry):
        self.geo = geo
        self.pool = geo.pool
        self.page_bytes = geo.page_bytes
        self.zero_copy = True

    def segments(self, stamped: bool) -> tuple[list[int], list[int]]:
        offs, sizes = self.geo.seg_obj_off.tolist(), self.geo.seg_size.tolist()
        if stamped:
            return offs + [self.page_bytes], sizes + [STAMP_BYTES]
        return offs, sizes

    def addresses(self, starts: np.ndarray, stamps: Optional[Stamps], for_get: bool) -> tuple[np.ndarray, Any]:
        ptrs = self.geo.pointers(starts)
        if stamps is not None:
            ptrs = np.hstack([ptrs, stamps.addresses()])
        return ptrs, None

    def finish_get(self, starts: np.ndarray, held: Any, ok) -> None:
        """Nothing: the GET copied into the pool itself."""


class FlatPages:
    """Pages of a pool without page buffer metadata: SGLang's flat data pages."""

    def __init__(self, pool):
        self.pool = pool
        dummy = pool.get_dummy_flat_data_page()
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.zero_copy = False

    def segments(self, stamped: bool) -> tuple[list[int], list[int]]:
        if stamped:
            return [0, self.page_bytes], [self.page_bytes, STAMP_BYTES]
        return [0], [self.page_bytes]

    def addresses(self, starts: np.ndarray, stamps: Optional[Stamps], for_get: bool) -> tuple[np.ndarray, Any]:
        pool = self.pool
        if for_get:
            held = [pool.get_dummy_flat_data_page() for _ in range(len(starts))]
        else:
            held = [pool.get_data_page(int(s), flat=True).contiguous() for s in starts]
        for t in held:
            if t.numel() * t.element_size() != self.page_bytes:
                raise ValueError(f"{type(pool).__name__}: a flat page of {t.numel() * t.element_size()} bytes, "
                                 f"expected {self.page_bytes}")
        ptrs = np.array([t.data_ptr() for t in held], dtype=np.int64)[:, None]
        if stamps is not None:
            ptrs = np.hstack([ptrs, stamps.addresses()])
        return ptrs, held

    def finish_get(self, starts: np.ndarray, held: Any, ok) -> None:
        """The loaded pages into the pool (only those ``ok``)."""
        for start, page, good in zip(starts, held, ok):
            if good:
                self.pool.set_from_flat_data_page(int(start), page)


def page_io(pool) -> SegmentPages | FlatPages:
    """Straight copies where the pool describes its pages, flat data pages otherwise."""
    try:
        return SegmentPages(PageGeometry(pool))
    except UnsupportedPool as exc:
        logger.info("adpkv: %s/%s pages move as flat data pages (%s)", type(pool).__name__,
                    getattr(pool, "layout", "?"), exc)
        return FlatPages(pool)


class HostPool:
    """One registered host pool: its name, page copies, keys and shard."""

    def __init__(self, name: str, pool, io, settings, storage_config, format_tag: Optional[str],
                 stamped: bool, is_kv: bool):
        self.name = str(name)
        self.pool = pool
        self.io = io
        self.stamped = stamped
        self.kind = pool_kind(pool)
        mla = bool(getattr(storage_config, "is_mla_model", False))
        self.replicated = mla and self.kind in REPLICATED_KINDS
        self.shard = "" if self.replicated else f"#tp{int(getattr(storage_config, 'tp_rank', 0))}"
        desc = describe_pool(pool, io.page_bytes)
        if not is_kv:
            desc.update(pool=self.name, first_layer=int(getattr(pool, "start_layer", 0) or 0),
                        replicated=self.replicated, tp=None if self.replicated else
                        int(getattr(storage_config, "tp_size", 1)))
        if stamped:
            desc["stamp"] = STAMP_BYTES
        self.keys = KeyBuilder(key_namespace(settings, storage_config, desc, format_tag))
        self.key_kind = KIND_KV if is_kv else KIND_AUX
        self.object_bytes = io.page_bytes + (STAMP_BYTES if stamped else 0)

    def storage_keys(self, hashes) -> list[bytes]:
        key, shard, kind = self.keys.key, self.shard, self.key_kind
        return [key(f"{h}{shard}", 0, kind) for h in hashes]

    def starts(self, host_indices: torch.Tensor, n: int) -> np.ndarray:
        return page_starts(self.pool, host_indices, n)
