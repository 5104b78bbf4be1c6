"""The worker half of ``AdpOffloadingSpec``: store and load jobs between this
rank's KV blocks and the gateway.

One object per (offloaded chunk, KV tensor); a job is one PUT or GET per tensor
(a long load's chunks of one tensor go out as several parallel GETs:
``shard_ranges``), gathered/scattered with the KV connector's copy code
(``copy.PagedLayer``). The jobs are an ``adpkv_core.jobs.JobBook`` under vLLM's job
ids; ``get_finished`` reports each once all its requests are done: a store always as
a success (a lost store is a future miss; vLLM 0.32 asserts on failed jobs), a load
as failed when any object was not read.

The rank holds the gateway through ``adpkv_core.attachment.Attachment``; a fresh
attachment is put to use at the start of a ``submit_*`` (between jobs), and
every job runs to its end on the attachment it started on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import torch

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    get_offload_group_idx,
)

from adpkv_core.attachment import Attachment, Session
from adpkv_core.jobs import FinishedJob, JobBook

from ..common.copy import PagedLayer, as_index
from ..common.vllm_api import offload_device_blocks
from .backend import OffloadBackend, object_digest

logger = logging.getLogger("adpkv.vllm")


def shard_ranges(count: int, shards: int) -> list[tuple[int, int]]:
    """Split ``count`` chunks of one layer's load into contiguous parallel requests.

    ``shards`` 0 (auto): one request per 32 chunks, at most 8, so a long load keeps
    several gateway requests (each with its own batches) in flight at once.
    """
    if count <= 0:
        return []
    n = shards or min(8, -(-count // 32))
    n = max(1, min(n, count))
    step = -(-count // n)
    return [(i, min(i + step, count)) for i in range(0, count, step)]


@dataclass(frozen=True)
class _Transfer:
    """What a job of the book carries: store or load, and the bytes its requests move."""

    store: bool
    nbytes: int


class AdpOffloadingWorker(OffloadingWorker):
    def __init__(self, backend: OffloadBackend, kv_caches: CanonicalKVCaches):
        self.backend = backend
        cfg = backend.config
        self.rank = cfg.parallel.rank
        self.bpc = cfg.cache.blocks_per_chunk
        self.keys = backend.keys_for_rank(self.rank)
        # per group: [(layer index for the key, PagedLayer)], one per distinct tensor
        self.groups: list[list[tuple[int, PagedLayer]]] = []
        tensors = kv_caches.tensors
        self._kv_caches = kv_caches          # what a job's device pointers (vLLM >= 0.34) address
        for refs in kv_caches.group_data_refs:
            seen: set[int] = set()
            layers: list[tuple[int, PagedLayer]] = []
            for i, ref in enumerate(refs):
                if ref.tensor_idx in seen:
                    continue
                seen.add(ref.tensor_idx)
                t = tensors[ref.tensor_idx].tensor
                layers.append((i, PagedLayer(f"t{ref.tensor_idx}", t, t.shape[0])))
            self.groups.append(layers)
        first = self.groups[0][0][1]
        self._on_gpu = first.on_gpu
        self._stream = torch.cuda.Stream(device=first.device) if first.on_gpu else None
        self._jobs: JobBook[_Transfer] = JobBook()
        layout = {"engine": "vllm-offloading", "tensors": len(tensors), "page_bytes": first.page_bytes,
                  "blocks_per_chunk": self.bpc}
        self.attachment = Attachment(backend.client_config, backend.engine_id, self.rank,
                                     backend.world, layout, reconnect_s=backend.reconnect_s,
                                     install="on_refresh",
                                     on_attach=self._on_attach, on_detach=self._on_detach,
                                     name="adpkv-vllm-offload")
        self.session: Optional[Session] = self.attachment.session
        logger.info("adpkv offloading worker rank %d: %d tensors, page %d bytes, %d blocks per chunk",
                    self.rank, len(tensors), first.page_bytes, self.bpc)

    # ---------------------------------------------------------------- attachment
    def _on_attach(self, s: Session) -> None:
        s.state["ring"] = s.ring.tensor() if s.ring is not None else None
        if s.state["ring"] is not None and self._on_gpu:
            from ..common.cuda_ring import pin_ring
            pin_ring(s.state["ring"])     # DMA copies ring <-> GPU on our stream

    def _on_detach(self, s: Session) -> None:
        ring = s.state.get("ring")
        if ring is not None and self._on_gpu:
            if self._stream is not None:
                self._stream.synchronize()
            from ..common.cuda_ring import unpin_ring
            unpin_ring(ring)

    @property
    def client(self):
        """The client jobs start on now (None after shutdown)."""
        return self.session.client if self.session is not None else None

    def _begin(self) -> Optional[Session]:
        """A job starts: put a fresh attachment to use, when one is ready; the session
        to run the whole job on, or None when the external cache is off."""
        self.session = self.attachment.refresh()
        s = self.session
        return s if s is not None and s.enabled and s.state.get("ring") is not None else None

    def _group_blocks(self, device) -> list[tuple[int, list[int], int]]:
        """(group, block ids, index of the first block) of a job's device side: vLLM <= 0.33's
        ``GPULoadStoreSpec`` or vLLM 0.34's ``DevicePointers`` (``vllm_api.offload_device_blocks``)."""
        return offload_device_blocks(device, self._kv_caches.tensors, self._kv_caches.group_data_refs)

    def _keys_by_group(self, keys: list[bytes]) -> dict[int, list[bytes]]:
        by: dict[int, list[bytes]] = {}
        for k in keys:
            by.setdefault(get_offload_group_idx(k), []).append(k)
        return by

    # ---------------------------------------------------------------- stores
    def submit_store(self, job_id: int, src_spec, dst_spec: LoadStoreSpec) -> bool:
        """``src_spec``: the blocks to store (vLLM <= 0.33: ``GPULoadStoreSpec``; 0.34: the
        ``DevicePointers`` it passes in that place, positionally, as ``device_ptrs``). The
        parameters keep the names 0.26 to 0.33 declare."""
        futures, nbytes = self._store_requests(job_id, src_spec, dst_spec)
        # a store that cannot happen (cache off, blocks unreadable) is a future miss, not a failure
        self._jobs.submit(futures, _Transfer(store=True, nbytes=nbytes), job_id=job_id)
        return True

    def _store_requests(self, job_id: int, src_spec, dst_spec: LoadStoreSpec) -> tuple[list[Future], int]:
        """The PUTs of a store job and the bytes they move (none while the cache is off or
        when its blocks cannot be read)."""
        futures: list[Future] = []
        nbytes = 0
        keys_by_group = self._keys_by_group(dst_spec.keys)
        s = self._begin()
        if s is None:
            return futures, nbytes
        client, ring = s.client, s.state["ring"]
        try:
            groups = self._group_blocks(src_spec)
        except ValueError:
            logger.exception("adpkv: store job %d: its blocks cannot be read; not stored", job_id)
            return futures, nbytes
        for g, block_ids, first_index in groups:
            keys = keys_by_group.get(g, [])
            if not keys:
                continue
            # the stored chunks are the last len(keys) full chunks of these blocks
            skip = (-first_index) % self.bpc
            ids = block_ids[skip: skip + len(keys) * self.bpc]
            if len(ids) != len(keys) * self.bpc:
                logger.warning("adpkv: store job %d: %d blocks for %d chunks; skipped", job_id,
                               len(ids), len(keys))
                continue
            blocks = as_index(ids)
            digests = [object_digest(k) for k in keys]
            for layer_idx, layer in self.groups[g]:
                obj = layer.page_bytes * self.bpc

                def on_batch(b, layer=layer, blocks=blocks, obj=obj):
                    layer.gather(ring, b.offset, b.stride, b.count, 0, obj,
                                 blocks[b.first * self.bpc:(b.first + b.count) * self.bpc], self.bpc,
                                 self._stream)
                    return True

                futures.append(client.put(self.keys.keys(digests, [layer_idx]), obj, on_batch))
                nbytes += obj * len(keys)
        return futures, nbytes

    # ---------------------------------------------------------------- loads
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec, expedited: bool = False) -> bool:
        """``dst_spec``: the blocks to load into (vLLM <= 0.33: ``GPULoadStoreSpec``; 0.34: the
        ``DevicePointers`` it passes in that place, positionally, as ``device_ptrs``). ``expedited`` (vLLM >= 0.33: a load its request waits for within
        this step, through ``wait``): the same GETs. Nothing here queues a load behind another:
        every job's GETs go to the gateway at once."""
        futures, nbytes, complete = self._load_requests(job_id, src_spec, dst_spec)
        self._jobs.submit(futures, _Transfer(store=False, nbytes=nbytes), job_id=job_id, failed=not complete)
        return True

    def _load_requests(self, job_id: int, src_spec: LoadStoreSpec, dst_spec) -> tuple[list[Future], int, bool]:
        """The GETs of a load job, the bytes they move, and whether they cover the whole job
        (not while the cache is off, nor when some of its blocks cannot be written)."""
        futures: list[Future] = []
        nbytes = 0
        complete = True
        keys_by_group = self._keys_by_group(src_spec.keys)
        s = self._begin()
        if s is None:
            return futures, nbytes, False
        client, ring = s.client, s.state["ring"]
        try:
            groups = self._group_blocks(dst_spec)
        except ValueError:
            logger.exception("adpkv: load job %d: its blocks cannot be written; failed", job_id)
            return futures, nbytes, False
        for g, block_ids, first_index in groups:
            keys = keys_by_group.get(g, [])
            if not keys or not block_ids:
                continue
            skip = first_index % self.bpc            # first GPU block inside the first chunk
            positions = as_index(range(skip, skip + len(block_ids)))
            if positions[-1] >= len(keys) * self.bpc:
                logger.error("adpkv: load job %d: %d blocks do not fit %d chunks", job_id,
                             len(block_ids), len(keys))
                complete = False
                continue
            dst = as_index(block_ids)
            digests = [object_digest(k) for k in keys]
            for layer_idx, layer in self.groups[g]:
                obj = layer.page_bytes * self.bpc
                layer_keys = self.keys.keys(digests, [layer_idx])
                for start, stop in shard_ranges(len(keys), self.backend.shard_reads):

                    def on_batch(b, layer=layer, dst=dst, positions=positions, start=start, obj=obj):
                        lo, hi = (start + b.first) * self.bpc, (start + b.first + b.count) * self.bpc
                        sel = (positions >= lo) & (positions < hi)
                        if not bool(sel.any()):
                            return True
                        layer.scatter(ring, b.offset, b.stride, b.count, 0, obj, dst[sel],
                                      positions[sel] - lo, self.bpc, self._stream)
                        return True

                    futures.append(client.get(layer_keys[start:stop], obj, on_batch))
                nbytes += obj * len(keys)
        return futures, nbytes, complete

    # ---------------------------------------------------------------- completion
    def _result(self, job: FinishedJob[_Transfer]) -> TransferResult:
        """vLLM's result of a finished job: a store always succeeds (vLLM 0.32 asserts on failed
        jobs; a lost store is a future miss), a load when every object was read."""
        ok = job.meta.store or job.ok
        if not ok:
            logger.error("adpkv: load job %d failed after its chunks were found; vLLM's "
                         "OffloadingConnector cannot recompute it (it stops rather than serve a "
                         "wrong KV cache). Use AdpKVConnector where a failed load must be recomputed.",
                         job.id)
        return TransferResult(job_id=job.id, success=ok, transfer_size=job.meta.nbytes,
                              transfer_time=job.seconds)

    def get_finished(self) -> list[TransferResult]:
        return [self._result(job) for job in self._jobs.pop_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self._jobs.wait(job_ids)

    def shutdown(self) -> None:
        self._jobs.wait(timeout=5)
        self.attachment.close()      # BYE; on_detach unpins the ring
        self.session = None
