"""AdpKVConnector re-attaches after a gateway restart without restarting the engine.

vLLM's real Scheduler with our scheduler-side connector (a lookup peer) and our worker
connector on real CPU KV tensors (harness.py): the gateway process is restarted
(GatewayProcess.restart, graceful and kill -9) under a running engine; the requests in
flight then miss and are recomputed, and once the gateway answers again both roles
re-attach between steps and the same engine restores the stored prefix byte for byte.
"""

from __future__ import annotations

import logging
import random
import time
import uuid

import pytest

from adpkv_core.attachment import BACK_ON_MESSAGE, LOOKUPS_BACK_MESSAGE
from harness import Harness

CHUNK = 64


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


EXTRA = {"adpkv.reconnect_s": 0.2, "adpkv.heartbeat_s": 0.2, "adpkv.connect_timeout_s": 1.0}


@pytest.mark.parametrize("hard", [False, True], ids=["restart", "kill-9"])
def test_same_engine_restores_again_after_the_gateway_restarts(start_gateway, model_dir, caplog, hard):
    caplog.set_level(logging.INFO, logger="adpkv")
    gw = start_gateway(engine_timeout_s=1)
    toks = tokens(700, 11)
    ns = f"re-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, gw.port, namespace=ns, chunk_size=CHUNK, extra=EXTRA)
    try:
        first = h.add(toks)
        h.run()                                   # computed and saved by this engine
        assert first.request_id in h.finished_sending
        h.scheduler.reset_prefix_cache()          # vLLM's own cache must not answer

        gw.restart(hard=hard)                     # the engine keeps running
        worker_session = h.worker.connector_worker.session
        deadline = time.monotonic() + 30
        attempts = 0
        while True:
            assert time.monotonic() < deadline, "the engine never restored from the gateway again"
            attempts += 1
            req = h.add(toks)
            so, meta = h.step()
            loaded = sum(len(p.block_ids) for p in meta.loads) * h.block_size
            if req.num_computed_tokens:
                h.check_kv(req, req.num_computed_tokens)   # never a wrong byte, hit or miss
            h.run()
            h.scheduler.reset_prefix_cache()
            if loaded == 640 and not any(h.load_errors[-3:]):
                break
            time.sleep(0.1)                       # polling with a deadline
        assert attempts >= 1
        assert h.worker.connector_worker.session is not worker_session      # the worker re-attached, same connector
        assert h.worker.connector_worker.attachment.reattaches == 1
        assert h.connector.connector_scheduler.lookup.reattaches == 1
        # and once more, after everything settled: a full restore, exact bytes
        req = h.add(toks)
        so, meta = h.step()
        assert sum(len(p.block_ids) for p in meta.loads) * h.block_size == 640
        assert so.num_scheduled_tokens[req.request_id] == 60
        h.check_kv(req, 700)
        h.run()
        msgs = [r.getMessage() for r in caplog.records]
        assert sum(BACK_ON_MESSAGE in m for m in msgs) == 1, msgs
        assert sum(LOOKUPS_BACK_MESSAGE in m for m in msgs) == 1, msgs
    finally:
        h.close()
