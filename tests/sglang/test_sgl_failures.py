"""Without a gateway, or when it goes away, SGLang keeps serving: misses, failed sets, no exceptions."""

from __future__ import annotations

import time

import torch

from sgl_pools import fill_random, mha_pool, page_bytes, page_hashes, storage_config

from adpkv_gateway.ops.spawn import free_port

N = 4


def test_no_gateway_means_misses_and_failed_sets(backends):
    pool = mha_pool("page_first")
    fill_random(pool, seed=30)
    cfg = storage_config({"port": free_port(), "model_id": "tiny", "connect_timeout_s": 0.5,
                          "reconnect_s": 0})
    t = time.monotonic()
    b = backends(cfg, pool)                              # attaching fails: logged, not raised
    assert time.monotonic() - t < 5
    assert not b.attached
    keys = page_hashes(N, salt="down")
    idx = pool.alloc(N * pool.page_size)
    before = pool.kv_buffer.clone()
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, idx) == [False] * N
    assert torch.equal(pool.kv_buffer.view(torch.int16), before.view(torch.int16)), "a failed get wrote into the pool"
    assert b.batch_set_v1(keys, idx) == [False] * N
    assert b.exists(keys[0]) is False
    assert b.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]) == [None] * N
    assert b.set(keys[0], pool.get_data_page(0)) is False
    assert b.batch_set(keys, [pool.get_data_page(0)] * N) is False
    assert b.clear() is False
    assert b.get_stats() is not None
    b.close()
    b.close()


def test_bad_host_indices_fail_the_batch_not_sglang(gateway, backends):
    pool = mha_pool("page_first")
    b = backends(storage_config({"port": gateway.port, "model_id": "tiny"}), pool)
    keys = page_hashes(N, salt="bad")
    assert b.batch_set_v1(keys, torch.arange(0, 3)) == [False] * N                 # not whole pages
    assert b.batch_get_v1(keys, torch.arange(1, 1 + N * pool.page_size)) == [False] * N   # unaligned
    assert b.batch_set_v1(keys, torch.arange(10 ** 6, 10 ** 6 + N * pool.page_size)) == [False] * N
    assert b.batch_exists([]) == 0 and b.batch_get_v1([], torch.arange(0)) == []


def test_gateway_gone_then_back_reattaches(start_gateway, backends):
    gw = start_gateway(engine_timeout_s=1)
    pool = mha_pool("page_first")
    fill_random(pool, seed=31)
    P = pool.page_size
    cfg = storage_config({"port": gw.port, "model_id": "tiny", "timeout_s": 1.5, "reconnect_s": 0.5,
                          "connect_timeout_s": 1.0})
    b = backends(cfg, pool)
    keys = page_hashes(N, salt="gone")
    idx = pool.alloc(N * P)
    assert all(b.batch_set_v1(keys, idx))
    gw.kill()                                            # the gateway crashes
    t = time.monotonic()
    more = page_hashes(N, salt="gone-2")
    assert b.batch_set_v1(more, idx) == [False] * N      # times out, turns the cache off on this rank
    assert b.batch_exists(keys) == 0
    assert time.monotonic() - t < 15
    gw.start()                                           # back (same card, same port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and b.batch_exists(keys) != N:
        time.sleep(0.3)                                  # a background attempt re-attaches
    assert b.batch_exists(keys) == N
    dst = mha_pool("page_first")
    b.register_mem_pool_host(dst)
    dst_idx = dst.alloc(N * P)
    assert b.batch_get_v1(keys, dst_idx) == [True] * N
    assert [page_bytes(dst, int(dst_idx[i * P])) for i in range(N)] == \
        [page_bytes(pool, int(idx[i * P])) for i in range(N)]
