"""AdpOffloadingSpec under vLLM 0.33's own OffloadingConnector, both roles, against a real gateway.

What runs, all real: vLLM's ``Scheduler`` with the ``OffloadingConnector``'s scheduler role
(its lookups, load and store jobs, the manager lock it holds for a step), the
``OffloadingConnector``'s worker role with our ``AdpOffloadingWorker`` on CPU KV tensors
(harness.py ``offloading=True``: the model is a writer of prefix-dependent values, so every
restore is checked byte for byte), vLLM's Prometheus class for the connector
(``OffloadPromMetrics``) and real gateway processes.

What did not run without a GPU: the worker's CUDA copies (ring <-> GPU, on its stream) and
vLLM's GPU model runners calling the worker role (V1, Model Runner V2); harness.py calls the
worker role in the order they do.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

from harness import Harness

CHUNK = 64          # tokens per offloaded chunk (2 blocks of 32)


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def stored_prompt(model_dir, port, toks, ns):
    h = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, offloading=True)
    try:
        h.add(toks)
        h.run()
    finally:
        h.close()


def scheduled(h, req, timeout_s=30.0):
    """Step until ``req`` is scheduled; that step's output."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the request was never scheduled"
        so, _ = h.step()
        if req.request_id in so.num_scheduled_tokens:
            return so
        time.sleep(0.002)        # its lookup's EXIST (or its load) is in flight


def restores(h, toks, hit):
    """A fresh request for ``toks`` is scheduled with ``hit`` tokens restored, every byte right."""
    req = h.add(toks)
    so = scheduled(h, req)
    assert so.num_scheduled_tokens[req.request_id] == len(toks) - hit
    h.check_kv(req, len(toks))
    h.run()


def test_a_stored_prompt_is_restored_byte_for_byte(gateway, model_dir):
    """Stores by one engine's OffloadingConnector, a hit and an asynchronous load in a fresh
    one: the chunk floor (640 of 700 tokens) restored, the rest computed."""
    toks, ns = tokens(700, 1), f"o-{uuid.uuid4().hex[:6]}"
    stored_prompt(model_dir, gateway.port, toks, ns)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, offloading=True)
    try:
        restores(h, toks, 640)
    finally:
        h.close()


def test_a_sync_load_is_expedited_and_complete_before_the_pass(gateway, model_dir):
    """vLLM 0.33's synchronous loads (``sync_load_budget_bytes``): the request runs in the step
    of its load, which vLLM submits with ``submit_load(..., expedited=True)`` and waits for
    before the pass; every restored byte is in place when the layers compute."""
    toks, ns = tokens(500, 2), f"o-{uuid.uuid4().hex[:6]}"
    stored_prompt(model_dir, gateway.port, toks, ns)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, offloading=True,
                extra={"sync_load_budget_bytes": 1 << 30})
    calls = []
    worker = h.worker.connector_worker.worker
    submit = worker.submit_load

    def recording(*args, **kwargs):
        calls.append(kwargs.get("expedited", False))
        return submit(*args, **kwargs)

    worker.submit_load = recording
    try:
        restores(h, toks, 448)
        assert calls == [True]
    finally:
        h.close()


def test_the_manager_lock_keeps_a_second_thread_out(gateway, model_dir):
    """Every caller of the manager holds ``manager.lock`` (vLLM 0.33). vLLM's scheduler-side
    connector, called from another thread (its stats), waits while the lock is held and goes
    on once it is released; a real lock, not a no-op. A restore with that thread calling in
    all along loads every byte."""
    toks = tokens(300, 3)
    stored_prompt(model_dir, gateway.port, toks, "lock")
    h = Harness(model_dir, gateway.port, namespace="lock", chunk_size=CHUNK, offloading=True)
    manager = h.connector.connector_scheduler.manager
    done = threading.Event()
    try:
        with manager.lock:
            t = threading.Thread(target=lambda: (h.connector.get_kv_connector_stats(), done.set()))
            t.start()
            assert not done.wait(0.5), "a second thread entered the manager while its lock was held"
        assert done.wait(10)
        t.join(10)
        stop = threading.Event()
        poller = threading.Thread(target=lambda: [h.connector.get_kv_connector_stats() or time.sleep(0.01)
                                                  for _ in iter(stop.is_set, True)])
        poller.start()
        try:
            restores(h, toks, 256)
        finally:
            stop.set()
            poller.join(10)
    finally:
        h.close()


def test_config_info_reaches_the_info_metric(gateway, model_dir):
    """``vllm:kv_offload_config_info`` (vLLM 0.33): the spec declares its labels, the manager
    fills them on the first stats payload, vLLM's Prometheus class publishes the series."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from adpkv_vllm import AdpOffloadingSpec

    h = Harness(model_dir, gateway.port, namespace="info", chunk_size=CHUNK, offloading=True,
                extra={"adpkv.shard_reads": 3})
    unregister_vllm_metrics()
    try:
        extra = h.vllm_config.kv_transfer_config.kv_connector_extra_config
        assert AdpOffloadingSpec.config_info_keys(extra) == ("adpkv_gateway", "adpkv_namespace",
                                                             "adpkv_shard_reads")
        stats = h.connector.get_kv_connector_stats()
        backend = h.connector.connector_scheduler.manager.backend
        prom = KVConnectorProm(h.vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(stats.data, 0)
        labels = {"model_name": "m", "engine": "0", "adpkv_gateway": f"127.0.0.1:{gateway.port}",
                  "adpkv_namespace": backend.namespace, "adpkv_shard_reads": "3"}
        assert REGISTRY.get_sample_value("vllm:kv_offload_config_info", labels) == 1.0
    finally:
        unregister_vllm_metrics()
        h.close()
