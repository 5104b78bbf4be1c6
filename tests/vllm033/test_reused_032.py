"""The 0.32 suite's class-level tests, run unchanged against vLLM 0.33's classes.

They drive vLLM's own ``Scheduler`` with AdpKVConnector on both roles (harness.py: the
worker role on real CPU KV tensors, every restore checked byte for byte), several KV cache
groups (sliding window, MLA with the sparse-attention indexer, Mamba state rules), and
vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec``, its ``TieringOffloadingManager``,
a CPU tier in real shared memory and AdpSecondaryTier (tiering_driver.py), all against real
gateway processes. Imported here by name: pytest collects them in this module.

What did not run without a GPU: the worker roles' CUDA copies (ring <-> GPU DMA, the 2-D
copy, the pinned ring) and vLLM's GPU model runners (V1 and Model Runner V2) that call the
worker role; vLLM's GPU<->CPU offloading worker of the tiering spec (the tests write and
read the CPU tier's rows in its place).
"""

from __future__ import annotations

from test_hybrid_scheduler import (  # noqa: F401
    test_a_group_missing_a_chunk_shortens_the_hit_for_all,
    test_a_hit_whose_load_cannot_be_planned_is_recomputed,
    test_a_lost_object_of_one_group_is_recomputed_in_every_group_and_saved_again,
    test_mamba_state_rules,
    test_mla_with_indexer_group_loads_before_the_request_runs,
    test_sliding_and_full_groups_restore_byte_for_byte,
    test_sparse_attention_indexer_is_restored_before_the_pass,
)
from test_async_scheduling import (  # noqa: F401
    test_a_lost_object_is_recomputed_not_read,
    test_an_idle_step_waits_for_the_load_and_a_computing_step_does_not,
    test_restores_load_before_the_request_runs_and_are_exact,
)
from test_full_graphs import *  # noqa: F401,F403
from test_scheduler import *  # noqa: F401,F403  (every test of it: nothing there is 0.32-only)
from test_secondary_tier import (  # noqa: F401
    test_evictions_are_removed_events_and_a_lost_row_is_recomputed,
    test_gateway_down_then_back,
    test_gateway_evictions_become_removed_events_without_a_lookup,
    test_json_store_load_after_restart_and_namespaces,
    test_rows_go_through_the_ring_where_the_region_cannot_be_registered,
)
from test_shard_reads import *  # noqa: F401,F403
