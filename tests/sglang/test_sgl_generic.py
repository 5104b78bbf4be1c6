"""The generic path, the dynamic factory, dialog marks, clear and stats."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_pools import LAYOUTS, fill_random, mha_pool, mla_pool, page_bytes, page_hashes, storage_config

from adpkv_core.affinity import dialog_marks

N = 6


def cfg_for(gw, mla=False, layout="page_first", **extra):
    return storage_config({"port": gw.port, "model_id": "tiny", **extra}, mla=mla, layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_generic_path_round_trips_through_flat_pages(gateway, backends, layout, mla):
    make = mla_pool if mla else mha_pool
    src = make(layout)
    fill_random(src, seed=7)
    P = src.page_size
    idx = src.alloc(N * P)
    keys = page_hashes(N, salt=f"generic-{layout}-{mla}")
    b = backends(cfg_for(gateway, mla, layout), src)
    # what SGLang's controller does without interface_v1 (_generic_page_set / _generic_page_get)
    data = [src.get_data_page(idx[i * P]) for i in range(N)]
    assert b.batch_set(keys[:-1], data[:-1]) is True
    assert b.set(keys[-1], data[-1]) is True
    assert all(b.exists(k) for k in keys) and not b.exists("f" * 64)
    dst = make(layout)
    dst_idx = dst.alloc(N * P)
    got = b.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    assert all(t is not None for t in got)
    for i, page in enumerate(got):
        dst.set_from_flat_data_page(int(dst_idx[i * P]), page)
    for i in range(N):
        assert page_bytes(dst, int(dst_idx[i * P])) == page_bytes(src, int(idx[i * P]))
    assert b.get("e" * 64, dst.get_dummy_flat_data_page()) is None
    one = b.get(keys[0])                                # no target: the backend makes one
    assert one is not None and one.contiguous().view(torch.uint8).numpy().tobytes() == page_bytes(src, int(idx[0]))
    # the generic and the zero-copy path store the same bytes under the same keys
    v1 = mha_pool(layout) if not mla else mla_pool(layout)
    b.register_mem_pool_host(v1)
    v1_idx = v1.alloc(N * P)
    assert b.batch_get_v1(keys, v1_idx) == [True] * N
    assert [page_bytes(v1, int(v1_idx[i * P])) for i in range(N)] == \
        [page_bytes(src, int(idx[i * P])) for i in range(N)]


def test_dynamic_factory_builds_and_uses_the_backend(gateway):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from adpkv_sglang import AdpHiCacheStorage

    pool = mha_pool("page_first_direct")
    fill_random(pool, seed=8)
    extra = {"backend_name": "adpkv", "module_path": "adpkv_sglang", "class_name": "AdpHiCacheStorage",
             "interface_v1": 1, "port": gateway.port, "model_id": "tiny"}
    cfg = storage_config(extra, layout="page_first_direct")
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    try:
        assert isinstance(b, AdpHiCacheStorage)
        b.register_mem_pool_host(pool)                 # as the cache controller does next
        keys = page_hashes(4, salt="factory")
        idx = pool.alloc(4 * pool.page_size)
        assert b.batch_set_v1(keys, idx) == [True] * 4
        assert b.batch_exists(keys) == 4
    finally:
        b.close()


def _objects(card):
    return sum(len([f for f in names if not f.startswith(".")]) for d, _, names in os.walk(card)
               if os.path.basename(os.path.dirname(d)).startswith("db"))   # databases' object subdirectories


def test_prefix_keys_give_dialog_marks_and_one_card_per_dialog(start_gateway, backends, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo as Info

    cards = [str(tmp_path / "c0"), str(tmp_path / "c1"), str(tmp_path / "c2")]
    gw = start_gateway(card_dirs=cards)
    src = mha_pool("page_first", pages=40)
    fill_random(src, seed=9)
    P = src.page_size
    b = backends(cfg_for(gw, affinity_chunks=1, interface_v1=1), src)
    for d in range(4):
        hashes = page_hashes(12, salt=f"dialog-{d}")
        before = [_objects(c) for c in cards]
        # the controller sends a long prompt in batches; prefix_keys = every hash before the batch
        for start, stop in ((0, 5), (5, 12)):
            info = Info(prefix_keys=hashes[:start])
            assert b._marks(hashes[start:stop], info) == dialog_marks(hashes, 1)[start:stop]
            idx = src.alloc((stop - start) * P)
            assert all(b.batch_set_v1(hashes[start:stop], idx, info))
            src.free(idx)
        grew = sorted(_objects(c) - n for c, n in zip(cards, before))
        assert grew == [0, 0, 12], f"dialog {d} spread over cards: {grew}"
        assert b.batch_exists(hashes[:5], Info(prefix_keys=[])) == 5
        assert b.batch_exists(hashes[5:], Info(prefix_keys=hashes[:5])) == 7
    # without prefix keys the pages go by their own hash: one prompt spreads over the cards
    hashes = page_hashes(12, salt="no-prefix")
    before = [_objects(c) for c in cards]
    idx = src.alloc(12 * P)
    assert all(b.batch_set_v1(hashes, idx))
    assert sum(1 for c, n in zip(cards, before) if _objects(c) > n) > 1
    assert b.batch_exists(hashes) == 12


def test_dialog_marks_follow_affinity_chunks(gateway, backends):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo as Info

    b = backends(cfg_for(gateway, affinity_chunks=3, interface_v1=1), mha_pool("page_first"))
    hashes = page_hashes(9, salt="affinity")
    want = dialog_marks(hashes, 3)
    assert len(set(want[2:])) == 1 and len(set(want[:3])) == 3
    for start, stop in ((0, 1), (1, 4), (4, 9), (0, 9), (2, 3)):
        assert b._marks(hashes[start:stop], Info(prefix_keys=hashes[:start])) == want[start:stop]
    assert b._marks(hashes[:3], None) is None        # no prefix keys: placement by page
    # SGLang's generic path stores without prefix keys: without interface_v1 no marks at all,
    # so lookups (which do get prefix keys) and stores agree on the card
    g = backends(cfg_for(gateway, affinity_chunks=3), None)
    assert g._marks(hashes[1:4], Info(prefix_keys=hashes[:1])) is None


def test_clear_deletes_and_is_refused_on_shared_storage(start_gateway, backends):
    gw = start_gateway()
    src = mha_pool("page_first")
    fill_random(src, seed=11)
    keys = page_hashes(N, salt="clear")
    idx = src.alloc(N * src.page_size)
    b = backends(cfg_for(gw), src)
    assert all(b.batch_set_v1(keys, idx))
    assert b.clear() is True
    assert b.batch_exists(keys) == 0
    b.close()

    shared = start_gateway(shared_storage=True)
    s = backends(cfg_for(shared), src)
    assert all(s.batch_set_v1(keys, idx))
    assert s.clear() is False
    assert s.batch_exists(keys) == N


def test_get_stats_reports_storage_metrics(gateway, backends):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    src = mha_pool("page_first")
    fill_random(src, seed=12)
    keys = page_hashes(N, salt="stats")
    idx = src.alloc(N * src.page_size)
    cfg = storage_config({"port": gateway.port, "model_id": "tiny"}, metrics=True)
    b = backends(cfg, src)
    assert all(b.batch_set_v1(keys, idx))
    assert all(b.batch_get_v1(keys, idx))
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [N] and m.prefetch_pgs == [N]
    assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
    assert b.get_stats().prefetch_pgs == []             # reported once
