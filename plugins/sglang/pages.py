"""Where the bytes of one SGLang host-pool page live, and the copies to and from ring slots.

One stored object is one page of the host pool in SGLang's *flat data page*
format of the pool's layout (what ``get_data_page(index, flat=True)`` returns and
``set_from_flat_data_page`` takes), so the zero-copy path (``batch_get_v1`` /
``batch_set_v1``) and the generic path (``get`` / ``set``) store the same bytes.

The pool's own page buffer metadata (``get_page_buffer_meta``) tells which
contiguous segments make up a page. Every pointer it returns is affine in the
page's first token index (``base + offset + token * coef``); ``PageGeometry``
learns offset/coef/size of each segment from the metadata of two pages and
checks the rule on a third, so a batch's pointers are one numpy expression, not
a Python loop over pages. Segments are put in flat-page order (the only layout
where the metadata order differs is MHA ``layer_first``: K0 V0 K1 V1 ... in the
metadata, all K then all V in the flat page).

Copies go through the ring view of ``adpkv_core.ringview`` (libc ``memmove``: one
call per segment per page, the GIL released during each; no per-byte Python and no
temporary buffers).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger("adpkv.sglang")

from adpkv_core.ringview import RingView

class UnsupportedPool(ValueError):
    """The host pool's pages cannot be described as affine segments."""


def _meta(pool, first_token: int) -> tuple[list[int], list[int]]:
    idx = torch.arange(first_token, first_token + pool.page_size, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def pool_kind(pool) -> str:
    """``mha`` (K and V per layer) or ``mla`` (one latent row per layer)."""
    name = type(pool).__name__
    if "MLA" in name or hasattr(pool, "kv_lora_rank"):
        return "mla"
    return "mha"


class PageGeometry:
    """The segments of one page of a host pool, in flat-page order."""

    def __init__(self, pool):
        if getattr(pool, "kv_buffer", None) is None:
            raise UnsupportedPool(f"{type(pool).__name__} has no host KV buffer (a logical pool)")
        if getattr(pool, "dcp_size", 1) != 1:
            raise UnsupportedPool("decode context parallel (dcp_size > 1) pools are not supported")
        self.pool = pool
        self.layout = pool.layout
        self.page_size = int(pool.page_size)
        self.kind = pool_kind(pool)
        if pool.page_num < 3:
            raise UnsupportedPool("the host pool needs at least three pages")
        try:
            p0, s0 = _meta(pool, 0)
            p1, s1 = _meta(pool, self.page_size)
            p2, s2 = _meta(pool, 2 * self.page_size)
        except Exception as exc:   # e.g. a layout without page buffer metadata
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: no page buffer metadata ({exc})") from exc
        if not (len(p0) == len(p1) == len(p2)) or s0 != s1 or s0 != s2 or not p0:
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: page segments differ between pages")
        base = int(pool.kv_buffer.data_ptr())
        off = np.array(p0, dtype=np.int64) - base
        diff = np.array(p1, dtype=np.int64) - np.array(p0, dtype=np.int64)
        if np.any(diff % self.page_size):
            raise UnsupportedPool(f"{self.layout}: page pointers are not affine in the token index")
        coef = diff // self.page_size
        if np.any(np.array(p2, dtype=np.int64) - base != off + 2 * self.page_size * coef):
            raise UnsupportedPool(f"{self.layout}: page pointers are not affine in the token index")
        sizes = np.array(s0, dtype=np.int64)
        order = np.arange(len(p0))
        if self.kind == "mha" and self.layout == "layer_first" and len(p0) % 2 == 0:
            order = np.concatenate([order[0::2], order[1::2]])  # K0 V0 K1 V1 .. -> K.. V..
        self.base = base
        self.seg_off = off[order]
        self.seg_coef = coef[order]
        self.seg_size = sizes[order]
        self.seg_obj_off = np.concatenate([[0], np.cumsum(self.seg_size)[:-1]]).astype(np.int64)
        self.page_bytes = int(self.seg_size.sum())
        self.nseg = len(order)
        buf = pool.kv_buffer
        self.buffer_end = base + buf.numel() * buf.element_size()
        try:
            flat = pool.get_data_page(0, flat=True)
        except Exception as exc:
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: no flat data page ({exc})") from exc
        if flat.numel() * flat.element_size() != self.page_bytes:
            raise UnsupportedPool(f"{self.layout}: page segments ({self.page_bytes} bytes) differ from the "
                                  f"flat data page ({flat.numel() * flat.element_size()} bytes)")

    def describe(self) -> dict:
        pool = self.pool
        geo = {"kind": self.kind, "layout": self.layout, "page_size": self.page_size,
               "dtype": str(pool.dtype).replace("torch.", ""), "layers": int(pool.layer_num),
               "page_bytes": self.page_bytes}
        if self.kind == "mla":
            geo["kv_cache_dim"] = int(getattr(pool, "kv_cache_dim", 0))
        else:
            geo["heads"] = int(getattr(pool, "head_num", 0))
            geo["head_dim"] = int(getattr(pool, "head_dim", 0))
        return geo

    def page_starts(self, host_indices: torch.Tensor, n: int) -> np.ndarray:
        """First token index of each of the ``n`` pages of a batch."""
        if host_indices.numel() != n * self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {self.page_size} tokens")
        starts = host_indices.reshape(n, self.page_size)[:, 0].to("cpu", torch.int64).numpy()
        if np.any(starts % self.page_size) or np.any(starts < 0) or \
                np.any(starts + self.page_size > self.pool.size):
            raise ValueError("host indices are not whole pages of the host pool")
        return starts

    def pointers(self, starts: np.ndarray) -> np.ndarray:
        """(pages, segments) absolute addresses."""
        ptrs = self.base + self.seg_off[None, :] + starts[:, None] * self.seg_coef[None, :]
        if ptrs.size and (ptrs.min() < self.base or (ptrs + self.seg_size[None, :]).max() > self.buffer_end):
            raise ValueError("a page lies outside the host pool buffer")
        return ptrs


def _segments(geo: PageGeometry) -> tuple[list[int], list[int]]:
    return geo.seg_obj_off.tolist(), geo.seg_size.tolist()


def copy_pages_to_ring(geo: PageGeometry, ring: RingView, ptrs: np.ndarray, batch) -> None:
    """PUT: pages ``batch.first ..`` of the request into their ring slots."""
    ring.fill(batch, ptrs, _segments(geo))


def copy_ring_to_pages(geo: PageGeometry, ring: RingView, ptrs: np.ndarray, batch) -> None:
    """GET: the hits among objects ``batch.first ..`` out of the ring into the pool."""
    ring.drain(batch, ptrs, _segments(geo))


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def copy_tensor_to_ring(t: torch.Tensor, ring: RingView, offset: int) -> None:
    """One flat value (any dtype/strides, CPU) into a ring slot."""
    n = tensor_nbytes(t)
    ring.check(offset, n)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_contiguous():
        ring.write(offset, t.data_ptr(), n)
    else:
        dst = ring.tensor(offset, n).view(t.dtype).view(t.shape)
        dst.copy_(t)


def copy_ring_to_tensor(ring: RingView, offset: int, t: torch.Tensor) -> None:
    """A ring slot into a flat target (contiguous CPU tensors by memmove, others by one copy)."""
    n = tensor_nbytes(t)
    ring.check(offset, n)
    if t.device.type == "cpu" and t.is_contiguous():
        ring.read(offset, t.data_ptr(), n)
    else:
        src = ring.tensor(offset, n).view(t.dtype).view(t.shape)
        t.copy_(src)


