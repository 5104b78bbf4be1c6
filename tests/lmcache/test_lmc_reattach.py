"""The LMCache adapter re-attaches through adpkv_core.attachment: a restarted gateway process
(GatewayProcess.restart, graceful and kill -9) serves hits again to the same adapter instance."""

from __future__ import annotations

import logging
import time

import pytest

from adpkv_core.attachment import BACK_ON_MESSAGE
from adpkv_core.client import TURNED_OFF_MESSAGE
from lmc_helpers import bits, fresh_prefix, load, lookup, make_key, make_obj, same_bytes, store


@pytest.mark.parametrize("hard", [False, True], ids=["restart", "kill-9"])
def test_same_adapter_hits_again_after_the_gateway_restarts(start_gateway, caplog, hard):
    from adpkv_lmcache import AdpL2Adapter

    caplog.set_level(logging.INFO, logger="adpkv")
    gw = start_gateway(shared_memory_size=32 << 20, engine_timeout_s=2)
    a = AdpL2Adapter({"port": gw.port, "timeout_s": 1.0, "connect_timeout_s": 1.0, "heartbeat_s": 0.2,
                      "reconnect_s": 0.2})
    try:
        p = fresh_prefix()
        keys = [make_key(i, prefix=p) for i in range(6)]
        objs = [make_obj(16384) for _ in keys]
        assert store(a, keys, objs).is_successful()

        gw.restart(hard=hard)              # a new gateway process on the same card and port
        deadline = time.monotonic() + 20
        hits = []
        while hits != [1] * 6:
            assert time.monotonic() < deadline, f"no hits after the restart: {a.report_status()}"
            hits = bits(lookup(a, keys, timeout=10))   # misses until re-attached, never raises
            if hits != [1] * 6:
                a.submit_unlock(keys)
                time.sleep(0.1)                          # polling with a deadline
        st = a.report_status()
        assert st["attached"] and st["is_healthy"] and st["reconnects"] == 1
        dst = [make_obj(16384, fill=0.0) for _ in keys]
        assert load(a, keys, dst).popcount() == 6
        assert all(same_bytes(x, y) for x, y in zip(objs, dst))
        a.submit_unlock(keys)
        more = [make_key(100 + i, prefix=p) for i in range(2)]
        assert store(a, more, [make_obj(16384) for _ in more]).is_successful()   # stores work too
        msgs = [r.getMessage() for r in caplog.records]
        assert sum(TURNED_OFF_MESSAGE in m for m in msgs) == 1, msgs   # the loss, once
        assert sum(BACK_ON_MESSAGE in m for m in msgs) == 1, msgs      # the return, once
    finally:
        a.close()
