"""The 0.33 suite's tests, run unchanged against vLLM 0.34's classes (and through
tests/vllm033/test_reused_032.py the 0.32 suite's class-level tests it reuses).

What they drive, all real: vLLM's own ``Scheduler`` with AdpKVConnector on both roles
(harness.py: the worker role on real CPU KV tensors, every restore checked byte for byte),
several KV cache groups, asynchronous scheduling, FULL CUDA graph steps, Model Runner V2's
connector driver (``ActiveKVConnector``, vLLM's own class), sleep mode; vLLM's
``OffloadingConnector`` with ``AdpOffloadingSpec`` (both roles) and with
``TieringOffloadingSpec``, its ``TieringOffloadingManager``, a CPU tier in real shared memory
and AdpSecondaryTier; vLLM's Prometheus classes and KV-event tracker; real gateway processes.
Imported here by name: pytest collects them in this module.

What did not run without a GPU: as in tests/vllm033 (CUDA copies, the GPU model runner itself,
vLLM's GPU<->CPU worker of the tiering spec).
"""

from __future__ import annotations

from test_model_runner_v2 import *  # noqa: F401,F403
from test_offloading_spec import *  # noqa: F401,F403
from test_reused_032 import *  # noqa: F401,F403
from test_secondary_tier_033 import *  # noqa: F401,F403
from test_sleep_mode import *  # noqa: F401,F403
