"""Drive vLLM's real ``TieringOffloadingManager`` (CPU tier + secondary tiers) as its
scheduler-side connector does, with real CPU-tier memory, and no GPU.

- ``engine_tiering(model_dir, extra, ...)``: vLLM's own ``OffloadingConnector`` in the
  scheduler role, built from the ``--kv-transfer-config`` JSON (``extra`` is its
  ``kv_connector_extra_config``): vLLM's ``build_offloading_config`` and
  ``OffloadingSpecFactory`` make the ``TieringOffloadingSpec``, which makes the
  ``TieringOffloadingManager``, its CPU tier (the shared region in /dev/shm) and the
  secondary tiers from ``secondary_tiers``.
- ``store``: what the GPU worker and the connector do for a store, minus the DMA:
  ``prepare_store`` allocates CPU-tier rows, the rows are written (here: with a
  payload, in place of vLLM's GPU->CPU copy), ``complete_store`` cascades them to
  every secondary tier; engine steps (``on_schedule_end``) until the cascades end.
- ``load``: ``lookup`` every key once per engine step until each is a HIT (promoted
  from a secondary tier into the CPU tier) or a MISS; returns the rows' bytes.
- ``reset_cache(conn)``: the engine's cache reset, through vLLM's connector (vLLM 0.33 also
  holds promotions until the workers reported the jobs in flight: the connector releases
  them at once when none is).

Every manager call here holds ``manager_lock(manager)``, as vLLM's scheduler does.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Callable, Optional

import numpy as np

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

STEP = ScheduleEndContext((), ())


def manager_lock(manager):
    """The manager's lock (vLLM >= 0.33: every caller of a manager method holds it; vLLM
    0.32's managers have none)."""
    return getattr(manager, "lock", None) or contextlib.nullcontext()


def reset_cache(conn) -> None:
    """The cache reset vLLM's engine makes (``reset_prefix_cache(reset_connector=True)``)."""
    conn.reset_cache()


def engine_tiering(model_dir: str, extra: dict, block_size: int = 16, layers: int = 2, heads: int = 2,
                   head_dim: int = 64, num_gpu_blocks: int = 64, kv_events: bool = True,
                   engine_id: Optional[str] = None):
    """vLLM's OffloadingConnector (scheduler role) for this JSON; returns (connector, manager)."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=8192, seed=0),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=8192,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            engine_id=engine_id or uuid.uuid4().hex,
                                            kv_connector_extra_config=extra),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null") if kv_events else None,
        device_config=DeviceConfig("cpu"),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    kv_cache_config.kv_cache_tensors = _sizing_tensors(vllm_config, kv_cache_config, spec.page_size_bytes * layers)
    conn = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    return conn, conn.connector_scheduler.manager


def _sizing_tensors(vllm_config, kv_cache_config, block_bytes: int) -> list:
    """No KV cache tensors (the scheduler role has none), as vLLM 0.30 and later size the CPU tier
    from the groups' pages; vLLM 0.28 and 0.29 size it from the tensors only (none: a tier of
    0 rows), so there the one packed tensor the workers would allocate is described."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if build_offloading_config(vllm_config, kv_cache_config).worker_kv_bytes_per_block > 0:
        return []
    names = list(kv_cache_config.kv_cache_groups[0].layer_names)
    size = block_bytes * kv_cache_config.num_blocks           # block-outermost: a block holds every layer's page
    if "layers" in KVCacheTensor.__dataclass_fields__:        # vLLM 0.29's placement fields
        return [KVCacheTensor(size=size, layers=names, layer_stride=block_bytes // len(names),
                              block_stride=block_bytes)]
    return [KVCacheTensor(size=size, shared_by=names, block_stride=block_bytes)]


def _rows(spec):
    """A CPU load/store spec's rows: ``chunk_ids`` (vLLM 0.30 and later), ``block_ids`` before."""
    return spec.chunk_ids if hasattr(spec, "chunk_ids") else spec.block_ids


def rows(manager) -> np.ndarray:
    """The CPU tier's rows (the shared region) as a (rows, row_bytes) uint8 array, no copy."""
    return np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """Bytes that depend on the key (so a row in the wrong place is caught)."""
    seed = int.from_bytes(bytes(key)[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def steps_until(manager, done: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> float:
    """Engine steps (``on_schedule_end``) until ``done()``; seconds taken. Polls with a deadline."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not done within {timeout_s} s: {what}")
        with manager_lock(manager):
            manager.on_schedule_end(STEP)
        time.sleep(0.0005)
    return time.monotonic() - t0


def store(manager, keys: list, req_id: str, write: bool = True, timeout_s: float = 30.0) -> list:
    """GPU->CPU tier (rows written here) and the cascade to every secondary tier; returns the
    keys the CPU tier took."""
    ctx = ReqContext(req_id)
    with manager_lock(manager):
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
    assert out is not None, "the CPU tier could not take the rows"
    if write:
        view = rows(manager)
        for k, c in zip(out.keys_to_store, _rows(out.store_spec)):
            view[int(c)] = payload(k, view.shape[1])
    with manager_lock(manager):
        manager.complete_store(out.keys_to_store, ctx, True)
        manager.on_request_finished(ctx)

    def cascaded():
        with manager_lock(manager):
            return not manager.has_pending_work()

    steps_until(manager, cascaded, timeout_s, "the cascades")
    return list(out.keys_to_store)


def lookup(manager, keys: list, req_id: str, timeout_s: float = 20.0):
    """Look every key up once per step until none is RETRY / HIT_PENDING; (results, ctx, seconds)."""
    ctx = ReqContext(req_id)
    with manager_lock(manager):
        manager.on_new_request(ctx)
    results: list = []

    def settled():
        nonlocal results
        with manager_lock(manager):
            results = [manager.lookup(k, ctx) for k in keys]
        return all(r in (LookupResult.HIT, LookupResult.MISS) for r in results)

    seconds = steps_until(manager, settled, timeout_s, "the lookups")
    return results, ctx, seconds


def load(manager, keys: list, req_id: str, timeout_s: float = 20.0):
    """Lookups until settled; for the HITs, the rows vLLM's GPU worker would copy (copies)."""
    results, ctx, seconds = lookup(manager, keys, req_id, timeout_s)
    hits = [k for k, r in zip(keys, results) if r is LookupResult.HIT]
    data = {}
    with manager_lock(manager):
        if hits:
            spec = manager.prepare_load(hits, ctx)
            view = rows(manager)
            data = {k: view[int(c)].copy() for k, c in zip(hits, _rows(spec))}
            manager.complete_load(hits, ctx)
        manager.on_request_finished(ctx)
        manager.on_schedule_end(STEP)
    return results, data, seconds
