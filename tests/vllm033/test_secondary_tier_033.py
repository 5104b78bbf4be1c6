"""AdpSecondaryTier behind vLLM 0.33's TieringOffloadingManager: what 0.33 added.

What runs, all real: vLLM's ``OffloadingConnector`` (scheduler role) built from the
``--kv-transfer-config`` JSON, so vLLM's factories make the ``TieringOffloadingSpec``, its
``TieringOffloadingManager`` (with 0.33's real lock), the CPU tier in a shared file in
/dev/shm and this tier; vLLM's Prometheus class and KV-event tracker; real gateway processes.

What did not run without a GPU: vLLM's GPU<->CPU worker of the tiering spec
(``CPUOffloadingWorker`` needs CUDA): the tests write and read the CPU tier's rows in its
place (tiering_driver.py).
"""

from __future__ import annotations

import threading
import time

from adpkv_vllm import AdpSecondaryTier
from test_secondary_tier import ROW_BYTES, adp_tier, keys_of, tier_json
from tiering_driver import engine_tiering, load, manager_lock, payload, reset_cache, store


def test_config_info_of_the_tier_reaches_the_info_metric(model_dir, gateway):
    """The tier's labels (declared by ``config_info_keys``, filled by ``config_info``) in the
    series vLLM publishes for it, next to the CPU tier's; vLLM adds the ``tier`` label."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    extra = tier_json(gateway.port)
    conn, m = engine_tiering(model_dir, extra)
    tier = adp_tier(m)
    unregister_vllm_metrics()
    try:
        assert AdpSecondaryTier.config_info_keys(extra["secondary_tiers"][0]) == (
            "adpkv_gateway", "adpkv_namespace", "adpkv_row_bytes")
        stats = conn.get_kv_connector_stats()
        prom = KVConnectorProm(conn._vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(stats.data, 0)
        series = [s.labels for metric in REGISTRY.collect() if metric.name == "vllm:kv_offload_config_info"
                  for s in metric.samples]
        ours = [s for s in series if s.get("adpkv_gateway")]
        assert len(ours) == 1 and len(series) == 2          # the CPU tier's and ours
        assert ours[0]["adpkv_gateway"] == f"127.0.0.1:{gateway.port}"
        assert ours[0]["adpkv_namespace"] == tier.namespace
        assert ours[0]["adpkv_row_bytes"] == str(ROW_BYTES)
        assert ours[0]["tier"] and ours[0]["tier"] != [s for s in series if s is not ours[0]][0]["tier"]
    finally:
        unregister_vllm_metrics()
        conn.shutdown()


def test_the_tier_is_served_from_another_thread_under_the_manager_lock(model_dir, gateway):
    """The tier sets no ``tolerates_off_thread_polling`` (vLLM starts no tier-poll thread
    for it), but another tier's poll round may reach it through the manager: lookups and
    loads made from a second thread, holding the manager lock, while the scheduler's thread
    steps the manager, find every row and read it byte for byte."""
    conn, m = engine_tiering(model_dir, tier_json(gateway.port))
    try:
        assert AdpSecondaryTier.tolerates_off_thread_polling is False
        assert m._tier_poll_thread is None
        keys = keys_of(12, seed=9)
        store(m, keys, "s")
        reset_cache(conn)
        out: dict = {}
        stop = threading.Event()

        def steps():                              # the scheduler's thread: engine steps
            from tiering_driver import STEP
            while not stop.is_set():
                with manager_lock(m):
                    m.on_schedule_end(STEP)
                time.sleep(0.001)

        stepper = threading.Thread(target=steps)
        stepper.start()
        try:
            worker = threading.Thread(target=lambda: out.update(zip(("res", "data"), load(m, keys, "t")[:2])))
            worker.start()
            worker.join(60)
            assert not worker.is_alive()
        finally:
            stop.set()
            stepper.join(10)
        from vllm.v1.kv_offload.base import LookupResult
        assert out["res"] == [LookupResult.HIT] * len(keys)
        assert all((out["data"][k] == payload(k, ROW_BYTES)).all() for k in keys)
    finally:
        conn.shutdown()


def test_an_eviction_is_a_public_removed_event_through_vllms_tracker(model_dir, start_gateway):
    """vLLM 0.33 drops a removed event marked ``metadata_only`` from what it publishes; this
    tier's removed events are evictions the gateway made, so they are never marked so: a row
    evicted by a small card reaches vLLM's event stream as a ``BlockRemoved``."""
    from vllm.distributed.kv_events import BlockRemoved
    gw = start_gateway(capacity_bytes=3 << 20, eviction_watermark=0.9, eviction_ratio=0.3)
    conn, m = engine_tiering(model_dir, tier_json(gw.port, events_sweep_s=0.2))
    tier = adp_tier(m)
    try:
        rows = keys_of(8, seed=4) + keys_of(8, seed=5)
        store(m, rows[:8], "s0")
        store(m, rows[8:], "s1")
        held = tier._session.client.exist([tier.storage_key(k) for k in rows]).result(5)
        assert not all(held), "the gateway evicted nothing"
        removed = []
        deadline = time.monotonic() + 15
        while not removed:
            assert time.monotonic() < deadline, "no removed event reached vLLM's event stream"
            with manager_lock(m):
                from tiering_driver import STEP
                m.on_schedule_end(STEP)
            removed += [e for e in conn.take_events() if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
            time.sleep(0.01)
    finally:
        conn.shutdown()
