"""Copies between vLLM's paged KV blocks and the gateway's shared-memory ring.

One stored object is one chunk of ``blocks_per_chunk`` consecutive blocks of one
layer: the pages of those blocks back to back, as this engine lays a page out
(the layout is part of the namespace). With tensor parallelism each rank owns a
slice of every object (its heads), at ``rank * part_bytes``.

Every copy is one batched tensor op per ring batch (gather with
``index_select`` / scatter with ``index_copy_`` over the block ids); there is no
per-block Python loop. On CPU the gather writes straight into the ring slots;
on GPU it runs on a CUDA stream of the connector's own and the ring copy is
one device<->host DMA: a plain copy when the batch's parts are back to back, a
2-D copy (``cuMemcpy2DAsync``: rows of ``part_bytes``, one per slot, ``stride``
apart) when a TP rank's slices sit strided in the ring, straight from/to the
pinned ring with no host pass. A rank's heads of canonical objects (``connector/heads.py``)
are one such copy where the slots are back to back (rows of its heads, one per
page, a canonical page apart), else one per object or one per row index of an
object, whichever is fewer (``dma_plan``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from adpkv_core import threads
from adpkv_core.direct_map import Mapping, runs

logger = logging.getLogger("adpkv.vllm")


def block_major_view(t: torch.Tensor, num_blocks: int, kernel_split: Optional[int] = None) -> torch.Tensor:
    """A view of one layer's KV cache with the block index as dim 0.

    Handles vLLM's standardized per-layer ``[B, H, N, C]`` view (0.32+), kernel
    block splitting (``B = num_blocks * k``, grouped back to manager blocks) and
    the older ``(2, num_blocks, ...)`` K/V-outermost layouts (the block dim is
    moved to the front; the page of a block is then its K part and its V part).

    ``kernel_split`` (k, when the caller knows it from the block sizes): a ``[B, ...]`` view
    with more than ``num_blocks * k`` rows is a view over vLLM 0.34's extensible KV cache
    reservation (a layout that is not block-compact keeps such views; blocks keep fixed
    offsets, the committed ones first): only the first ``num_blocks * k`` rows are the cache.
    Without it, more rows than blocks are taken for a kernel split.
    """
    if kernel_split is not None and kernel_split >= 1 and t.shape[0] >= num_blocks * kernel_split \
            and t.shape[0] % kernel_split == 0:
        rows = num_blocks * kernel_split
        t = t[:rows]                       # the committed blocks of a reservation (or all of t)
        return t if kernel_split == 1 else t.unflatten(0, (num_blocks, kernel_split))
    if t.shape[0] == num_blocks:
        return t
    if t.shape[0] % num_blocks == 0 and t.shape[0] > num_blocks:
        return t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))
    if t.dim() >= 2 and t.shape[1] == num_blocks:
        return t.movedim(1, 0)
    raise ValueError(f"adpkv: cannot find the block dimension of a KV cache of shape "
                     f"{tuple(t.shape)} with {num_blocks} blocks")


class PagedLayer:
    """One layer's KV blocks and the copies of whole chunks to and from the ring."""

    def __init__(self, name: str, kv: torch.Tensor, num_blocks: int, kernel_split: Optional[int] = None):
        self.name = name
        self.view = block_major_view(kv, num_blocks, kernel_split)
        self.page_shape = tuple(self.view.shape[1:])
        self.dtype = self.view.dtype
        self.device = self.view.device
        self.page_elems = math.prod(self.page_shape)
        self.page_bytes = self.page_elems * self.view.element_size()
        self.on_gpu = self.device.type == "cuda"

    # ------------------------------------------------------------------ ring views
    def _ring_parts(self, ring: torch.Tensor, offset: int, stride: int, count: int,
                    slice_offset: int, part_bytes: int) -> torch.Tensor:
        """``count`` ring slots' parts of this rank as a (count, part_bytes) uint8 view."""
        return ring.as_strided((count, part_bytes), (stride, 1), offset + slice_offset)

    def _typed_blocks(self, parts: torch.Tensor, nblocks: int) -> Optional[torch.Tensor]:
        """The slots as (count*nblocks, *page) of our dtype when they are contiguous."""
        if not parts.is_contiguous() and parts.shape[0] > 1:
            return None
        flat = parts.reshape(-1) if parts.is_contiguous() else parts[0]
        return flat.view(self.dtype).view(parts.shape[0] * nblocks, *self.page_shape)

    def _typed_object(self, part: torch.Tensor, nblocks: int) -> torch.Tensor:
        return part.view(self.dtype).view(nblocks, *self.page_shape)

    # ------------------------------------------------------------------ gather (PUT)
    def gather(self, ring: torch.Tensor, offset: int, stride: int, count: int, slice_offset: int,
               part_bytes: int, block_ids: torch.Tensor, nblocks: int,
               stream: "torch.cuda.Stream | None" = None,
               ready: "torch.cuda.Event | None" = None) -> None:
        """Copy ``count`` objects (``nblocks`` blocks each, ids in ``block_ids``) into the ring."""
        parts = self._ring_parts(ring, offset, stride, count, slice_offset, part_bytes)
        if self.on_gpu:
            self._gather_gpu(parts, block_ids, nblocks, stream, ready)
            return
        dst = self._typed_blocks(parts, nblocks)
        if dst is not None:
            torch.index_select(self.view, 0, block_ids, out=dst)
            return
        ids = block_ids.view(count, nblocks)
        for j in range(count):   # one gather per object when slots are not back to back (TP slices)
            torch.index_select(self.view, 0, ids[j], out=self._typed_object(parts[j], nblocks))

    def _gather_gpu(self, parts, block_ids, nblocks, stream, ready):
        with torch.cuda.stream(stream) if stream is not None else _null():
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            ids = block_ids.to(self.device, non_blocking=True)
            staged = self.view.index_select(0, ids)
            # asynchronous when the ring is pinned (cuda_ring.pin_ring); synchronized below
            copy_parts(parts, staged.view(torch.uint8).view(parts.shape))
        # the ring slot is handed back when on_batch returns: the copy must be complete
        (stream or torch.cuda.current_stream()).synchronize()

    # ------------------------------------------------------------------ scatter (GET)
    def scatter(self, ring: torch.Tensor, offset: int, stride: int, count: int, slice_offset: int,
                part_bytes: int, dst_block_ids: torch.Tensor, src_positions: Optional[torch.Tensor],
                nblocks: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """Copy ``count`` objects out of the ring into the KV blocks.

        ``src_positions`` (block positions within these objects, ``j*nblocks+b``)
        selects which blocks are written, to ``dst_block_ids``; ``None`` means all
        of them in order.
        """
        parts = self._ring_parts(ring, offset, stride, count, slice_offset, part_bytes)
        if self.on_gpu:
            self._scatter_gpu(parts, dst_block_ids, src_positions, nblocks, stream)
            return
        src = self._typed_blocks(parts, nblocks)
        if src is None:
            src = parts.contiguous().view(self.dtype).view(count * nblocks, *self.page_shape)
        if src_positions is not None:
            src = src.index_select(0, src_positions)
        self.view.index_copy_(0, dst_block_ids, src)

    # ------------------------------------------------------------------ from mapped objects (direct_map)
    def load_objects(self, objects: Sequence[Mapping], dst_block_ids: torch.Tensor, nblocks: int,
                     src_positions: Optional[torch.Tensor] = None, slice_offset: int = 0,
                     part_bytes: Optional[int] = None,
                     stream: "torch.cuda.Stream | None" = None) -> "Optional[torch.cuda.Event]":
        """Copy objects straight from their read-only host mappings (``adpkv_core.direct_map``:
        acquired ``Mapping``s, this rank's part ``part_bytes`` at ``slice_offset`` of each:
        ``nblocks`` of this layer's pages back to back) into the KV blocks: block
        ``src_positions[k]`` of the objects (``j*nblocks+b``; None: all, in order) into
        ``dst_block_ids[k]``. Objects in consecutive slots of one span (``direct_map.runs``) are
        one transfer into a staging tensor (on CUDA one DMA on ``stream`` from the span's
        registration; a TP rank's slices one 2-D DMA, ``copy_parts``), then one ``index_copy_``
        into the blocks. On CUDA with a ``stream`` all of it is asynchronous and the scatter runs
        on a second stream of the device (``_scatter_stream``), so that it overlaps the next
        layer's DMA; the returned event passes once the blocks hold the objects and nothing
        reads the mappings any more: the caller keeps the mappings acquired, and reads the
        blocks, only after it. Otherwise (CPU, or no stream) synchronous: None. Nothing writes
        the mappings."""
        part = self.page_bytes * nblocks if part_bytes is None else part_bytes
        count = len(objects)
        asynchronous = self.on_gpu and stream is not None
        with torch.cuda.stream(stream) if asynchronous else _null(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            staged = torch.empty((count * nblocks, *self.page_shape), dtype=self.dtype, device=self.device)
            flat = staged.view(count, -1).view(torch.uint8)
            for run in runs(objects):
                at = run.lead + slice_offset
                host = torch.from_numpy(run.rows)[:, at:at + part]
                copy_parts(flat[run.first:run.first + run.objects], host)
        if not asynchronous:
            self._scatter_staged(staged, dst_block_ids, src_positions)
            return None
        side = _scatter_stream(self.device)
        side.wait_stream(stream)
        staged.record_stream(side)          # the allocator keeps it until the scatter is done
        with torch.cuda.stream(side):
            self._scatter_staged(staged, dst_block_ids, src_positions)
            done = torch.cuda.Event(enable_timing=True)     # timed: a benchmark's timeline reads it
            done.record(side)
        return done

    def _scatter_staged(self, staged: torch.Tensor, dst_block_ids: torch.Tensor,
                        src_positions: Optional[torch.Tensor]) -> None:
        if src_positions is not None:
            staged = staged.index_select(0, src_positions.to(self.device, non_blocking=True))
        self.view.index_copy_(0, dst_block_ids.to(self.device, non_blocking=True), staged)

    # ------------------------------------------------------------------ a rank's heads (connector/heads.py)
    def gather_share(self, share: torch.Tensor, block_ids: torch.Tensor,
                     stream: "torch.cuda.Stream | None" = None,
                     ready: "torch.cuda.Event | None" = None) -> None:
        """Copy blocks ``block_ids`` into ``share``: this rank's heads of ``count`` canonical
        objects in the ring (``HeadShare.view``: ``(count, nblocks, *page)``, strided)."""
        count, nblocks = share.shape[:2]
        with torch.cuda.stream(stream) if (self.on_gpu and stream is not None) else _null():
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            staged = self.view.index_select(0, block_ids.to(self.device)).view(count, nblocks, *self.page_shape)
            if self.on_gpu:     # 2-D DMAs of the share's rows straight into the pinned ring
                copy_parts(share, staged)
            else:
                share.copy_(staged)
        if self.on_gpu:    # the ring slot is handed back when on_batch returns
            (stream or torch.cuda.current_stream()).synchronize()

    def scatter_share(self, share: torch.Tensor, dst_block_ids: torch.Tensor,
                      src_positions: Optional[torch.Tensor],
                      stream: "torch.cuda.Stream | None" = None) -> None:
        """Copy this rank's heads of ``count`` canonical objects (``share``, as in
        ``gather_share``) into the KV blocks; ``src_positions`` as in ``scatter``."""
        count, nblocks = share.shape[:2]
        with torch.cuda.stream(stream) if (self.on_gpu and stream is not None) else _null():
            if self.on_gpu:     # 2-D DMAs of the share's rows straight from the pinned ring
                src = torch.empty(share.shape, dtype=share.dtype, device=self.device)
                copy_parts(src, share)
            else:
                src = share
            if src_positions is None:
                self.view[dst_block_ids.to(self.device).view(count, nblocks)] = src
            else:
                q = src_positions.to(self.device)
                self.view.index_copy_(0, dst_block_ids.to(self.device), src[q // nblocks, q % nblocks])
        if self.on_gpu:
            (stream or torch.cuda.current_stream()).synchronize()

    def _scatter_gpu(self, parts, dst_block_ids, src_positions, nblocks, stream):
        count = parts.shape[0]
        with torch.cuda.stream(stream) if stream is not None else _null():
            dev = torch.empty(parts.shape, dtype=torch.uint8, device=self.device)
            copy_parts(dev, parts)
            src = dev.view(self.dtype).view(count * nblocks, *self.page_shape)
            # the ids from pageable memory: staged at the call, no wait (the one wait: below)
            if src_positions is not None:
                src = src.index_select(0, src_positions.to(self.device, non_blocking=True))
            self.view.index_copy_(0, dst_block_ids.to(self.device, non_blocking=True), src)
        (stream or torch.cuda.current_stream()).synchronize()


# ---------------------------------------------------------------------------- our threads' OpenMP
def one_openmp_thread() -> None:
    """Run the calling thread's torch CPU ops on one OpenMP thread from now on (every thread of
    ``adpkv_core.threads`` runs it as it starts).

    libgomp gives every thread that starts a parallel region a team of its own, and once the
    process holds more OpenMP threads than CPUs it stops spinning between regions: the
    engine's team then sleeps and is woken at every parallel op of a forward pass. One ring
    batch copied on the client's thread was enough to slow a vLLM-CPU engine's decode steps by
    a fifth or more (docs/benchmarks.md, "Decode on a CPU engine"). ``torch.set_num_threads``
    is no way out: it sets the process's default (for threads torch has not yet seen) and
    MKL's; the OpenMP runtime's own ``omp_set_num_threads`` sets the calling thread's count
    alone, once torch's first use of this thread set it from that default."""
    setter = _omp_set_num_threads()
    if setter is None:       # no OpenMP runtime in the process: nothing makes teams
        return
    torch.get_num_threads()  # torch's set-up of this thread first (it sets the thread's count)
    setter(1)


threads.at_start(one_openmp_thread)


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads():
    """``omp_set_num_threads`` of torch's OpenMP runtime (the one loaded from torch's own
    folders, ``torch/lib`` or ``torch.libs``: other wheels bring their own, e.g. sentencepiece's),
    or None where this process has none."""
    try:
        with open("/proc/self/maps") as fh:
            mapped = {fields[5].strip() for fields in (line.split(None, 5) for line in fh) if len(fields) == 6}
    except OSError:
        return None
    home = os.path.dirname(os.path.abspath(torch.__file__))
    for path in sorted(mapped):
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5", "libomp")) and \
                (path.startswith(home + os.sep) or path.startswith(home + ".libs" + os.sep)):
            try:
                fn = ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_int]
            fn.restype = None
            return fn
    logger.debug("adpkv: torch's OpenMP runtime not found in this process")
    return None


# ---------------------------------------------------------------------------- ring <-> GPU DMA
_SCATTER_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _scatter_stream(device: torch.device) -> "torch.cuda.Stream":
    """The device's stream for the scatters of ``load_objects`` (made once; a scatter there
    overlaps the DMA of the next layer on the caller's stream)."""
    s = _SCATTER_STREAMS.get(device)
    if s is None:
        s = _SCATTER_STREAMS[device] = torch.cuda.Stream(device=device)
    return s


def copy_parts(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy host parts to or from the GPU on the current stream: ``dst`` and ``src`` have one
    shape and dtype, one of them in host memory (the ring or a ``direct_map`` span; strided:
    a TP rank's (count, part_bytes) uint8 slices, ``stride`` apart, or ``HeadShare.view``), the
    other a contiguous GPU tensor. Back-to-back parts are one plain copy; strided ones go by
    2-D DMA straight from/to the (pinned) host memory (``dma_plan``). Asynchronous when the
    host memory is pinned (registered)."""
    host = src if dst.is_cuda else dst
    if host.is_contiguous():
        dst.copy_(src, non_blocking=True)
    elif not _dma_2d(dst, src):
        # no driver entry point: torch makes the strided side contiguous on the host first
        dst.copy_(src.contiguous() if src is host else src, non_blocking=False)


class _Memcpy2D(ctypes.Structure):
    """The CUDA driver's ``CUDA_MEMCPY2D``."""

    _fields_ = [(side + name, kind) for side in ("src", "dst") for name, kind in (
        ("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("MemoryType", ctypes.c_int),
        ("Host", ctypes.c_void_p), ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p),
        ("Pitch", ctypes.c_size_t))] + [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_CU_MEMORYTYPE_HOST, _CU_MEMORYTYPE_DEVICE = 1, 2


class _Driver:
    """``cuMemcpy2DAsync`` of ``libcuda.so.1`` (loaded once), run in the device's primary
    context (torch's), pushed for the call: the caller's thread needs no context of its own."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.memcpy2d = lib.cuMemcpy2DAsync_v2
        self.memcpy2d.argtypes = (ctypes.POINTER(_Memcpy2D), ctypes.c_void_p)
        self.device_get, self.retain = lib.cuDeviceGet, lib.cuDevicePrimaryCtxRetain
        self.push, self.pop = lib.cuCtxPushCurrent_v2, lib.cuCtxPopCurrent_v2
        self.push.argtypes = (ctypes.c_void_p,)
        self._ctx: dict[int, ctypes.c_void_p] = {}

    def context(self, ordinal: int) -> ctypes.c_void_p:
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            _check(self.device_get(ctypes.byref(dev), ordinal), "cuDeviceGet")
            _check(self.retain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._ctx[ordinal] = ctx
        return ctx


_driver: "_Driver | Literal[False] | None" = None   # None: not loaded yet; False: not usable


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(f"{what} returned CUDA error {rc}")


def rows_of(t: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """(row bytes, rows, pitch in bytes) of a 2-D tensor whose rows are each contiguous."""
    if t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1) or t.stride(0) < t.shape[1]:
        return None
    size = t.element_size()
    return t.shape[1] * size, t.shape[0], t.stride(0) * size


@dataclass(frozen=True)
class Copy2D:
    """One 2-D copy (``cuMemcpy2DAsync``): ``height`` rows of ``width`` bytes, the first at
    byte ``src_offset`` / ``dst_offset`` from the tensors' ``data_ptr()``, ``*_pitch`` apart."""

    src_offset: int
    dst_offset: int
    width: int
    height: int
    src_pitch: int
    dst_pitch: int


def byte_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` as a (t.shape[0], rows, width) uint8 view (no copy) whose rows are its longest
    contiguous runs of trailing elements; None where it has none (last dim strided) or no such
    view. A ``HeadShare.view`` of ``count`` objects is (count, nblocks · rows per page, this
    rank's heads of one row); a rank's (count, part_bytes) slices of ring slots (count, 1, part)."""
    if t.dim() < 2 or t.numel() == 0:
        return None
    width, dim = 1, t.dim()
    while dim > 1 and (t.stride(dim - 1) == width or t.shape[dim - 1] == 1):
        width *= t.shape[dim - 1]
        dim -= 1
    if dim == t.dim():
        return None
    try:
        return t.view(torch.uint8).view(t.shape[0], -1, width * t.element_size())
    except RuntimeError:
        return None


def dma_plan(dst: torch.Tensor, src: torch.Tensor) -> Optional[list[Copy2D]]:
    """The 2-D copies that copy ``src`` into ``dst`` (one shape and dtype), both seen as
    ``byte_rows`` of one width (the narrower side's; the other side's rows split to it): one
    copy where each side's rows are one pitch apart throughout (a rank's slices of ring slots,
    back-to-back objects), else one per object (dim 0) or one per row index within an object
    over all objects, whichever is fewer (a ``HeadShare.view``: one pitch within an object, the
    slot stride between objects). None where either side has no such rows (rows overlapping,
    pitches not uniform): then ``copy_parts`` lets torch copy."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        return None
    d3, s3 = byte_rows(dst), byte_rows(src)
    if d3 is None or s3 is None:
        return None
    width = min(d3.shape[2], s3.shape[2])
    try:
        d3, s3 = (t.view(t.shape[0], -1, width) for t in (d3, s3))
    except RuntimeError:
        return None
    count, rows = s3.shape[:2]
    try:
        whole = rows_of(d3.view(-1, width)), rows_of(s3.view(-1, width))
    except RuntimeError:
        whole = None, None
    if whole[0] is not None and whole[1] is not None:
        return [Copy2D(0, 0, width, count * rows, whole[1][2], whole[0][2])]
    if any(rows_of(t[0]) is None or rows_of(t[:, 0]) is None for t in (d3, s3)):
        return None
    if count <= rows:                         # one per object: its rows
        return [Copy2D(j * s3.stride(0), j * d3.stride(0), width, rows, s3.stride(1), d3.stride(1))
                for j in range(count)]
    return [Copy2D(i * s3.stride(1), i * d3.stride(1), width, count, s3.stride(0), d3.stride(0))
            for i in range(rows)]             # one per row index: that row of every object


def _dma_2d(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``src`` copied into ``dst`` by the 2-D copies of ``dma_plan`` (``cuMemcpy2DAsync``) on
    the current stream; False where the driver cannot do it (then ``copy_parts`` lets torch
    copy all of it again, whatever part of it was copied)."""
    global _driver
    plan = dma_plan(dst, src)
    if plan is None:
        return False
    if _driver is None:
        try:
            _driver = _Driver()
        except (OSError, AttributeError) as exc:
            logger.warning("adpkv: no CUDA driver 2-D copy (%s): strided ring parts are made contiguous "
                           "on the host before each copy", exc)
            _driver = False
    driver = _driver
    if driver is None or driver is False:
        return False
    gpu = dst if dst.is_cuda else src
    stream = torch.cuda.current_stream(gpu.device)
    try:
        _check(driver.push(driver.context(gpu.device.index)), "cuCtxPushCurrent")
    except OSError as exc:
        logger.warning("adpkv: %s: strided ring parts go through a host copy", exc)
        _driver = False
        return False
    try:
        for c in plan:
            p = _Memcpy2D(WidthInBytes=c.width, Height=c.height, srcPitch=c.src_pitch, dstPitch=c.dst_pitch)
            for side, t, at in (("src", src, c.src_offset), ("dst", dst, c.dst_offset)):
                if t.is_cuda:
                    setattr(p, side + "MemoryType", _CU_MEMORYTYPE_DEVICE)
                    setattr(p, side + "Device", t.data_ptr() + at)
                else:
                    setattr(p, side + "MemoryType", _CU_MEMORYTYPE_HOST)
                    setattr(p, side + "Host", t.data_ptr() + at)
            rc = driver.memcpy2d(ctypes.byref(p), ctypes.c_void_p(stream.cuda_stream))
            if rc != 0:
                logger.warning("adpkv: cuMemcpy2DAsync returned CUDA error %d (rows of %d bytes, pitches "
                               "%d/%d): strided ring parts go through a host copy from now on",
                               rc, c.width, c.src_pitch, c.dst_pitch)
                _driver = False
                return False
    finally:
        driver.pop(ctypes.byref(ctypes.c_void_p()))   # the context pushed above
    return True


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def ring_tensor(client) -> Optional[torch.Tensor]:
    """The client's ring as a flat uint8 tensor (shared memory, no copy)."""
    if client is None or client.ring is None:
        return None
    return torch.frombuffer(client.ring, dtype=torch.uint8)


def as_index(ids: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long)
