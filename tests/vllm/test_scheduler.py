"""AdpKVConnector under vLLM's real Scheduler, against a real gateway process.

The worker side runs our connector on real CPU KV tensors; the model is
replaced by a writer of prefix-dependent values (see harness.py), so every
restore is checked byte for byte.
"""

from __future__ import annotations

import logging
import random
import time
import types
import uuid

import pytest

from adpkv_vllm.common.settings import check_hash_stability, chunk_hashes
from harness import Harness
from vllm.v1.request import Request

CHUNK = 64          # tokens per stored chunk (2 blocks of 32)


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def store(model_dir, port, toks, ns, salt=None, **kw):
    h = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, **kw)
    req = h.add(toks, salt=salt)
    h.run()
    assert req.request_id in h.finished_sending, "blocks were not released after the saves"
    free = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == h.kv_cache_config.num_blocks - 1, "blocks leaked"
    h.close()
    return req


def restore(model_dir, port, toks, ns, salt=None, **kw):
    """A fresh engine: schedule the prompt once; returns (harness, request, loaded tokens)."""
    h = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, **kw)
    req = h.add(toks, salt=salt)
    so, meta = h.step()
    loaded = sum(len(p.block_ids) for p in meta.loads) * h.block_size
    return h, req, so, loaded


def test_restore_puts_the_exact_bytes_in_the_right_blocks(gateway, model_dir):
    toks = tokens(700, 1)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns)
    h, req, so, loaded = restore(model_dir, gateway.port, toks, ns)
    try:
        assert loaded == 640                       # floor(699 / 64) * 64
        assert so.num_scheduled_tokens[req.request_id] == 60
        h.check_kv(req, 700)                       # restored 0..639 and computed 640..699
        assert not any(h.load_errors)
        h.run()
        free = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == h.kv_cache_config.num_blocks - 1
    finally:
        h.close()


def test_prompt_of_whole_chunks_leaves_only_its_last_token_to_compute(gateway, model_dir):
    """Every chunk stored: all four load (the last one whole, its last token's page too), vLLM
    counts 255 tokens computed and computes the last one again; every position, that one
    included, holds its prefix value after the step."""
    toks = tokens(256, 2)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns)
    h, req, so, loaded = restore(model_dir, gateway.port, toks, ns)
    try:
        assert loaded == 256 and so.num_scheduled_tokens[req.request_id] == 1
        assert req.num_computed_tokens == 256     # 255 restored, the last computed this step
        h.check_kv(req, 256)
        assert not any(h.load_errors)
    finally:
        h.close()
    # the last chunk missing: the hit is the chunks before it, the last chunk computed
    toks = tokens(256, 12)
    stored = store(model_dir, gateway.port, toks, ns)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        last = chunk_hashes(stored.block_hashes, CHUNK // 32, 4)[3]
        assert h.worker.connector_worker.client.delete(h.worker.config.keys.keys([last], [0, 1])).result(5) == 2
        req = h.add(toks)
        so, meta = h.step()
        assert sum(len(p.block_ids) for p in meta.loads) * h.block_size == 192
        assert so.num_scheduled_tokens[req.request_id] == 64
        h.check_kv(req, 256)
    finally:
        h.close()


def test_prompt_of_one_chunk_is_a_whole_hit_too(gateway, model_dir):
    """A prompt of exactly one chunk, stored: loaded whole, vLLM computes only its last token
    (it used to ask nothing: no chunk lies below its last token); the same prompt again, now in
    vLLM's own prefix cache but for its last block, asks nothing and loads nothing."""
    toks = tokens(CHUNK, 22)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns)
    h, req, so, loaded = restore(model_dir, gateway.port, toks, ns)
    try:
        assert loaded == CHUNK and so.num_scheduled_tokens[req.request_id] == 1
        assert req.num_computed_tokens == CHUNK
        h.check_kv(req, CHUNK)
        assert not any(h.load_errors)
        h.run()
        again = h.add(toks)
        so, meta = h.step()
        assert not meta.loads and so.num_scheduled_tokens[again.request_id] == h.block_size   # its last block
        h.check_kv(again, CHUNK)
    finally:
        h.close()


def test_hit_stops_at_the_first_missing_chunk(gateway, model_dir):
    toks = tokens(700, 3)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    stored = store(model_dir, gateway.port, toks, ns)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        digests = chunk_hashes(stored.block_hashes, CHUNK // 32, 10)
        keys = h.worker.config.keys.keys([digests[3]], [0, 1])
        assert h.worker.connector_worker.client.delete(keys).result(5) == 2
        req = h.add(toks)
        so, meta = h.step()
        assert sum(len(p.digests) for p in meta.loads) == 3
        assert so.num_scheduled_tokens[req.request_id] == 700 - 3 * CHUNK
        h.check_kv(req, 700)
    finally:
        h.close()


def test_partial_local_hit_loads_only_the_missing_blocks(gateway, model_dir):
    toks = tokens(700, 4)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        # a 100-token request leaves 3 blocks (96 tokens) in the local prefix cache
        h2_req = h.add(toks[:100])
        h.run()
        req = h.add(toks)
        so, meta = h.step()
        (plan,) = meta.loads
        assert plan.positions is not None and plan.positions[0] == 1   # chunk 1 from its 2nd block
        assert len(plan.block_ids) == 640 // 32 - 3
        h.check_kv(req, 700)
        assert h2_req.request_id in h.requests
    finally:
        h.close()


def lose_middle_layer_object(h: Harness, stored, chunk: int) -> None:
    """Delete one chunk's object of layer 1 (of 3) through the gateway: the lookup's EXIST of
    the end layers still finds the chunk, the GET of layer 1 misses."""
    digests = chunk_hashes(stored.block_hashes, CHUNK // 32, 10)
    keys = h.worker.config.keys.keys([digests[chunk]], [1])
    assert h.worker.connector_worker.client.delete(keys).result(5) == 1


def test_a_failed_layer_load_is_recomputed_and_saved_again(gateway, model_dir3):
    toks = tokens(500, 5)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    stored = store(model_dir3, gateway.port, toks, ns, layers=3)
    h = Harness(model_dir3, gateway.port, namespace=ns, chunk_size=CHUNK, layers=3)
    try:
        # EXIST looks at the first and the last layer: a lost middle-layer object is only
        # found by the GET, which must report its blocks so that vLLM recomputes them.
        lose_middle_layer_object(h, stored, chunk=2)
        req = h.add(toks, max_tokens=4)
        so, meta = h.step()
        assert sum(len(p.digests) for p in meta.loads) == 7
        errors = h.load_errors[-1]
        blocks = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        assert errors == set(blocks[4:6])                  # the two blocks of chunk 2
        h.step_until_computed(req, 500)
        h.check_kv(req, 500)
        h.run()
        assert req.num_output_tokens == 4
    finally:
        h.close()
    # the recomputed chunk went back to the card: a third engine restores everything
    h3, req3, so3, loaded = restore(model_dir3, gateway.port, toks, ns, layers=3)
    try:
        assert loaded == 448 and not h3.load_errors[-1]
        h3.check_kv(req3, 500)
    finally:
        h3.close()


def served_saving(h: Harness, toks) -> tuple[Request, int, int]:
    """Serve ``toks`` in ``h`` to its end: the request, the chunks its steps planned for
    saving and those they planned for loading."""
    req = h.add(toks)
    saved = loaded = 0
    deadline = time.monotonic() + 30
    while h.scheduler.has_requests():
        assert time.monotonic() < deadline, "the request did not finish"
        so, meta = h.step()
        saved += sum(len(p.digests) for p in meta.saves + meta.deferred_saves if p.req_id == req.request_id)
        loaded += sum(len(p.digests) for p in meta.loads if p.req_id == req.request_id)
    return req, saved, loaded


def chunk_keys(h: Harness, req: Request, chunks) -> list[bytes]:
    """The card's keys (both layers) of the given chunks of ``req``'s prompt."""
    digests = chunk_hashes(req.block_hashes, CHUNK // 32, max(chunks) + 1)
    return h.worker.config.keys.keys([digests[c] for c in chunks], [0, 1])


def wait_stored(h: Harness, req: Request, chunks: int, deadline_s: float = 10.0) -> None:
    """Until the card holds the first ``chunks`` chunks of ``req``'s prompt (an EXIST answers
    with what is written, never waiting for writes in flight)."""
    keys = chunk_keys(h, req, range(chunks))
    deadline = time.monotonic() + deadline_s
    while not all(h.worker.connector_worker.client.exist(keys).result(5)):
        assert time.monotonic() < deadline, "the saves did not reach the card"
        time.sleep(0.01)


def test_chunks_known_stored_are_not_saved_again(gateway, model_dir):
    """A prompt served again from vLLM's own prefix cache copies nothing to the gateway; one
    that extends it saves only what the EXIST did not find, a chunk lost from the card
    included, and a fresh engine then restores all of it byte for byte."""
    base = tokens(700, 11)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        first, saved, _ = served_saving(h, base)
        assert saved == 10                                    # 700 tokens: chunks 0..9
        wait_stored(h, first, 10)
        assert served_saving(h, base)[1] == 0                 # vLLM's own hit covers it
        assert served_saving(h, base + tokens(200, 12))[1] == 4   # chunks 10..13 only
        assert h.worker.connector_worker.client.delete(chunk_keys(h, first, [2])).result(5) == 2
        longer, saved, _ = served_saving(h, base + tokens(200, 13))
        assert saved == 12                                    # chunk 2 (lost) on, and the new ones
        wait_stored(h, longer, 14)
        whole, saved, _ = served_saving(h, tokens(640, 14))
        assert saved == 10
        wait_stored(h, whole, 10)
        # served again from vLLM's cache: nothing asked, and its last chunk, which vLLM
        # completes again, is not saved again either: this engine saved it
        assert served_saving(h, tokens(640, 14))[1] == 0
    finally:
        h.close()
    h2, req, so, loaded = restore(model_dir, gateway.port, base + tokens(200, 13), ns)
    try:
        assert loaded == 896                                  # floor(899 / 64) * 64
        h2.check_kv(req, 900)
    finally:
        h2.close()
    # 640 tokens, whole chunks, restored by a fresh engine: all 10 chunks load (a whole hit:
    # vLLM computes the last token only, and the chunk it fills is known stored), none is
    # saved again, and every position holds its value
    h3 = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req = h3.add(tokens(640, 14))
        so, meta = h3.step()
        assert sum(len(p.digests) for p in meta.loads) == 10 and so.num_scheduled_tokens[req.request_id] == 1
        assert not meta.saves and not meta.deferred_saves
        h3.check_kv(req, 640)
        while h3.scheduler.has_requests():
            so, meta = h3.step()
            assert not meta.saves and not meta.deferred_saves
    finally:
        h3.close()


def test_tenants_and_namespaces_do_not_share(gateway, model_dir):
    toks = tokens(400, 6)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    store(model_dir, gateway.port, toks, ns, salt="alice")
    for salt, space, want in (("bob", ns, 0), (None, ns, 0), ("alice", "other-" + ns, 0), ("alice", ns, 384)):
        h, req, so, loaded = restore(model_dir, gateway.port, toks, space, salt=salt)
        try:
            assert loaded == want, (salt, space)
            h.check_kv(req, 400)
        finally:
            h.close()


def test_decode_chunks_are_saved_in_one_request_per_step(gateway, model_dir):
    toks = tokens(120, 7)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req = h.add(toks, max_tokens=20)
        deferred = []
        while h.scheduler.has_requests():
            so, meta = h.step()
            deferred += [len(p.digests) for p in meta.deferred_saves]
        # prompt 120 tokens: chunk 0 saved at prefill; chunk 1 (tokens 64..127) fills while decoding
        assert deferred == [1]
    finally:
        h.close()
    toks2 = toks + [5] * 19          # the decode wrote token 5 each step (see harness)
    h2, req2, so2, loaded = restore(model_dir, gateway.port, toks2, ns)
    try:
        assert loaded == 128
        h2.check_kv(req2, len(toks2))
    finally:
        h2.close()


def test_no_gateway_means_no_hits_and_requests_complete(model_dir, caplog):
    from adpkv_gateway.ops.spawn import free_port
    h = Harness(model_dir, free_port(), namespace="none", chunk_size=CHUNK,
                extra={"adpkv.connect_timeout_s": 0.5})
    try:
        assert not h.worker.connector_worker.client.enabled
        req = h.add(tokens(300, 8))
        so, meta = h.step()
        assert not meta.loads and so.num_scheduled_tokens[req.request_id] == 300
        h.run()
        assert req.num_output_tokens == 2
    finally:
        h.close()


def test_unstable_hash_settings_are_reported(monkeypatch, caplog):
    import adpkv_vllm.common.settings as common
    cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(prefix_caching_hash_algo="xxhash"))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(common, "_warned_hash", False)
    with caplog.at_level(logging.WARNING, logger="adpkv"):
        assert check_hash_stability(cfg) is False
    assert "PYTHONHASHSEED" in caplog.text
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert check_hash_stability(cfg) is True
    cfg.cache_config.prefix_caching_hash_algo = "sha256"
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert check_hash_stability(cfg) is True


@pytest.mark.parametrize("layout", ["canonical", "per-tp"])
def test_tensor_parallel_ranks_store_and_restore_their_slices(gateway, model_dir, layout):
    """Two TP ranks (one KV head each): one collective PUT/GET per layer, each rank its part:
    its head's runs of canonical objects (the model's 2 KV heads split over 2 ranks, heads.py),
    or its slice of a per-TP object (here: a configuration resolved at TP=1 whose spec holds 1
    of the 2 heads, so its objects depend on the TP size)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import uuid as _uuid

    from adpkv_vllm.connector.connector import AdpConnectorMetadata, AdpKVConnector, ChunkPlan

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    h = Harness(model_dir, gateway.port, namespace=f"tp-{_uuid.uuid4().hex[:6]}", chunk_size=CHUNK,
                groups=[(names, spec)])
    h.close()                     # only its configs are used; the TP engine attaches below
    h.vllm_config.kv_transfer_config.engine_id = str(_uuid.uuid4())
    if layout == "canonical":
        h.vllm_config.parallel_config.tensor_parallel_size = 2
    plan = ChunkPlan("r", [bytes([i]) * 16 for i in range(3)], [0, 0, 0], list(range(6)))
    meta = AdpConnectorMetadata(step=1, saves=[plan])
    writers = []
    for r in range(2):
        w = AdpKVConnector(h.vllm_config, KVConnectorRole.WORKER, h.kv_cache_config)
        w.config.tp_size = 2
        assert w.config.head_sharded == (layout == "canonical"), w.config.tp_dependent
        kv = {n: torch.randn(256, 1, 32, 128) for n in h.layer_names}
        _register_as_rank(w, kv, r)
        writers.append((w, kv))
    for w, kv in writers:
        w.bind_connector_metadata(meta)
        for n in h.layer_names:
            w.save_kv_layer(n, kv[n], object())
    for w, _ in writers:
        w.wait_for_save()
    # saves are asynchronous: wait until the gateway reports all 3 chunks x 2 layers stored on
    # the card (its counter moves when the card write is done), not merely handed to the ring
    from adpkv_gateway.ops import control

    def objects():
        return control.request(gateway.port, {"op": "STATS"})["stats"]["objects"]
    deadline = time.monotonic() + 10
    while objects().get("stored", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (objects().get("stored", 0), objects().get("store_failed", 0)) == (6, 0), objects()
    for w, _ in writers:
        w.clear_connector_metadata()
        w.shutdown()

    h.vllm_config.kv_transfer_config.engine_id = str(_uuid.uuid4())
    load = ChunkPlan("r2", plan.digests, plan.marks, [40 + i for i in range(6)])
    meta2 = AdpConnectorMetadata(step=7, loads=[load])
    readers = []
    for r in range(2):
        w = AdpKVConnector(h.vllm_config, KVConnectorRole.WORKER, h.kv_cache_config)
        w.config.tp_size = 2
        kv = {n: torch.zeros(256, 1, 32, 128) for n in h.layer_names}
        _register_as_rank(w, kv, r)
        readers.append((w, kv))
    for w, _ in readers:
        w.bind_connector_metadata(meta2)
        w.start_load_kv(None)
    for w, _ in readers:
        for n in h.layer_names:
            w.wait_for_layer_load(n)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
    for (w, kv), (_, src) in zip(readers, writers):
        for n in h.layer_names:
            assert torch.equal(kv[n][40:46], src[n][0:6])
        w.clear_connector_metadata()
        w.shutdown()
    counters = control.request(gateway.port, {"op": "STATS"})["stats"]["counters"]
    # the gateway ran one request per layer each way for both ranks together
    assert counters["put_requests"] == 2 and counters["get_requests"] == 2


def _register_as_rank(w, kv, rank):
    """register_kv_caches as TP rank ``rank`` (vLLM's TP group does not exist in this process)."""
    import vllm.distributed.parallel_state as ps
    orig = ps.get_tensor_model_parallel_rank
    ps.get_tensor_model_parallel_rank = lambda: rank
    try:
        w.register_kv_caches(kv)
    finally:
        ps.get_tensor_model_parallel_rank = orig
    assert w.connector_worker.rank == rank and w.connector_worker.client.enabled


def test_misspelt_settings_refused(model_dir):
    """A misspelt ``adpkv.*`` key of kv_connector_extra_config stops the connector with the near
    miss named (it was silently ignored: the engine ran on port 5557 with no namespace); vLLM's
    own keys in the same dict (spec_name, block_size, ...) are left alone. The real connectors:
    AdpKVConnector and vLLM's OffloadingConnector with AdpOffloadingSpec."""
    from adpkv_vllm.common.settings import AdapterSettings

    for offloading in (False, True):
        with pytest.raises(ValueError) as err:
            Harness(model_dir, 1, offloading=offloading, extra={"adpkv.prot": 5590, "adpkv.namesapce": "x"})
        text = str(err.value)
        assert "'adpkv.prot' (did you mean 'adpkv.port'?)" in text, text
        assert "'adpkv.namesapce' (did you mean 'adpkv.namespace'?)" in text, text
    with pytest.raises(ValueError, match=r"'adpkv.chunk_sise' \(did you mean 'adpkv.chunk_size'\?\)"):
        AdapterSettings.from_extra_config({"adpkv.chunk_sise": 64}, 32)
    ok = AdapterSettings.from_extra_config({"spec_name": "X", "block_size": 16, "cpu_bytes_to_use": 1,
                                            "adpkv.chunk_size": 64, "adpkv.exist_layers": "all",
                                            "adpkv.reconnect_s": 1, "adpkv.direct_map_bytes": 0}, 32)
    assert ok.chunk_size == 64 and ok.exist_layers == "all"
    with pytest.raises(ValueError, match=r"adpkv.lookup_wait_s must be a number of seconds >= 0, got '-1'"):
        AdapterSettings.from_extra_config({"adpkv.lookup_wait_s": "-1"}, 32)     # one number parser


def test_namespace_settings():
    """adpkv.namespace alone is the namespace; adpkv.key_namespace_from_model derives it from the
    model identity (adpkv_core.keys.key_namespace). Changed meaning: with both set, the identity
    now counts too (an explicit adpkv.namespace used to replace it). An unknown field (a local
    model without --revision) gives a namespace private to the engine: its scheduler and workers
    agree, nobody else shares it."""
    from adpkv_vllm.common.settings import AdapterSettings, resolve_namespace

    mc = types.SimpleNamespace(model="/models/llama", revision="abc", dtype="bfloat16",
                               hf_text_config=types.SimpleNamespace(num_hidden_layers=2),
                               get_total_num_kv_heads=lambda: 2, get_head_size=lambda: 64)
    vc = types.SimpleNamespace(model_config=mc, parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
                               cache_config=types.SimpleNamespace(block_size=32, cache_dtype="auto"))

    def ns(engine="e1", **extra):
        return resolve_namespace(vc, AdapterSettings.from_extra_config(extra, 32), "cpu:NHD", engine)

    assert ns() == "default" and ns(**{"adpkv.namespace": "llama-tp1"}) == "llama-tp1"
    derived = ns(**{"adpkv.key_namespace_from_model": True})
    assert derived.startswith("model-") and derived == ns("e2", **{"adpkv.key_namespace_from_model": True})
    both = ns(**{"adpkv.key_namespace_from_model": True, "adpkv.namespace": "llama-tp1"})
    assert both.startswith("model-") and both not in (derived, "llama-tp1")
    assert derived != ns(**{"adpkv.key_namespace_from_model": True, "adpkv.chunk_size": 64})
    mc.revision = None
    private = ns(**{"adpkv.key_namespace_from_model": True})
    assert private.startswith("private-") and private == ns(**{"adpkv.key_namespace_from_model": True})
    assert private != ns("e2", **{"adpkv.key_namespace_from_model": True})
