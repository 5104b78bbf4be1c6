"""NVLink fan-out of MLA restores (the connector's ``adpkv.nvlink_fanout`` setting).

On an MLA model every tensor-parallel rank holds the same latent pages, so every
rank would copy every restored page from the ring to its GPU. With fan-out each
rank copies only its share of each ring batch (``share``: a contiguous part of
the batch's objects, so it is still one DMA), and right before the layer
computes (``wait_for_layer_load``) the ranks exchange the rest over NVLink:

1. each rank all-gathers which objects it wrote (a byte per object), so every
   rank derives the same *source* rank of every object, and the same misses,
   from the same table, whatever happened to the GET on any one rank;
2. each rank packs the pages of the objects it is the source of into a staging
   buffer and the ranks all-gather those buffers (NCCL over NVLink), in rounds
   when they do not fit the staging buffer; each rank scatters what the others
   sent into its paged KV blocks.

Host-to-GPU traffic of a restore drops from one copy per rank to one per group.
The exchange runs on a stream of its own and the compute stream waits for it,
not the host. The staging buffer (``STAGING_BYTES``) and the NCCL communicator
are allocated after vLLM sized its KV cache, outside ``gpu_memory_utilization``.

Contract: every rank of the group calls ``exchange`` for the same layers in the
same order (vLLM's layer hooks do: the same model on every rank), also a rank
whose gateway is gone (it then sources nothing). ``for_vllm`` turns fan-out off,
logged once, where it cannot apply: not MLA, one rank, no CUDA, GPUs without
NVLink between every pair, or the communicator could not be set up on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("adpkv.vllm")

STAGING_BYTES = 256 << 20      # send + receive staging of one exchange round, per rank

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def share(first: int, count: int, rank: int, world: int) -> tuple[int, int]:
    """The objects ``[lo, hi)`` of a ring batch ``[first, first+count)`` that ``rank`` copies
    from the ring: the batch cut into ``world`` contiguous parts as even as they go."""
    return first + count * rank // world, first + count * (rank + 1) // world


def sources(wrote: torch.Tensor) -> torch.Tensor:
    """Per object, the rank whose copy the group uses (the lowest that wrote it), or -1
    when no rank did: ``wrote`` is the all-gathered (world, objects) table of 0/1."""
    any_wrote = wrote.bool().any(0)
    first = wrote.bool().to(torch.uint8).argmax(0).to(torch.long)
    return torch.where(any_wrote, first, torch.full_like(first, -1))


@dataclass
class LayerLoad:
    """One layer's load on this rank: which of the request's objects it wrote."""

    wrote: torch.Tensor            # (objects,) uint8, on the CPU; set from the I/O thread


class Fanout:
    """One rank's side of the fan-out: share copies and the exchange, over ``group``.

    ``group`` is a process group of the ranks (NCCL on GPUs; gloo works for CPU tensors);
    ``rank``/``world`` are this rank's place in it.
    """

    def __init__(self, group, rank: int, world: int, device: torch.device,
                 staging_bytes: int = STAGING_BYTES):
        self.group, self.rank, self.world = group, rank, world
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.on_gpu else None
        self.staging_bytes = staging_bytes
        self._staging: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ the I/O thread's side
    def begin(self, objects: int) -> LayerLoad:
        return LayerLoad(torch.zeros(objects, dtype=torch.uint8))

    def scatter_share(self, load: LayerLoad, layer, ring: torch.Tensor, batch, slice_: tuple[int, int],
                      index, blocks_per_chunk: int, stream=None) -> None:
        """Copy this rank's share of a ring batch into ``layer``'s blocks (``index``: the
        worker's ``ChunkPlanIndex``; ``stream``: the connector's copy stream)."""
        lo, hi = share(batch.first, batch.count, self.rank, self.world)
        if hi <= lo:
            return
        k0, k1 = lo - batch.first, hi - batch.first
        hits = batch.hits[k0:k1] if batch.hits is not None else None
        dst, pos = index.batch_blocks(lo, hi - lo, hits)
        if dst is not None:
            layer.scatter(ring, batch.offset + k0 * batch.stride, batch.stride, hi - lo, slice_[0], slice_[1],
                          dst, pos, blocks_per_chunk, stream)
        load.wrote[lo:hi] = 1 if hits is None else torch.as_tensor([bool(h) for h in hits], dtype=torch.uint8)

    # ------------------------------------------------------------------ the layer hook's side
    def exchange(self, load: Optional[LayerLoad], layer, index) -> torch.Tensor:
        """Give every rank the pages of the layer it did not copy itself; returns, per object
        of the request, whether it is now in this rank's blocks (the same on every rank).

        ``load`` None: this rank started no copy (its gateway is gone); it takes part all the
        same, sourcing nothing, so that the other ranks do not wait for it."""
        objects = len(index.digests)
        wrote = load.wrote if load is not None else torch.zeros(objects, dtype=torch.uint8)
        with torch.cuda.stream(self.stream) if self.on_gpu else _null():
            table = torch.empty(self.world * objects, dtype=torch.uint8, device=self.device)
            _all_gather(table, wrote.to(self.device), group=self.group)
            src = sources(table.view(self.world, objects).cpu())
            entry_src = src[torch.div(index.pos, index.bpc, rounding_mode="floor")]
            per_rank = [torch.nonzero(entry_src == p).flatten() for p in range(self.world)]
            self._move(layer, index.dst, per_rank)
        if self.on_gpu:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return src >= 0

    def _move(self, layer, dst: torch.Tensor, per_rank: Sequence[torch.Tensor]) -> None:
        """All-gather each rank's source pages in rounds that fit the staging buffer."""
        most = max(len(e) for e in per_rank)
        if most == 0:
            return
        view = layer.view
        page = layer.page_shape
        rounds_of = max(1, self.staging_bytes // ((self.world + 1) * layer.page_bytes))
        dst_dev = dst.to(self.device)
        ids = [dst_dev[e.to(self.device)] for e in per_rank]
        for r0 in range(0, most, rounds_of):
            n = min(rounds_of, most - r0)
            send, recv = self._buffers(n, layer)
            mine = ids[self.rank][r0:r0 + n]
            if len(mine):
                torch.index_select(view, 0, mine, out=send[:len(mine)])
            _all_gather(recv.view(-1), send.view(-1), group=self.group)
            got = recv.view(self.world, n, *page)
            for p in range(self.world):
                theirs = ids[p][r0:r0 + n]
                if p != self.rank and len(theirs):
                    view.index_copy_(0, theirs, got[p, :len(theirs)])

    def _buffers(self, n: int, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(send (n, *page), receive (world*n, *page)) views of the one staging buffer."""
        need = (self.world + 1) * n * layer.page_bytes
        if self._staging is None or self._staging.numel() < need:     # grows to STAGING_BYTES at most
            self._staging = torch.empty(need, dtype=torch.uint8, device=self.device)
        flat = self._staging[:need].view(layer.dtype)
        per = n * layer.page_elems
        return flat[:per].view(n, *layer.page_shape), flat[per:].view(self.world * n, *layer.page_shape)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# =============================================================================== setting it up in vLLM
_logged: set[str] = set()


def _off(why: str) -> None:
    if why not in _logged:
        _logged.add(why)
        logger.warning("adpkv: nvlink_fanout is off: %s", why)


def why_not(enabled: bool, mla: bool, tp_size: int, device_type: str) -> Optional[str]:
    """Why fan-out cannot apply to this engine (None: it can, given NVLink between the ranks)."""
    if not enabled:
        return "not asked for"
    if not mla:
        return "the model is not MLA (each rank holds its own heads, there is nothing to share)"
    if tp_size < 2:
        return "tensor_parallel_size is 1 (no peer to share with)"
    if device_type != "cuda":
        return f"the KV cache is on {device_type}, not on CUDA GPUs"
    return None


def physical_gpu(index: int) -> str:
    """The NVML name of CUDA device ``index`` of this process: an index or a UUID,
    through CUDA_VISIBLE_DEVICES."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[index] if index < len(visible) else str(index)


def nvlink_between(gpus: Sequence[str]) -> tuple[bool, str]:
    """(True, "") when NVML reports NVLink peer-to-peer between every pair of ``gpus``
    (indices or UUIDs), else (False, why)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:             # no NVML library, no driver
        return False, f"NVML is not available ({exc})"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(int(g)) if g.isdigit() else
                   pynvml.nvmlDeviceGetHandleByUUID(g) for g in gpus]
        for i, a in enumerate(handles):
            for b in handles[i + 1:]:
                if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) != \
                        pynvml.NVML_P2P_STATUS_OK:
                    return False, f"no NVLink between GPUs {', '.join(gpus)}"
        return True, ""
    except pynvml.NVMLError as exc:
        return False, f"NVML could not tell the links between GPUs {', '.join(gpus)} ({exc})"
    finally:
        pynvml.nvmlShutdown()


def for_vllm(enabled: bool, mla: bool, tp_size: int, device: torch.device) -> Optional[Fanout]:
    """The rank's ``Fanout`` inside a vLLM worker, or None (the reason logged once).

    Collective over vLLM's tensor-parallel group when fan-out can apply: the ranks agree
    on NVLink from one table of their GPUs and on the outcome of the communicator's setup
    (each rank says whether its side worked; fan-out is on only where all did)."""
    why = why_not(enabled, mla, tp_size, torch.device(device).type)
    if why is not None:
        if enabled:
            _off(why)
        return None
    from vllm.distributed.parallel_state import get_tp_group
    tp = get_tp_group()
    gpus: list = [None] * tp.world_size
    dist.all_gather_object(gpus, physical_gpu(torch.device(device).index or 0), group=tp.cpu_group)
    linked, why = nvlink_between(gpus)
    if not linked:
        _off(why)
        return None
    group, problem = None, ""
    try:
        group = dist.new_group(tp.ranks, backend="nccl", use_local_synchronization=True)
        probe = torch.ones(1, device=device)          # the communicator is made (and tried) now
        dist.all_reduce(probe, group=group)
        ok = bool(probe.item() == tp.world_size)
    except Exception as exc:                         # NCCL missing or refusing: no fan-out, no crash
        ok, problem = False, f"the NCCL communicator could not be set up ({exc})"
    votes: list = [None] * tp.world_size
    dist.all_gather_object(votes, ok, group=tp.cpu_group)
    if not all(votes):
        _off(problem or "the NCCL communicator could not be set up on every rank")
        return None
    logger.info("adpkv: nvlink_fanout on: rank %d of %d copies its share of each ring batch, "
                "the rest comes over NVLink (staging %d MiB)", tp.rank_in_group, tp.world_size,
                STAGING_BYTES >> 20)
    return Fanout(group, tp.rank_in_group, tp.world_size, torch.device(device))
