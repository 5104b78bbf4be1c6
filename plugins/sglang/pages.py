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
    """What a host pool holds: ``mha`` (K and V per layer), ``mla`` (one latent row per
    layer), ``mamba`` (recurrent states: temporal and conv, one slot a page) or ``indexer``
    (DSA index keys riding on the KV pages)."""
    name = type(pool).__name__
    if "Mamba" in name:
        return "mamba"
    if "Indexer" in name:
        return "indexer"
    if "MLA" in name or hasattr(pool, "kv_lora_rank"):
        return "mla"
    return "mha"


def _buffer_span(pool) -> tuple[int, int] | None:
    """[start, end) of the pool's one host buffer, when it has exactly one tensor."""
    buf = getattr(pool, "kv_buffer", None)
    if isinstance(buf, torch.Tensor):
        start = int(buf.data_ptr())
        return start, start + buf.numel() * buf.element_size()
    return None


class PageGeometry:
    """The segments of one page of a host pool, in flat-page order.

    A segment's address is ``seg_addr0 + first_token * seg_coef`` (learnt from the pool's
    page buffer metadata of pages 0, 1 and checked on page 2 and the last page, so every
    page in between lies inside the pool's buffers); a pool of one buffer tensor is also
    checked against that tensor's bounds on every batch.
    """

    def __init__(self, pool):
        if getattr(pool, "dcp_size", 1) != 1:
            raise UnsupportedPool("decode context parallel (dcp_size > 1) pools are not supported")
        self.pool = pool
        self.layout = pool.layout
        self.page_size = int(pool.page_size)
        self.kind = pool_kind(pool)
        self.pages = int(pool.size) // self.page_size
        if self.pages < 3:
            raise UnsupportedPool("the host pool needs at least three pages")
        if self.kind == "mha" and getattr(pool, "kv_buffer", None) is None:
            raise UnsupportedPool(f"{type(pool).__name__} has no host KV buffer (a logical pool)")
        last = self.pages - 1
        try:
            p0, s0 = _meta(pool, 0)
            p1, s1 = _meta(pool, self.page_size)
            p2, s2 = _meta(pool, 2 * self.page_size)
            pl, sl = _meta(pool, last * self.page_size)
        except Exception as exc:   # e.g. a layout without page buffer metadata
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: no page buffer metadata ({exc})") from exc
        if not (len(p0) == len(p1) == len(p2) == len(pl)) or not (s0 == s1 == s2 == sl) or not p0:
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: page segments differ between pages")
        a0 = np.array(p0, dtype=np.int64)
        diff = np.array(p1, dtype=np.int64) - a0
        if np.any(diff % self.page_size):
            raise UnsupportedPool(f"{self.layout}: page pointers are not affine in the token index")
        coef = diff // self.page_size
        for page, ptrs in ((2, p2), (last, pl)):
            if np.any(np.array(ptrs, dtype=np.int64) != a0 + page * self.page_size * coef):
                raise UnsupportedPool(f"{self.layout}: page pointers are not affine in the token index")
        sizes = np.array(s0, dtype=np.int64)
        order = np.arange(len(p0))
        if self.kind == "mha" and self.layout == "layer_first" and len(p0) % 2 == 0:
            order = np.concatenate([order[0::2], order[1::2]])  # K0 V0 K1 V1 .. -> K.. V..
        self.span = _buffer_span(pool)
        if self.span is not None and (a0.min() < self.span[0] or
                                      (np.array(pl, dtype=np.int64) + sizes).max() > self.span[1]):
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: page segments outside the host buffer")
        self.seg_addr0 = a0[order]
        self.seg_coef = coef[order]
        self.seg_size = sizes[order]
        self.seg_obj_off = np.concatenate([[0], np.cumsum(self.seg_size)[:-1]]).astype(np.int64)
        self.page_bytes = int(self.seg_size.sum())
        self.nseg = len(order)
        try:
            flat = pool.get_data_page(0, flat=True)
        except Exception as exc:
            raise UnsupportedPool(f"{type(pool).__name__}/{self.layout}: no flat data page ({exc})") from exc
        if flat.numel() * flat.element_size() != self.page_bytes:
            raise UnsupportedPool(f"{self.layout}: page segments ({self.page_bytes} bytes) differ from the "
                                  f"flat data page ({flat.numel() * flat.element_size()} bytes)")

    def describe(self) -> dict:
        return describe_pool(self.pool, self.page_bytes)

    def page_starts(self, host_indices: torch.Tensor, n: int) -> np.ndarray:
        """First token index of each of the ``n`` pages of a batch."""
        return page_starts(self.pool, host_indices, n)

    def pointers(self, starts: np.ndarray) -> np.ndarray:
        """(pages, segments) absolute addresses."""
        ptrs = self.seg_addr0[None, :] + starts[:, None] * self.seg_coef[None, :]
        if self.span is not None and ptrs.size and (
                ptrs.min() < self.span[0] or (ptrs + self.seg_size[None, :]).max() > self.span[1]):
            raise ValueError("a page lies outside the host pool buffer")
        return ptrs


def page_starts(pool, host_indices: torch.Tensor, n: int) -> np.ndarray:
    """First token index of each of the ``n`` pages named by ``host_indices`` (whole,
    aligned pages inside the pool, else ValueError)."""
    page_size = int(pool.page_size)
    if host_indices is None or host_indices.numel() != n * page_size:
        got = 0 if host_indices is None else host_indices.numel()
        raise ValueError(f"{got} host indices for {n} pages of {page_size} tokens")
    starts = host_indices.reshape(n, page_size)[:, 0].to("cpu", torch.int64).numpy()
    if np.any(starts % page_size) or np.any(starts < 0) or np.any(starts + page_size > pool.size):
        raise ValueError("host indices are not whole pages of the host pool")
    return starts


def describe_pool(pool, page_bytes: int) -> dict:
    """The page format of a host pool (part of its key namespace)."""
    kind = pool_kind(pool)
    geo = {"kind": kind, "layout": pool.layout, "page_size": int(pool.page_size),
           "dtype": str(pool.dtype).replace("torch.", ""), "page_bytes": int(page_bytes)}
    if kind == "mamba":
        geo["layers"] = int(pool.num_mamba_layers)
        geo["temporal"] = [list(pool.temporal_state_shape), str(pool.temporal_dtype).replace("torch.", "")]
        geo["conv"] = [list(s) for s in pool.conv_state_shapes]
    elif kind == "indexer":
        geo["layers"] = int(pool.layer_num)
        geo["page_stride"] = int(pool.indexer_page_stride_size)
    else:
        geo["layers"] = int(pool.layer_num)
        if kind == "mla":
            geo["kv_cache_dim"] = int(getattr(pool, "kv_cache_dim", 0))
        else:
            geo["heads"] = int(getattr(pool, "head_num", 0))
            geo["head_dim"] = int(getattr(pool, "head_dim", 0))
    return geo


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


