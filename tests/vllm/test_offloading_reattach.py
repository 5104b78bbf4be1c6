"""AdpOffloadingSpec re-attaches after a gateway restart without a new spec.

The real OffloadingSpec, manager and worker (vLLM 0.32's offloading API) built
as in test_offloading.py, on real CPU KV tensors, against a real gateway
process. The gateway is restarted (GatewayProcess.restart: graceful, and a
kill -9); the same spec instance then finds the chunks stored before the restart
and loads them byte for byte, stores and loads new ones, and the log says
"External KV cache back on this rank" exactly once (the worker) and the lookup
peer's line once (the manager).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from adpkv_core.attachment import BACK_ON_MESSAGE, LOOKUPS_BACK_MESSAGE
from test_offloading import _caches, _config, _lookup_all

EXTRA = {"adpkv.reconnect_s": 0.2, "adpkv.heartbeat_s": 0.2, "adpkv.connect_timeout_s": 1.0}


def _spec(port):
    from adpkv_vllm import AdpOffloadingSpec

    return AdpOffloadingSpec(_config(port, **EXTRA))


def _store(worker, manager, job_id, keys, blocks):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext
    spec = manager.prepare_store(keys, ReqContext(f"store-{job_id}")).store_spec
    worker.submit_store(job_id, GPULoadStoreSpec(blocks, [len(blocks)], [0]), spec)
    worker.wait({job_id})
    assert [r.success for r in worker.get_finished()] == [True]


def _try_restore(worker, manager, job_id, keys, src, src_blocks, dst_blocks) -> bool:
    """One attempt as vLLM makes it: look up every chunk, load them if all hit.
    True when the load succeeded and every byte is the stored one."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext
    ctx = ReqContext(f"load-{job_id}")
    manager.on_schedule_end(None)      # the previous engine step ends (vLLM calls it every step)
    try:
        if _lookup_all(manager, keys, ctx) != [LookupResult.HIT] * len(keys):
            return False
        for t in src:
            t[dst_blocks] = 0
        load = manager.prepare_load(keys, ctx)
        worker.submit_load(job_id, load, GPULoadStoreSpec(dst_blocks, [len(dst_blocks)], [0]))
        worker.wait({job_id})
        results = worker.get_finished()
        assert [r.job_id for r in results] == [job_id]
        if not results[0].success:
            return False
        for t in src:
            assert torch.equal(t[dst_blocks], t[src_blocks]), "a load must never give wrong bytes"
        manager.complete_load(keys, ctx)
        return True
    finally:
        manager.on_request_finished(ctx)


@pytest.mark.parametrize("hard", [False, True], ids=["restart", "kill-9"])
def test_same_spec_finds_and_loads_again_after_the_gateway_restarts(start_gateway, caplog, hard):
    from vllm.v1.kv_offload.base import make_offload_key

    caplog.set_level(logging.INFO, logger="adpkv")
    gw = start_gateway(engine_timeout_s=1)
    spec = _spec(gw.port)
    src, caches = _caches(seed=3)
    worker = spec.get_worker(caches)
    manager = spec.get_manager()
    try:
        before = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]     # 3 chunks of 2 blocks
        _store(worker, manager, 1, before, list(range(10, 16)))
        assert _try_restore(worker, manager, 2, before, src, list(range(10, 16)), list(range(20, 26)))
        worker_session, manager_session = worker.session, manager._session

        gw.restart(hard=hard)                          # the engine (this spec) keeps running
        deadline = time.monotonic() + 30
        job = 3
        while not _try_restore(worker, manager, job, before, src, list(range(10, 16)), list(range(20, 26))):
            assert time.monotonic() < deadline, "the spec never loaded from the gateway again"
            job += 1
            time.sleep(0.05)                           # polling with a deadline
        assert worker.session is not worker_session and manager._session is not manager_session
        assert worker.attachment.reattaches == 1 and manager.lookup_peer.reattaches == 1

        # stores go to the new attachment too: new chunks, stored and loaded byte for byte
        after = [make_offload_key(bytes([0x40 + i]) * 32, 0) for i in range(2)]
        _store(worker, manager, 100, after, list(range(0, 4)))
        assert _try_restore(worker, manager, 101, after, src, list(range(0, 4)), list(range(26, 30)))
        assert not manager._pinned

        msgs = [r.getMessage() for r in caplog.records]
        assert sum(BACK_ON_MESSAGE in m for m in msgs) == 1, msgs
        assert sum(LOOKUPS_BACK_MESSAGE in m for m in msgs) == 1, msgs
    finally:
        worker.shutdown()
        manager.shutdown()
