"""AdpKVConnector under FULL CUDA graphs (vLLM's default FULL_AND_PIECEWISE on a GPU): the
connector no longer asks vLLM for PIECEWISE graphs, so a step vLLM replays as one FULL graph
calls no layer hook. A restore that leaves one token to compute is such a step (a uniform
decode batch): its loads must be in the blocks before the pass, and its saves go out after it.

vLLM's real Scheduler and our connector on both roles (harness.py), a real gateway; there is
no GPU here, so the harness plays the replay: under a FULL graph it calls no hook and checks,
when the pass begins, the KV the graph's attention would read.
"""

from __future__ import annotations

import uuid

from adpkv_vllm.connector.connector import AdpKVConnector
from harness import Harness
from test_scheduler import CHUNK, store, tokens


def test_the_connector_keeps_full_cuda_graphs():
    assert AdpKVConnector.requires_piecewise_for_cudagraph({}) is False


def test_a_restore_leaving_one_token_is_loaded_before_a_full_graph_pass(gateway, model_dir):
    toks = tokens(4 * CHUNK + 1, 31)          # the restore leaves exactly one token to compute
    ns = f"fg-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns, cudagraph_mode="FULL_AND_PIECEWISE")
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, cudagraph_mode="FULL_AND_PIECEWISE")
    try:
        assert h.worker.config.full_graphs == "uniform_decode"
        req = h.add(toks)
        so, meta = h.step()          # the forward checks the restored KV as the pass begins
        assert so.num_scheduled_tokens[req.request_id] == 1
        assert sum(len(p.block_ids) for p in meta.loads) * h.block_size == 4 * CHUNK
        assert meta.loads_before_pass and h.full_graph_steps == 1
        assert not any(h.load_errors)
        h.check_kv(req, len(toks))
        h.run()
    finally:
        h.close()


def test_a_restore_with_a_prefill_left_keeps_the_layer_pipeline(gateway, model_dir):
    toks = tokens(4 * CHUNK + 40, 32)         # 40 tokens computed after the restore: PIECEWISE
    ns = f"fg-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, cudagraph_mode="FULL_AND_PIECEWISE")
    try:
        req = h.add(toks)
        so, meta = h.step()
        assert so.num_scheduled_tokens[req.request_id] == 40
        assert meta.loads and not meta.loads_before_pass and h.full_graph_steps == 0
        h.check_kv(req, len(toks))
    finally:
        h.close()


def test_decode_steps_under_full_graphs_still_save_every_layer(gateway, model_dir):
    """Decode steps replayed as FULL graphs call no save hook: the chunks they fill are saved
    from wait_for_save, and a fresh engine restores them byte for byte."""
    toks = tokens(2 * CHUNK - 8, 33)
    ns = f"fg-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, cudagraph_mode="FULL_AND_PIECEWISE")
    req = h.add(toks, max_tokens=CHUNK + 9)   # the decode fills the second and third chunks
    h.run()
    assert h.full_graph_steps > 0 and req.request_id in h.finished_sending
    full = list(req.all_token_ids)[: 3 * CHUNK]
    h.close()
    again = full + tokens(10, 34)
    r = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req2 = r.add(again)
        so, meta = r.step()
        assert sum(len(p.block_ids) for p in meta.loads) * r.block_size == 3 * CHUNK
        r.check_kv(req2, len(again))
    finally:
        r.close()
