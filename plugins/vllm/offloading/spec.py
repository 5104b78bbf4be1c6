"""``AdpOffloadingSpec``: adpkv as a backend of vLLM's own ``OffloadingConnector``.

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"AdpOffloadingSpec","spec_module_path":"adpkv_vllm",
        "block_size":256,"adpkv.port":5557,"adpkv.namespace":"llama-3-8b-tp1"}}'

This module is the spec: the factory vLLM calls for the two halves, over the
backend's settings and key scheme (``backend.OffloadBackend``). API: the
offloading framework of vLLM 0.32 (``vllm.v1.kv_offload.base``; 0.26's has the same classes):
``OffloadingSpec(OffloadingConfig)`` with ``get_manager()`` (scheduler:
``manager.AdpOffloadingManager``, lookups and pins) and
``get_worker(CanonicalKVCaches)`` (each worker: ``worker.AdpOffloadingWorker``,
the PUT/GET jobs). Older vLLM (no ``OffloadingWorker``) gets a clear error at
import.

Keys: one object per (offloaded chunk, KV tensor, TP rank):
``backend.keys_for_rank(rank).key(object_digest(offload_key), tensor)``. The offload key
is vLLM's hash of the chunk's last block + KV cache group; the namespace comes
from ``adpkv_core.keys.key_namespace`` over the deployment namespace and the
model identity the spec knows (``backend.model_identity``: model, KV dtype, page
geometry, chunk, TP size, layout), and each TP rank stores its part of a chunk
under its own keys: two models of the same geometry, or two TP layouts, never
read each other's objects.

Both halves hold the gateway through ``adpkv_core.attachment.Attachment`` (the
manager as a lookup-only peer, each worker as its rank) and re-attach by
themselves after a gateway restart, between steps (manager: ``on_schedule_end``)
or between jobs (worker: at each ``submit_*``); a job that started on the old
attachment ends on it.

Placement is by key, never by dialog mark, so ``adpkv.affinity_chunks`` has no
effect here (logged at start when set). A dialog mark is a hash of the first
chunk(s) of the request, and every call must give every chunk of a request the
same mark, or the EXIST/GET would look on another card than the PUT. vLLM 0.32's
offloading scheduler never shows the manager those first chunks reliably: the
``ReqContext`` of ``lookup``/``prepare_store``/``prepare_load`` carries
``req_id``, ``kv_transfer_params`` and ``kv_hints`` but no block hashes (its
``_offload_key_positions`` is never filled by the scheduler); lookups start at
the chunk after vLLM's own prefix-cache hit (``start_chunk_idx``) and
sliding-window lookups scan from the end; ``prepare_store`` gets only the chunks
not stored yet. A chunk already in vLLM's cache or on the card would therefore
give its dialog different marks in different calls: misses on multi-card
gateways.

Limit of vLLM 0.32: ``OffloadingConnector`` asserts that every transfer job
succeeds, so a load that fails after its chunks were found (the gateway crashed
in between; a corrupt object) cannot be recomputed. This backend then reports
the job as failed and vLLM stops the engine rather than serve a wrong KV cache
(logged). Pins make eviction races impossible; use ``AdpKVConnector`` where a
failed load must be recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..common.vllm_api import required_vllm_api

with required_vllm_api(
        "adpkv_vllm.AdpOffloadingSpec",
        needs="vLLM's offloading API with OffloadingManager.lookup/prepare_load/prepare_store and "
              "OffloadingWorker.submit_load/submit_store/get_finished/wait (vllm.v1.kv_offload.base, "
              "vLLM 0.32 shape)",
        instead="Use the KV connector instead: kv_connector=AdpKVConnector, "
                "kv_connector_module_path=adpkv_vllm"):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCaches,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
    )

from ..common.settings import ensure_logging
from .backend import AdpOffloadingInfo, OffloadBackend

if TYPE_CHECKING:
    from .manager import AdpOffloadingManager
    from .worker import AdpOffloadingWorker


class AdpOffloadingSpec(OffloadingSpec):
    """adpkv gateway as the offloading medium (``spec_module_path: adpkv_vllm``).

    One instance per process; ``get_manager``/``get_worker`` build their half once, each
    over the spec's ``backend``."""

    def __init__(self, config):
        super().__init__(config)
        ensure_logging()
        self.backend = OffloadBackend.from_config(config)
        self._manager: Optional[AdpOffloadingManager] = None
        self._worker: Optional[AdpOffloadingWorker] = None

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels the manager fills on ``vllm:kv_offload_config_info`` (vLLM >= 0.33)."""
        return AdpOffloadingInfo.label_names()

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .manager import AdpOffloadingManager
            self._manager = AdpOffloadingManager(self.backend)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import AdpOffloadingWorker
            self._worker = AdpOffloadingWorker(self.backend, kv_caches)
        return self._worker
