"""What vLLM 0.34 changed in the contracts adpkv follows, on vLLM 0.34's own classes and real
gateway processes (harness.py: vLLM's Scheduler with AdpKVConnector on both roles, the worker on
CPU KV tensors, every restore checked byte for byte).

- ``KVConnectorBase_V1.kv_cache_access``: the connector says ``IN_PROCESS``, so vLLM keeps its
  extensible KV cache; the connector is then made after the final commit, over views of the
  committed blocks, or, for a layout that is not block-compact, over views of the whole
  reservation: the worker maps only the committed blocks (the first ones: blocks keep fixed
  offsets) and restores them byte for byte.
- ``supports_lookahead_block_hashes``: stated False.
- ``may_load_async`` (``--max-num-inflight-kv-loads``): true where our loads are asynchronous
  (asynchronous scheduling) and the request can hit; such a request waits in vLLM's queue of
  asynchronous loads and is restored byte for byte; false for a synchronous engine.
- Default block size 16 -> 64: an engine of 16-token blocks (0.33's default) is found by a 0.34
  engine run with 16-token blocks; 64-token blocks hashed by 64 (0.34's default) have other keys.
  A model of several KV cache groups may hash finer than its blocks (``prefix_match_unit``): a
  0.34 engine of 64-token blocks hashed every 16 tokens names chunks as a 16-token-block engine
  does, never reads those objects as its own where their bytes differ (attention pages: a miss)
  and reads them where the layout allows (MLA latent pages: byte for byte).
- Offloading: ``DevicePointers`` turned back into block ids (``vllm_api.offload_device_blocks``),
  a pointer that is not a row of its tensor refused.

What did not run without a GPU: vLLM's extensible KV cache itself (CUDA virtual memory) and its
GPU model runner; the test lays the KV tensors out as it does (a reservation, the committed
blocks first).
"""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
import torch

from harness import Harness
from test_hybrid_scheduler import layers
from test_model_runner_v2 import stored  # one engine stores a prompt in a fresh namespace (the 0.33 suite's)

CHUNK = 64


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def restored(model_dir, port, toks, ns, **kw) -> int:
    """Tokens a fresh engine restores of ``toks`` (every byte it holds then checked)."""
    h = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK, **kw)
    try:
        req = h.add(toks)
        so, _ = h.step_until_scheduled(req)
        hit = len(toks) - so.num_scheduled_tokens[req.request_id]
        h.step_until_computed(req, len(toks))
        h.check_kv(req, len(toks))
        h.run()
        return hit
    finally:
        h.close()


# ------------------------------------------------------------------ kv_cache_access, lookahead
def test_the_connector_reaches_the_kv_cache_in_process_only(model_dir, gateway):
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from adpkv_vllm import AdpKVConnector

    h = Harness(model_dir, gateway.port, chunk_size=CHUNK)
    try:
        ktc = h.vllm_config.kv_transfer_config
        assert "kv_cache_access" in vars(AdpKVConnector)          # declared, not inherited
        access = KVConnectorFactory.kv_cache_access(ktc)          # what vLLM's config resolution asks
        assert access == KVCacheAccess.IN_PROCESS
        assert not access.needs_single_chunk() and KVCacheAccess.LEGACY_IPC not in access
        assert "supports_lookahead_block_hashes" in vars(AdpKVConnector)
        assert AdpKVConnector.supports_lookahead_block_hashes(ktc) is False
        # vLLM's own decision on a CUDA platform (played here: the CPU has no extensible cache):
        # with this connector the extensible KV cache is on by default
        from unittest import mock

        from vllm.platforms import current_platform
        cc = h.vllm_config.cache_config
        cc.enable_extensible_kv_cache, cc._extensible_kv_cache_resolved = None, False
        platform = type(current_platform)
        with mock.patch.object(platform, "is_cuda_alike", lambda self: True), \
                mock.patch.object(platform, "is_rocm", lambda self: False):
            h.vllm_config._resolve_extensible_kv_cache()
        assert cc.enable_extensible_kv_cache is True
    finally:
        h.close()


class ReservedHarness(Harness):
    """KV tensors laid out as vLLM 0.34's extensible KV cache leaves them for a layout that is
    not block-compact (``LHBNC``: ``committed_views`` is None): views over the whole reservation
    (``RESERVED`` times the committed blocks), the committed blocks first; the worker's KV cache
    config says the committed count."""

    RESERVED = 2

    def _kv_tensor(self, spec, num_blocks):
        full = super()._kv_tensor(spec, num_blocks * self.RESERVED)
        full[num_blocks:].fill_(-7.0)          # what uncommitted pages would read as: not ours
        return full


def test_register_kv_caches_maps_only_the_committed_blocks(model_dir, gateway):
    toks = tokens(300, 1)
    ns = f"res-{uuid.uuid4().hex[:6]}"
    h = ReservedHarness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        assert next(iter(h.kv.values())).shape[0] == 2 * h.kv_cache_config.num_blocks
        layer = next(iter(h.worker.connector_worker.layers.values()))
        assert layer.view.shape[0] == h.kv_cache_config.num_blocks      # the committed blocks
        assert layer.page_shape == tuple(next(iter(h.kv.values())).shape[1:])
        req = h.add(toks)
        h.run()
        assert req.request_id in h.finished_sending
    finally:
        h.close()
    h = ReservedHarness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req = h.add(toks)
        so, _ = h.step_until_scheduled(req)
        assert len(toks) - so.num_scheduled_tokens[req.request_id] == 256
        h.step_until_computed(req, len(toks))
        h.check_kv(req, len(toks))
        h.run()
    finally:
        h.close()


# ------------------------------------------------------------------ may_load_async
def test_asynchronous_loads_wait_in_vllms_queue_of_async_loads(model_dir, gateway):
    toks = tokens(400, 2)
    ns = stored(model_dir, gateway.port, toks)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK, async_scheduling=True)
    try:
        h.vllm_config.scheduler_config.max_num_inflight_kv_loads = 1
        short = h.add(tokens(40, 3))                # no whole chunk before its last token
        assert not h.connector.may_load_async(short)
        req = h.add(toks)
        assert h.connector.may_load_async(req)
        assert req in list(h.scheduler.async_kv_waiting) and req not in list(h.scheduler.waiting)
        so, _ = h.step_until_scheduled(req)
        h.step_until_computed(req, len(toks))
        h.check_kv(req, len(toks))
        h.run()
        assert req.request_id in h.finished_recving          # it was an asynchronous load
    finally:
        h.close()
    sync = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        sync.vllm_config.scheduler_config.max_num_inflight_kv_loads = 1
        req = sync.add(toks)
        assert not sync.connector.may_load_async(req)       # loads within the step: never async
        assert req in list(sync.scheduler.waiting)
        sync.run()
    finally:
        sync.close()


# ------------------------------------------------------------------ block size 16 -> 64
def two_groups(block, kind="full"):
    """A model of two KV cache groups (vLLM hashes finer than a block only with several: one
    group hashes by its block), with ``block``-token blocks: attention pages (heads outermost)
    or MLA latent pages (token-major)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    if kind == "mla":
        return [(layers(i), MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=64 + 32 * i,
                                              dtype=torch.float32)) for i in (0, 1)]
    return [(layers(i), FullAttentionSpec(block_size=block, num_kv_heads=2 * (i + 1), head_size=64,
                                          dtype=torch.float32)) for i in (0, 1)]


def test_objects_of_16_token_blocks_are_found_where_the_layout_allows_never_misread(model_dir, gateway):
    toks = tokens(300, 4)
    ns = stored(model_dir, gateway.port, toks, block_size=16)          # vLLM 0.33's default blocks
    # a 0.34 engine run with --block-size 16: the same objects, found byte for byte
    assert restored(model_dir, gateway.port, toks, ns, block_size=16) == 256
    # 0.34's default (64-token blocks, hashed by 64): other keys, a miss
    assert restored(model_dir, gateway.port, toks, ns, block_size=64) == 0
    # a model of two groups: 16-token blocks hashed by 16 (0.33's default) store; 64-token blocks
    # hashed every 16 tokens (prefix_match_unit=16) name the chunks alike but their pages are
    # other bytes (heads outermost): another namespace, a miss, every byte computed
    ns = stored(model_dir, gateway.port, toks, block_size=16, groups=two_groups(16))
    assert restored(model_dir, gateway.port, toks, ns, block_size=16, groups=two_groups(16)) == 256
    assert restored(model_dir, gateway.port, toks, ns, block_size=64, hash_block_size=16,
                    groups=two_groups(64)) == 0


def test_mla_pages_of_16_token_blocks_are_read_by_64_token_blocks(model_dir, gateway):
    toks = tokens(300, 5)
    ns = stored(model_dir, gateway.port, toks, block_size=16, groups=two_groups(16, "mla"))
    # latent pages are token-major: a chunk is the same bytes at any block size
    assert restored(model_dir, gateway.port, toks, ns, block_size=64, hash_block_size=16,
                    groups=two_groups(64, "mla")) == 256


def test_the_namespace_says_the_block_size_only_where_keys_do_not(model_dir, gateway):
    def namespace(block_size, kind="full", **kw):
        h = Harness(model_dir, gateway.port, namespace="bs", chunk_size=CHUNK, block_size=block_size,
                    groups=two_groups(block_size, kind), **kw)
        try:
            return h.connector.connector_scheduler.cfg.namespace
        finally:
            h.close()

    assert namespace(16) == namespace(64) == "bs"             # existing objects keep theirs
    assert namespace(64, hash_block_size=16) == "bs/block64"
    assert namespace(32, hash_block_size=16) == "bs/block32"
    assert namespace(64, "mla", hash_block_size=16) == "bs"


# ------------------------------------------------------------------ offloading: device pointers
def test_device_pointers_are_turned_back_into_the_blocks_they_address():
    from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                         GPULoadStoreSpec)
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    from adpkv_vllm.common.vllm_api import offload_device_blocks

    page = 4 * 64
    tensors = [CanonicalKVCacheTensor(tensor=torch.zeros(32, page, dtype=torch.int8), page_size_bytes=page)
               for _ in range(3)]
    refs = [[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page), CanonicalKVCacheRef(1, page)],
            [CanonicalKVCacheRef(tensor_idx=2, page_size_bytes=page)]]
    caches = CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
    spec = GPULoadStoreSpec([5, 6, 7, 9, 11, 3], group_sizes=[4, 2], block_indices=[2, 8])
    ptrs = resolve_device_pointers(spec, caches)          # what vLLM 0.34 hands the worker
    assert offload_device_blocks(ptrs, tensors, refs) == [(0, [5, 6, 7, 9], 2), (1, [11, 3], 8)]
    assert offload_device_blocks(spec, tensors, refs) == [(0, [5, 6, 7, 9], 2), (1, [11, 3], 8)]
    bad = resolve_device_pointers(spec, caches)
    bad.ptrs = bad.ptrs.copy()
    bad.ptrs[1] += np.uint64(8)                           # inside a row, not a row
    with pytest.raises(ValueError):
        offload_device_blocks(bad, tensors, refs)
    other = resolve_device_pointers(spec, caches)
    other.ptrs = other.ptrs.copy()
    other.ptrs[4] += np.uint64(page)                      # the group's second tensor: another block
    with pytest.raises(ValueError):
        offload_device_blocks(other, tensors, refs)


# ------------------------------------------------------------------ the tier: events, failed promotions
def test_the_tiers_stored_events_say_storage_through_vllms_tracker(model_dir, gateway):
    """``BlockStored.medium`` (GPU / CPU / STORAGE): the rows our tier stores reach vLLM 0.34's
    KV-event stream as ``STORAGE`` stores, next to the CPU tier's ``CPU`` ones."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    from test_secondary_tier import keys_of, tier_json
    from tiering_driver import engine_tiering, store

    conn, m = engine_tiering(model_dir, tier_json(gateway.port))
    try:
        keys = keys_of(6, seed=21)
        assert store(m, keys, "ev") == keys
        stored = [e for e in conn.take_events() if isinstance(e, BlockStored)]
        media = {e.medium for e in stored}
        assert media == {"CPU", "STORAGE"}, media
        ours = [h for e in stored if e.medium == "STORAGE" for h in e.block_hashes]
        assert sorted(ours) == sorted(maybe_convert_block_hash(BlockHash(get_offload_block_hash(k)))
                                      for k in keys)
    finally:
        conn.shutdown()


def test_a_failed_promotion_defers_no_release(model_dir, gateway):
    """``JobResult.deferred_release`` (vLLM 0.34): a tier whose I/O may still write a failed
    promotion's rows hands vLLM an event to wait for. Ours never: a load's requests into vLLM's
    region resolve only once the gateway may no longer write there (adpkv_core.request's write
    margin), and ring copies run before their request resolves. A promotion of rows the gateway
    does not hold fails with no deferred release; vLLM frees the rows at once and recomputes."""
    from vllm.v1.kv_offload.base import LookupResult

    from test_secondary_tier import adp_tier, keys_of, tier_json
    from tiering_driver import engine_tiering, load

    conn, m = engine_tiering(model_dir, tier_json(gateway.port))
    tier = adp_tier(m)
    results = []
    finished = tier.get_finished_jobs

    def recording():
        out = list(finished())
        results.extend(out)
        return out

    tier.get_finished_jobs = recording
    tier._exist = lambda keys: [True] * len(keys)        # lookups say HIT for rows never stored
    try:
        keys = keys_of(4, seed=22)
        res, data, _ = load(m, keys, "p")
        assert res == [LookupResult.MISS] * len(keys) and not data
        failed = [r for r in results if not r.success]
        assert failed and all(r.deferred_release is None for r in failed)
        tier.drain_jobs()
    finally:
        conn.shutdown()
