"""``AdpOffloadingSpec``: adpkv as a backend of vLLM's own ``OffloadingConnector``.

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"AdpOffloadingSpec","spec_module_path":"adpkv_vllm",
        "block_size":256,"adpkv.port":5557,"adpkv.namespace":"llama-3-8b-tp1"}}'

API: the offloading framework of vLLM 0.32 (``vllm.v1.kv_offload.base``):
``OffloadingSpec(OffloadingConfig)`` with ``get_manager()`` (scheduler) and
``get_worker(CanonicalKVCaches)`` (each worker); ``OffloadingManager.lookup``
answers one key at a time and may say RETRY, ``OffloadingWorker`` has
submit_load / submit_store / get_finished / wait. Older vLLM (no
``OffloadingWorker``) gets a clear error at import.

* Manager: a lookup of a key not yet asked returns RETRY and joins the step's
  batch; ``on_schedule_end`` sends the whole batch as one EXIST (one round trip
  per step), with ``lock`` so that hits stay pinned against eviction until they
  are loaded (or the request ends). Results are per request.
* Worker: one object per (offloaded chunk, KV tensor); PUT/GET per tensor per
  job, gathered/scattered with the KV connector's copy code (``copy.PagedLayer``).
* Keys: the offload key (hash of the chunk's last block + KV cache group) under a
  namespace made of ``adpkv.namespace``, the model, the KV dtype, the page
  geometry and this worker's TP rank: two models of the same geometry, or two
  TP layouts, never read each other's objects.

Placement is by key, never by dialog mark, so ``adpkv.affinity_chunks`` has no
effect here (logged at start when set). A dialog mark is a hash of the first
chunk(s) of the request, and every call must give every chunk of a request the
same mark, or the EXIST/GET would look on another card than the PUT. vLLM 0.32's
offloading scheduler never shows the manager those first chunks reliably: the
``ReqContext`` of ``lookup``/``prepare_store``/``prepare_load`` carries
``req_id``, ``kv_transfer_params`` and ``kv_hints`` but no block hashes (its
``_offload_key_positions`` is never filled by the scheduler); lookups start at
the chunk after vLLM's own prefix-cache hit (``start_chunk_idx``) and
sliding-window lookups scan from the end; ``prepare_store`` gets only the chunks
not stored yet. A chunk already in vLLM's cache or on the card would therefore
give its dialog different marks in different calls: misses on multi-card
gateways.

Limit of vLLM 0.32: ``OffloadingConnector`` asserts that every transfer job
succeeds, so a load that fails after its chunks were found (the gateway crashed
in between; a corrupt object) cannot be recomputed. This backend then reports
the job as failed and vLLM stops the engine rather than serve a wrong KV cache
(logged). Pins make eviction races impossible; use ``AdpKVConnector`` where a
failed load must be recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Collection, Iterable, Optional

import torch

try:
    from vllm.v1.kv_offload.base import (  # vLLM with the OffloadingWorker API (0.32 shape)
        CanonicalKVCaches,
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
        TransferResult,
        get_offload_group_idx,
    )
except ImportError as exc:  # pragma: no cover - depends on the vLLM version
    raise ImportError(
        "adpkv_vllm.AdpOffloadingSpec needs vLLM's offloading API with OffloadingManager.lookup/"
        "prepare_load/prepare_store and OffloadingWorker.submit_load/submit_store/get_finished/wait "
        f"(vllm.v1.kv_offload.base, vLLM 0.32 shape); this vLLM lacks it ({exc}). Use the KV "
        "connector instead: kv_connector=AdpKVConnector, kv_connector_module_path=adpkv_vllm") from exc

from adpkv_core.keys import KeyBuilder, chunk_digest
from adpkv_core.settings import ClientConfig

from .common import LookupClient, close_client, ensure_logging, open_rank_client
from .copy import PagedLayer, as_index, ring_tensor

logger = logging.getLogger("adpkv.vllm")


def _namespace(config, base: str) -> str:
    """Deployment namespace + model + KV dtype + page geometry (not the rank: see key_namespace)."""
    groups = [(g.tokens_per_block, len(g.layer_names)) for g in config.groups]
    ident = (f"{base}|{config.model.name}|{config.model.dtype}|{groups}|"
             f"{config.worker_kv_bytes_per_block}|{config.cache.blocks_per_chunk}|"
             f"{config.kv_cache_layout}")
    return "offload-" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def key_namespace(namespace: str, rank: int, world: int) -> str:
    """Each TP rank stores its own part of a chunk under its own keys."""
    return f"{namespace}/r{rank}of{world}"


class AdpLoadStoreSpec(LoadStoreSpec):
    """Where chunks live on the gateway: their offload keys (block hash + group)."""

    def __init__(self, keys: list[bytes]):
        self.keys = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"AdpLoadStoreSpec({len(self.keys)} chunks)"


def _digest(offload_key: bytes) -> bytes:
    return chunk_digest(bytes(offload_key))


# =============================================================================== scheduler
class AdpOffloadingManager(OffloadingManager):
    def __init__(self, spec: "AdpOffloadingSpec"):
        self.spec = spec
        cfg = spec.client_config
        self._lookup = LookupClient(cfg, spec.engine_id, spec.world)
        self._results: dict[str, dict[bytes, bool]] = {}       # req -> key -> stored
        self._pending: dict[str, set[bytes]] = {}              # req -> keys to ask
        self._inflight: Optional[tuple[Any, list[tuple[str, bytes]]]] = None
        self._asked: set[tuple[str, bytes]] = set()
        self._pinned: dict[str, dict[bytes, int]] = {}         # req -> key -> pins taken
        self._lock = threading.Lock()
        # keys checked per chunk: every layer of every rank (a failed load cannot be recomputed)
        self._layers = [list(range(len(g.layer_names))) for g in spec.config.groups]
        self._builders = [KeyBuilder(key_namespace(spec.namespace, r, spec.world)) for r in range(spec.world)]

    def _storage_keys(self, offload_key: bytes) -> list[bytes]:
        d = _digest(offload_key)
        layers = self._layers[min(get_offload_group_idx(offload_key), len(self._layers) - 1)]
        return [b.key(d, layer) for b in self._builders for layer in layers]

    # ---------------------------------------------------------------- lookups
    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        req = req_context.req_id
        key = bytes(key)
        self._collect()
        res = self._results.get(req, {}).get(key)
        if res is not None:
            return LookupResult.HIT if res else LookupResult.MISS
        if (req, key) in self._asked:
            return LookupResult.RETRY          # its EXIST is on the way
        if not self._lookup.enabled:
            return LookupResult.MISS
        self._pending.setdefault(req, set()).add(key)
        return LookupResult.RETRY

    def on_schedule_end(self, context) -> None:
        self._collect()
        if self._inflight is not None or not self._pending:
            return
        items = [(req, k) for req, keys in self._pending.items() for k in keys]
        self._pending = {}
        if not self._lookup.enabled:
            for req, k in items:
                self._results.setdefault(req, {})[k] = False
            return
        keys: list[bytes] = []
        for _, k in items:
            keys += self._storage_keys(k)
        client = self._lookup.client()
        fut = client.exist(keys, lock=True) if client is not None else None
        self._inflight = (fut, items)
        self._asked = set(items)

    def _collect(self) -> None:
        if self._inflight is None:
            return
        fut, items = self._inflight
        if fut is not None and not fut.done():
            return
        self._inflight = None
        self._asked = set()
        flags = fut.result() if fut is not None else []
        i = 0
        for req, k in items:
            n = len(self._storage_keys(k))
            part = flags[i:i + n] if len(flags) >= i + n else [False] * n
            i += n
            hit = bool(part) and all(part)
            self._results.setdefault(req, {})[k] = hit
            if hit:   # every storage key of this chunk got one pin of ours
                pins = self._pinned.setdefault(req, {})
                pins[k] = pins.get(k, 0) + 1
            elif any(part):   # partial: release what was pinned
                sk = self._storage_keys(k)
                self._unlock([s for s, f in zip(sk, part) if f])

    def has_pending_work(self) -> bool:
        self._collect()
        return bool(self._pending) or self._inflight is not None

    def _unlock(self, storage_keys: list[bytes]) -> None:
        client = self._lookup.client()
        if storage_keys and client is not None and client.enabled:
            client.unlock(storage_keys)

    def _release(self, req: str, keys: Optional[Iterable[bytes]] = None) -> None:
        pins = self._pinned.get(req)
        if not pins:
            return
        keys = list(pins) if keys is None else [bytes(k) for k in keys]
        out: list[bytes] = []
        for k in keys:
            n = pins.pop(k, 0)
            for _ in range(n):
                out += self._storage_keys(k)
        self._unlock(out)
        if not pins:
            self._pinned.pop(req, None)

    # ---------------------------------------------------------------- loads and stores
    def prepare_load(self, keys: Collection, req_context: ReqContext) -> LoadStoreSpec:
        return AdpLoadStoreSpec(list(keys))

    def complete_load(self, keys: Collection, req_context: ReqContext):
        self._release(req_context.req_id, keys)

    def prepare_store(self, keys: Collection, req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        known = self._results.get(req_context.req_id, {})
        todo = [bytes(k) for k in keys if not known.get(bytes(k))]
        return PrepareStoreOutput(keys_to_store=todo, store_spec=AdpLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Collection, req_context: ReqContext, success: bool = True):
        return

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = req_context.req_id
        self._release(req)
        self._results.pop(req, None)
        self._pending.pop(req, None)

    def reset_cache(self) -> None:
        for req in list(self._pinned):
            self._release(req)
        self._results.clear()

    def shutdown(self) -> None:
        self._lookup.close()


# =============================================================================== worker
class _Job:
    __slots__ = ("job_id", "futures", "kind", "nbytes", "t0", "result")

    def __init__(self, job_id: int, kind: str):
        self.job_id = job_id
        self.kind = kind
        self.futures: list[Any] = []
        self.nbytes = 0
        self.t0 = time.perf_counter()
        self.result: Optional[bool] = None


class AdpOffloadingWorker(OffloadingWorker):
    def __init__(self, spec: "AdpOffloadingSpec", kv_caches: CanonicalKVCaches):
        self.spec = spec
        cfg = spec.config
        self.rank = cfg.parallel.rank
        self.bpc = cfg.cache.blocks_per_chunk
        self.keys = KeyBuilder(key_namespace(spec.namespace, self.rank, spec.world))
        # per group: [(layer index for the key, PagedLayer)], one per distinct tensor
        self.groups: list[list[tuple[int, PagedLayer]]] = []
        tensors = kv_caches.tensors
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
        layout = {"engine": "vllm-offloading", "tensors": len(tensors), "page_bytes": first.page_bytes,
                  "blocks_per_chunk": self.bpc}
        self.client = open_rank_client(spec.client_config, spec.engine_id, self.rank, spec.world, layout)
        self.ring = ring_tensor(self.client)
        self._stream = torch.cuda.Stream(device=first.device) if first.on_gpu else None
        if first.on_gpu and self.ring is not None:
            from .cuda_ring import pin_ring
            pin_ring(self.ring)
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.Lock()
        logger.info("adpkv offloading worker rank %d: %d tensors, page %d bytes, %d blocks per chunk",
                    self.rank, len(tensors), first.page_bytes, self.bpc)

    def _active(self) -> bool:
        return self.client is not None and self.ring is not None and self.client.enabled

    def _group_blocks(self, spec: GPULoadStoreSpec):
        ids = [int(b) for b in spec.block_ids]
        sizes = list(spec.group_sizes) if spec.group_sizes else [len(ids)]
        out, at = [], 0
        for g, size in enumerate(sizes):
            out.append((g, ids[at:at + size], int(spec.block_indices[g]) if spec.block_indices else 0))
            at += size
        return out

    def _keys_by_group(self, keys: list[bytes]) -> dict[int, list[bytes]]:
        by: dict[int, list[bytes]] = {}
        for k in keys:
            by.setdefault(get_offload_group_idx(k), []).append(k)
        return by

    # ---------------------------------------------------------------- stores
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        job = _Job(job_id, "store")
        with self._lock:
            self._jobs[job_id] = job
        keys_by_group = self._keys_by_group(dst_spec.keys)
        if not self._active():
            return True          # a store that cannot happen is a future miss
        for g, block_ids, first_index in self._group_blocks(src_spec):
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
            digests = [_digest(k) for k in keys]
            for layer_idx, layer in self.groups[g]:
                obj = layer.page_bytes * self.bpc

                def on_batch(b, layer=layer, blocks=blocks):
                    layer.gather(self.ring, b.offset, b.stride, b.count, 0, obj,
                                 blocks[b.first * self.bpc:(b.first + b.count) * self.bpc], self.bpc,
                                 self._stream)
                    return True

                job.futures.append(self.client.put(self.keys.keys(digests, [layer_idx]), obj, on_batch))
                job.nbytes += obj * len(keys)
        return True

    # ---------------------------------------------------------------- loads
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        job = _Job(job_id, "load")
        with self._lock:
            self._jobs[job_id] = job
        keys_by_group = self._keys_by_group(src_spec.keys)
        if not self._active():
            job.result = False
            return True
        for g, block_ids, first_index in self._group_blocks(dst_spec):
            keys = keys_by_group.get(g, [])
            if not keys or not block_ids:
                continue
            skip = first_index % self.bpc            # first GPU block inside the first chunk
            positions = as_index(range(skip, skip + len(block_ids)))
            if positions[-1] >= len(keys) * self.bpc:
                logger.error("adpkv: load job %d: %d blocks do not fit %d chunks", job_id,
                             len(block_ids), len(keys))
                job.result = False
                continue
            dst = as_index(block_ids)
            digests = [_digest(k) for k in keys]
            for layer_idx, layer in self.groups[g]:
                obj = layer.page_bytes * self.bpc
                layer_keys = self.keys.keys(digests, [layer_idx])
                for start, stop in shard_ranges(len(keys), self.spec.shard_reads):

                    def on_batch(b, layer=layer, dst=dst, positions=positions, start=start):
                        lo, hi = (start + b.first) * self.bpc, (start + b.first + b.count) * self.bpc
                        sel = (positions >= lo) & (positions < hi)
                        if not bool(sel.any()):
                            return True
                        layer.scatter(self.ring, b.offset, b.stride, b.count, 0, obj, dst[sel],
                                      positions[sel] - lo, self.bpc, self._stream)
                        return True

                    job.futures.append(self.client.get(layer_keys[start:stop], obj, on_batch))
                job.nbytes += obj * len(keys)
        return True

    # ---------------------------------------------------------------- completion
    def _finish(self, job: _Job) -> TransferResult:
        ok = job.result is not False and all(all(f.result()) for f in job.futures)
        if job.kind == "store":
            ok = True            # vLLM 0.32 asserts on failed jobs; a lost store is a future miss
        elif not ok:
            logger.error("adpkv: load job %d failed after its chunks were found; vLLM's "
                         "OffloadingConnector cannot recompute it (it stops rather than serve a "
                         "wrong KV cache). Use AdpKVConnector where a failed load must be recomputed.",
                         job.job_id)
        return TransferResult(job_id=job.job_id, success=ok, transfer_size=job.nbytes,
                              transfer_time=time.perf_counter() - job.t0)

    def get_finished(self) -> list[TransferResult]:
        out = []
        with self._lock:
            for job_id, job in list(self._jobs.items()):
                if all(f.done() for f in job.futures):
                    del self._jobs[job_id]
                    out.append(self._finish(job))
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        for job in jobs:
            for f in job.futures:
                f.result()

    def shutdown(self) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            for f in job.futures:
                try:
                    f.result(timeout=5)
                except Exception:
                    pass
        if self.ring is not None and self.groups and self.groups[0][0][1].on_gpu:
            from .cuda_ring import unpin_ring
            unpin_ring(self.ring)
        close_client(self.client)
        self.client = None
        self.ring = None


def parse_shard_reads(value) -> int:
    """``adpkv.shard_reads``: ``auto`` (0) or the number of parallel GETs per layer of a load."""
    if value is None or str(value).strip().lower() == "auto":
        return 0
    n = int(value)
    if n < 1:
        raise ValueError(f"adpkv: adpkv.shard_reads must be 'auto' or >= 1, not {value!r}")
    return n


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


# =============================================================================== spec
class AdpOffloadingSpec(OffloadingSpec):
    """adpkv gateway as the offloading medium (``spec_module_path: adpkv_vllm``)."""

    def __init__(self, config):
        super().__init__(config)
        ensure_logging()
        extra = dict(self.extra_config or {})
        self.client_config = ClientConfig.from_settings(extra, prefix="adpkv.")
        if not self.client_config.namespace:
            logger.warning("adpkv: no adpkv.namespace set; required on shared cards (the model and page "
                           "geometry are in the keys, the deployment is not)")
        self.namespace = _namespace(config, self.client_config.namespace or "default")
        self.shard_reads = parse_shard_reads(extra.get("adpkv.shard_reads", "auto"))
        if "adpkv.affinity_chunks" in extra:
            logger.info("adpkv: adpkv.affinity_chunks has no effect with AdpOffloadingSpec: vLLM's "
                        "offloading API does not give the manager a request's first chunks, so "
                        "objects are placed by key (use AdpKVConnector for dialog placement)")
        self.engine_id = f"vllm-offload-{config.engine_id}"
        self.world = max(1, int(config.parallel.world_size))
        if int(config.parallel.pp_size) != 1:
            raise ValueError("adpkv: AdpOffloadingSpec supports pipeline parallel size 1")
        self._manager: Optional[AdpOffloadingManager] = None
        self._worker: Optional[AdpOffloadingWorker] = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = AdpOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = AdpOffloadingWorker(self, kv_caches)
        return self._worker
