"""The zero-copy path (interface_v1) against real SGLang host pools and real gateway processes."""

from __future__ import annotations

import pytest
import torch

from sgl_pools import LAYOUTS, fill_random, mha_pool, mla_pool, page_bytes, page_hashes, storage_config

from adpkv_gateway.ops import control

POOLS = {"mha": mha_pool, "mla": mla_pool}
N = 10          # pages per test batch


def stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


def cfg_for(gw, kind, layout, **extra):
    return storage_config({"port": gw.port, "model_id": "tiny-llama", "interface_v1": 1, **extra},
                          mla=kind == "mla", layout=layout)


def page_list(pool, indices):
    return [page_bytes(pool, int(indices[i * pool.page_size])) for i in range(len(indices) // pool.page_size)]


def scattered(pool, n):
    """``n`` whole pages of the pool, not in order (as a busy host pool hands them out)."""
    pool.alloc(3 * pool.page_size)                   # skip a few pages
    idx = pool.alloc(n * pool.page_size)
    pages = idx.reshape(n, pool.page_size)
    return pages[torch.randperm(n, generator=torch.Generator().manual_seed(n))].reshape(-1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_set_then_new_instance_restores_identical_pages(gateway, backends, kind, layout):
    src = POOLS[kind](layout)
    fill_random(src, seed=1)
    keys = page_hashes(N, salt=f"{kind}-{layout}")
    src_idx = src.alloc(N * src.page_size)
    writer = backends(cfg_for(gateway, kind, layout), src)
    assert writer.batch_set_v1(keys, src_idx) == [True] * N
    assert writer.batch_exists(keys) == N
    writer.close()
    s = stats(gateway.port)
    assert s["counters"]["put_requests"] == 1, "one PUT request per batch"

    dst = POOLS[kind](layout)                          # a fresh pool: zeros
    dst_idx = scattered(dst, N)
    reader = backends(cfg_for(gateway, kind, layout), dst)
    assert reader.batch_exists(keys) == N
    assert reader.batch_get_v1(keys, dst_idx) == [True] * N
    assert page_list(dst, dst_idx) == page_list(src, src_idx)
    s = stats(gateway.port)
    # one EXIST per batch_exists (and one before the PUT: pages stored already are skipped)
    assert s["counters"]["get_requests"] == 1 and s["counters"]["exist_requests"] == 3


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_restarted_gateway_restores_identical_pages(start_gateway, backends, kind):
    gw = start_gateway()
    src = POOLS[kind]("page_first")
    fill_random(src, seed=2)
    keys = page_hashes(N, salt=f"restart-{kind}")
    src_idx = src.alloc(N * src.page_size)
    b = backends(cfg_for(gw, kind, "page_first"), src)
    assert all(b.batch_set_v1(keys, src_idx))
    b.close()
    gw.restart(hard=True)                              # kill -9, then a new gateway process
    dst = POOLS[kind]("page_first")
    dst_idx = scattered(dst, N)
    b2 = backends(cfg_for(gw, kind, "page_first"), dst)
    assert b2.batch_get_v1(keys, dst_idx) == [True] * N
    assert page_list(dst, dst_idx) == page_list(src, src_idx)


def test_partial_hits_stop_at_the_first_missing_page(gateway, backends):
    src = mha_pool("page_first")
    fill_random(src, seed=3)
    keys = page_hashes(N, salt="partial")
    idx = src.alloc(N * src.page_size)
    P = src.page_size
    b = backends(cfg_for(gateway, "mha", "page_first"), src)
    missing = 6
    have = [i for i in range(N) if i != missing]
    sel = torch.cat([idx[i * P:(i + 1) * P] for i in have])
    assert all(b.batch_set_v1([keys[i] for i in have], sel))
    assert b.batch_exists(keys) == missing
    assert b.batch_exists(keys[missing + 1:]) == N - missing - 1
    assert b.batch_exists(["0" * 64] + keys) == 0

    dst = mha_pool("page_first")
    b.register_mem_pool_host(dst)
    dst_idx = dst.alloc(N * P)
    got = b.batch_get_v1(keys, dst_idx)
    assert got[:missing] == [True] * missing and got[missing] is False
    # what SGLang's controller takes: the hits before the first miss
    assert got.index(False) == missing
    assert page_list(dst, dst_idx[:missing * P]) == page_list(src, idx[:missing * P])
    assert page_bytes(dst, int(dst_idx[missing * P])) == bytes(len(page_bytes(dst, 0))), \
        "a missing page must stay untouched"


def test_two_model_ids_never_share(gateway, backends):
    src = mha_pool("page_first")
    fill_random(src, seed=4)
    keys = page_hashes(N, salt="models")
    idx = src.alloc(N * src.page_size)
    a = backends(cfg_for(gateway, "mha", "page_first"), src)
    assert all(a.batch_set_v1(keys, idx))
    a.close()
    for other in [dict(model_id="other-model"), dict(namespace="tenant-b"), dict(revision="r2")]:
        b = backends(cfg_for(gateway, "mha", "page_first", **other), mha_pool("page_first"))
        assert b.batch_exists(keys) == 0, other
        assert b.batch_get_v1(keys, b.mem_pool_host.alloc(N * src.page_size)) == [False] * N
        b.close()
    # the same model laid out differently (flat pages differ) or sharded differently
    c = backends(cfg_for(gateway, "mha", "layer_first"), mha_pool("layer_first"))
    assert c.batch_exists(keys) == 0
    c.close()
    tp2 = storage_config({"port": gateway.port, "model_id": "tiny-llama"}, tp_size=2)
    d = backends(tp2, mha_pool("page_first"))
    assert d.batch_exists(keys) == 0
    d.close()
    # and the same settings again do share
    e = backends(cfg_for(gateway, "mha", "page_first"), mha_pool("page_first"))
    assert e.batch_exists(keys) == N


def test_mha_tp_ranks_keep_their_own_heads(gateway, backends):
    keys = page_hashes(N, salt="tp")
    pools, idx = [], []
    ranks = []
    for r in range(2):
        p = mha_pool("page_first")
        fill_random(p, seed=10 + r)
        pools.append(p)
        idx.append(p.alloc(N * p.page_size))
        cfg = storage_config({"port": gateway.port, "model_id": "tiny-llama"}, tp_rank=r, tp_size=2)
        ranks.append(backends(cfg, p))
    for r in range(2):                                 # same page hashes, each rank its own bytes
        assert all(ranks[r].batch_set_v1(keys, idx[r]))
    assert stats(gateway.port)["objects"]["stored"] == 2 * N
    for r in range(2):
        fresh = mha_pool("page_first")
        fresh_idx = fresh.alloc(N * fresh.page_size)
        ranks[r].register_mem_pool_host(fresh)         # re-attach with a fresh pool
        assert ranks[r].batch_get_v1(keys, fresh_idx) == [True] * N
        assert page_list(fresh, fresh_idx) == page_list(pools[r], idx[r])


def test_mla_only_the_storage_writer_writes(gateway, backends):
    keys = page_hashes(N, salt="mla-writer")
    src = [mla_pool("page_first") for _ in range(2)]
    for r, p in enumerate(src):
        fill_random(p, seed=20 + r)   # rank 1's bytes differ: they must never be stored
    idx = [p.alloc(N * p.page_size) for p in src]
    cfgs = [storage_config({"port": gateway.port, "model_id": "tiny-dsv3"}, mla=True, tp_rank=r, tp_size=2)
            for r in range(2)]
    assert cfgs[0].is_storage_writer and not cfgs[1].is_storage_writer
    w, nw = backends(cfgs[0], src[0]), backends(cfgs[1], src[1])
    assert nw.batch_set_v1(keys, idx[1]) == [True] * N   # nothing to do for a non-writer: success
    s = stats(gateway.port)
    assert s["counters"].get("put_requests", 0) == 0 and s["objects"].get("stored", 0) == 0
    assert nw.batch_exists(keys) == 0
    assert nw.batch_set([keys[0]], [src[1].get_data_page(0)]) is True
    assert stats(gateway.port)["objects"].get("stored", 0) == 0
    assert all(w.batch_set_v1(keys, idx[0]))
    # every rank reads the writer's pages (MLA keys carry no rank)
    for b in (w, nw):
        dst = mla_pool("page_first")
        dst_idx = dst.alloc(N * dst.page_size)
        b.register_mem_pool_host(dst)
        assert b.batch_get_v1(keys, dst_idx) == [True] * N
        assert page_list(dst, dst_idx) == page_list(src[0], idx[0])


def test_batches_larger_than_the_ring(start_gateway, backends):
    # 1 MiB ring: at most 512 KiB per ring batch; one request of 40 pages of 40 KiB runs in batches
    gw = start_gateway(shared_memory_size=1 << 20)
    src = mha_pool("layer_first", layers=8, heads=4, head_dim=40, page=8, pages=44)
    fill_random(src, seed=5)
    n = 40
    keys = page_hashes(n, salt="big")
    idx = src.alloc(n * src.page_size)
    b = backends(storage_config({"port": gw.port, "model_id": "m"}, layout="layer_first"), src)
    assert all(b.batch_set_v1(keys, idx))
    dst = mha_pool("layer_first", layers=8, heads=4, head_dim=40, page=8, pages=44)
    b.register_mem_pool_host(dst)
    dst_idx = dst.alloc(n * dst.page_size)
    assert b.batch_get_v1(keys, dst_idx) == [True] * n
    assert page_list(dst, dst_idx) == page_list(src, idx)
    s = stats(gw.port)["counters"]
    assert s["put_requests"] == 1 and s["get_requests"] == 1


def test_set_skips_pages_stored_already(gateway, backends):
    src = mha_pool("page_first")
    fill_random(src, seed=6)
    keys = page_hashes(N, salt="again")
    idx = src.alloc(N * src.page_size)
    P = src.page_size
    b = backends(cfg_for(gateway, "mha", "page_first"), src)
    assert all(b.batch_set_v1(keys[:4], idx[:4 * P]))
    assert stats(gateway.port)["counters"]["put_requests"] == 1
    assert b.batch_set_v1(keys[:4], idx[:4 * P]) == [True] * 4        # all there: no PUT at all
    assert stats(gateway.port)["counters"]["put_requests"] == 1
    assert b.batch_set_v1(keys, idx) == [True] * N                     # only the 6 new pages move
    s = stats(gateway.port)
    assert s["counters"]["put_requests"] == 2 and s["objects"]["stored"] == N
    assert b.counters["pages_written"] == N


def test_page_head_layout_and_an_unsupported_layout(gateway, backends):
    # page_head (MHA, used for heterogeneous TP): its pages are affine segments too
    src = mha_pool("page_head")
    fill_random(src, seed=50)
    keys = page_hashes(N, salt="page-head")
    idx = src.alloc(N * src.page_size)
    b = backends(cfg_for(gateway, "mha", "page_head"), src)
    assert all(b.batch_set_v1(keys, idx))
    dst = mha_pool("page_head")
    b.register_mem_pool_host(dst)
    dst_idx = scattered(dst, N)
    assert b.batch_get_v1(keys, dst_idx) == [True] * N
    assert page_list(dst, dst_idx) == page_list(src, idx)
    b.close()
    # page_unified has no page buffer metadata: L3 stays off for it, SGLang goes on
    uni = mha_pool("page_unified")
    u = backends(cfg_for(gateway, "mha", "page_unified"), uni)
    uidx = uni.alloc(N * uni.page_size)
    assert u.batch_set_v1(keys, uidx) == [False] * N
    assert u.batch_get_v1(keys, uidx) == [False] * N
    assert u.batch_exists(keys) == 0
