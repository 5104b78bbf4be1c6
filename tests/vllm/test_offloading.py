"""AdpOffloadingSpec under vLLM's own OffloadingConnector (vLLM 0.32 offloading API)."""

from __future__ import annotations

import os
import time

import torch

from engine_run import engine_prompts, remove_ring_of_killed_gateway, run_subprocess

P1, P2, P3 = engine_prompts()
CHUNK = 256


def offloading(port, namespace, **extra):
    conf = {"spec_name": "AdpOffloadingSpec", "spec_module_path": "adpkv_vllm", "block_size": CHUNK,
            "adpkv.port": port, "adpkv.namespace": namespace, "adpkv.timeout_s": 2.0}
    conf.update(extra)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": conf}


def test_fresh_process_restores_after_a_gateway_restart(model_dir, baseline, start_gateway):
    gw = start_gateway(shared_memory_size=256 << 20)
    a, _ = run_subprocess(model_dir, [P1, P2, P3], offloading(gw.port, "offload-test"))
    assert [r["tokens"] for r in a] == baseline
    gw.restart(hard=True)                       # a crash of the gateway loses nothing stored
    b, log = run_subprocess(model_dir, [P1, P2, P3], offloading(gw.port, "offload-test"))
    assert [r["cached"] for r in b] == [(len(p) - 1) // CHUNK * CHUNK for p in (P1, P2, P3)]
    assert [r["tokens"] for r in b] == baseline


def test_gateway_down_the_engine_keeps_serving(model_dir, baseline, start_gateway):
    gw = start_gateway(shared_memory_size=256 << 20)
    res, log = run_subprocess(model_dir, [P1, P2, P3], offloading(gw.port, "offload-down"), rounds=2,
                              kill_after={"pid": gw.proc.pid, "after": 2}, wait_after_s=3)
    gw.proc.wait(10)
    gw.proc = None
    remove_ring_of_killed_gateway(gw)
    assert len(res) == 6 and [r["tokens"] for r in res] == baseline * 2


# ----------------------------------------------------------------------------- manager + worker
def _config(port, world=1, **extra):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                           OffloadingGroupConfig, OffloadingModelConfig,
                                           OffloadingParallelConfig)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=2 * 4096, enable_kv_cache_events=False,
        extra_config={"adpkv.port": port, "adpkv.namespace": "unit", "adpkv.timeout_s": 2.0, **extra},
        engine_id=f"unit-{os.getpid()}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def _caches(nb=32, page=4096, seed=0):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randint(-128, 127, (nb, page), dtype=torch.int8, generator=g) for _ in range(2)]
    return ts, CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(t, page) for t in ts],
                                 group_data_refs=[[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])


def _lookup_all(manager, keys, ctx, timeout=10):
    from vllm.v1.kv_offload.base import LookupResult
    deadline = time.monotonic() + timeout
    while True:
        res = [manager.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in res:
            return res
        manager.on_schedule_end(None)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_missing_middle_chunk_restores_only_the_prefix(gateway):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key

    from adpkv_vllm.offloading.backend import object_digest
    from adpkv_vllm.offloading.spec import AdpOffloadingSpec

    spec = AdpOffloadingSpec(_config(gateway.port))
    src, caches = _caches(seed=1)
    worker = spec.get_worker(caches)
    manager = spec.get_manager()
    try:
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(5)]      # 5 chunks of 2 blocks
        store_blocks = list(range(10, 20))
        worker.submit_store(1, GPULoadStoreSpec(store_blocks, [10], [0]),
                            manager.prepare_store(keys, ReqContext("w")).store_spec)
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        # lose layer 1 of chunk 2 on the card
        assert worker.client.delete([worker.keys.key(object_digest(keys[2]), 1)]).result(5) == 1

        ctx = ReqContext("r1")
        res = _lookup_all(manager, keys, ctx)
        assert res == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.HIT,
                       LookupResult.HIT]
        # vLLM restores the prefix up to the first miss: chunks 0 and 1, into other blocks,
        # starting at the 2nd block of chunk 0 (its 1st block is a local prefix-cache hit)
        dst = [3, 5, 7]
        load = manager.prepare_load(keys[:2], ctx)
        for t in src:
            t[dst] = 0
        worker.submit_load(2, load, GPULoadStoreSpec(dst, [3], [1]))
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True]
        for t in src:
            assert torch.equal(t[dst], t[[11, 12, 13]])
        manager.complete_load(keys[:2], ctx)
        manager.on_request_finished(ctx)
        assert not manager._pinned
    finally:
        worker.shutdown()
        manager.shutdown()
