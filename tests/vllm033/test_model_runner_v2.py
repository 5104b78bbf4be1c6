"""AdpKVConnector's worker role driven by Model Runner V2's connector driver (vLLM 0.33's
default GPU model runner, vLLM PR #53183): ``vllm.v1.worker.gpu.kv_connector.ActiveKVConnector``,
vLLM's own class, registers the KV caches and makes every call of a step on the worker role
(``pre_forward``: preemptions, bind, ``start_load_kv`` before the pass when the step has a
synchronous load, else after it; ``finish_forward``; ``post_forward``: ``wait_for_save``,
transfer results, load errors, stats, events, worker metadata, clear). The layers' hooks
(``wait_for_layer_load`` / ``save_kv_layer``, what the attention op calls) and the KV writes
are harness.py's, as for the other tests; vLLM's Scheduler and real gateway processes.

What did not run without a GPU: MRV2's ``GPUModelRunner`` itself (it needs CUDA), its CUDA
graphs (the connector keeps vLLM's FULL graphs and settles a FULL-graph step's loads before the
pass: checked below as the class answer vLLM reads; the GPU run is docs/benchmarks.md's H200
engine run on vLLM 0.26), the drafter's deferred finalize, CUDA copies.
"""

from __future__ import annotations

import random
import uuid

from harness import Harness
from test_hybrid_scheduler import full, layers, sliding

CHUNK = 64


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


class MRV2Harness(Harness):
    """harness.Harness whose model runner part is MRV2's ``ActiveKVConnector``."""

    def register_kv_caches(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker     # what ensure_kv_transfer_initialized sets
        self.runner_connector = ActiveKVConnector(self.vllm_config, self.kv)

    def run_worker(self, so):
        rc = self.runner_connector
        rc.pre_forward(so)
        self.forward(so)
        rc.finish_forward()
        return rc.post_forward(so.finished_req_ids)

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        super().close()


def stored(model_dir, port, toks, **kw):
    ns = f"v2-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, **kw)
    try:
        req = h.add(toks)
        h.run()
        assert req.request_id in h.finished_sending
    finally:
        h.close()
    return ns


def test_a_layer_by_layer_restore_under_mrv2s_driver(gateway, model_dir):
    """One KV cache group: a synchronous load (``has_sync_kv_loads``), so MRV2 starts it before
    the pass and each layer waits for its own; every byte checked."""
    toks = tokens(700, 1)
    ns = stored(model_dir, gateway.port, toks)
    h = MRV2Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req = h.add(toks)
        so, meta = h.step()
        assert so.has_sync_kv_loads
        assert sum(len(p.block_ids) for p in meta.loads) * h.block_size == 640
        assert so.num_scheduled_tokens[req.request_id] == 60
        h.check_kv(req, 700)
        assert not any(h.load_errors)
        h.run()
    finally:
        h.close()


def test_an_asynchronous_restore_started_after_the_pass(gateway, model_dir):
    """Several KV cache groups: an asynchronous load, which MRV2 starts after the step's pass
    (no synchronous load in it); the request runs once the load has ended, every byte in
    every group right."""
    groups = [(layers(0, 2), sliding()), (layers(1, 3), full())]
    toks = tokens(700, 2)
    ns = stored(model_dir, gateway.port, toks, groups=groups)
    h = MRV2Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, groups=groups)
    try:
        req = h.add(toks, max_tokens=8)
        so, loads = h.step_until_scheduled(req)
        assert loads and req.request_id in h.finished_recving and not h.failed_recving
        assert so.num_scheduled_tokens[req.request_id] == 700 - 640
        h.check_kv(req, 700)
        h.run()
    finally:
        h.close()


def test_the_connector_keeps_vllms_full_cuda_graphs():
    """vLLM reads this class answer before it settles its CUDA graph mode: False, so it keeps
    FULL_AND_PIECEWISE; a step it may replay as a FULL graph (which calls no layer hook) has its
    loads settled before the pass (tests/vllm/test_full_graphs.py, run here by test_reused_032)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    ktc = KVTransferConfig(kv_connector="AdpKVConnector", kv_connector_module_path="adpkv_vllm",
                           kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc).requires_piecewise_for_cudagraph({}) is False
