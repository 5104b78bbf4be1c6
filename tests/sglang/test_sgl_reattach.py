"""The SGLang backend re-attaches through adpkv_core.attachment: after GatewayProcess.restart
(graceful and kill -9) the same backend instance, on the same real host pool, finds and
restores its pages again (no new backend, no new pool registration)."""

from __future__ import annotations

import logging
import time

import pytest

from sgl_pools import fill_random, mha_pool, page_bytes, page_hashes, storage_config

from adpkv_core.attachment import BACK_ON_MESSAGE

N = 6


@pytest.mark.parametrize("hard", [False, True], ids=["restart", "kill-9"])
def test_same_backend_restores_after_the_gateway_restarts(start_gateway, backends, caplog, hard):
    caplog.set_level(logging.INFO, logger="adpkv")
    gw = start_gateway(engine_timeout_s=1)
    pool = mha_pool("page_first")
    fill_random(pool, seed=41)
    P = pool.page_size
    cfg = storage_config({"port": gw.port, "model_id": "tiny", "timeout_s": 1.5, "reconnect_s": 0.2,
                          "connect_timeout_s": 1.0})
    b = backends(cfg, pool)
    keys = page_hashes(N, salt=f"reattach-{hard}")
    idx = pool.alloc(N * P)
    assert all(b.batch_set_v1(keys, idx))
    want = [page_bytes(pool, int(idx[i * P])) for i in range(N)]

    gw.restart(hard=hard)
    deadline = time.monotonic() + 20
    while b.batch_exists(keys) != N:        # misses (never raises) until re-attached
        assert time.monotonic() < deadline, "the backend did not come back"
        time.sleep(0.1)                     # polling with a deadline
    dst_idx = pool.alloc(N * P)             # other pages of the same pool (other random bytes)
    assert [page_bytes(pool, int(dst_idx[i * P])) for i in range(N)] != want
    assert b.batch_get_v1(keys, dst_idx) == [True] * N
    assert [page_bytes(pool, int(dst_idx[i * P])) for i in range(N)] == want
    more = page_hashes(2, salt=f"reattach-more-{hard}")
    assert all(b.batch_set_v1(more, idx[: 2 * P]))      # stores work again too
    msgs = [r.getMessage() for r in caplog.records]
    assert sum(BACK_ON_MESSAGE in m for m in msgs) == 1, msgs
