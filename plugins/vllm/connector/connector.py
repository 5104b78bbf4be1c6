"""``AdpKVConnector``: vLLM KV connector (V1) that keeps KV chunks on adpkv cards.

A thin facade, as vLLM's own ``OffloadingConnector`` is: vLLM builds one
instance per role and calls the role's methods on it. The scheduler instance
holds an ``AdpConnectorScheduler`` (``scheduler.py``: lookups, load and save
plans), a worker instance an ``AdpConnectorWorker`` (``worker.py``: GETs and
PUTs between the KV blocks and the gateway); ``metadata.py`` is what they agree
on (the resolved ``ConnectorConfig`` and the per-step ``AdpConnectorMetadata``).
Both roles hold the gateway through ``adpkv_core.attachment`` and re-attach
between engine steps, never inside one.

Failures: a chunk that cannot be read is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it; a gateway that stops
answering turns the external cache off on that rank (the client logs
"External KV cache turned off on this rank" once) and the engine goes on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ..common.vllm_api import kv_cache_access_in_process, transfer_results_type
from ..common.settings import check_hash_stability, ensure_logging, warn_once
from .metadata import AdpConnectorMetadata, ChunkPlan, ConnectorConfig
from .scheduler import AdpConnectorScheduler
from .worker import AdpConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AdpKVConnector", "AdpConnectorMetadata", "ChunkPlan"]

logger = logging.getLogger("adpkv.vllm")


class AdpKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by an adpkv gateway (``kv_connector_module_path: adpkv_vllm``).

    Exactly one of ``connector_scheduler`` / ``connector_worker`` is set, by ``role``;
    a method of the other role is never called by vLLM on this instance."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ensure_logging()
        ktc = self._kv_transfer_config
        cfg = ConnectorConfig.resolve(vllm_config, kv_cache_config, dict(ktc.kv_connector_extra_config or {}),
                                      ktc.engine_id)
        self.config = cfg
        if not cfg.supported:
            warn_once(f"adpkv: external KV cache disabled for this model: {cfg.why}")
        self.connector_scheduler: Optional[AdpConnectorScheduler] = None
        self.connector_worker: Optional[AdpConnectorWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            check_hash_stability(vllm_config)
            self.connector_scheduler = AdpConnectorScheduler(cfg, ktc)
        else:
            self.connector_worker = AdpConnectorWorker(cfg, getattr(kv_cache_config, "num_blocks", 0))
        if cfg.supported:
            logger.info("adpkv connector (%s): namespace %r, chunk %d tokens (%d blocks), %d layers in "
                        "KV cache groups [%s]%s", role.name, cfg.namespace, cfg.chunk_size,
                        cfg.blocks_per_chunk, len(cfg.layer_names), "; ".join(g.describe() for g in cfg.groups),
                        f", {cfg.drafter.describe()}" if cfg.drafter is not None else "")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Never: vLLM keeps the CUDA graph mode it picks (FULL_AND_PIECEWISE by default).
        A step vLLM may replay as a FULL graph calls no layer hook, so the scheduler marks
        it (``ConnectorConfig.full_graphs``, ``AdpConnectorMetadata.loads_before_pass``) and
        the worker settles its loads in ``start_load_kv``, before the pass; its saves go out
        from ``wait_for_save``, after the pass, for every layer whose hook did not run (the
        seed's "writes of a step go out as one batched request")."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """``KVCacheAccess.IN_PROCESS`` (vLLM >= 0.34; older releases never ask): the worker
        reaches the KV cache only from its own process, with torch ops on views of the tensors
        vLLM registers (``index_select``/``index_copy_`` on its stream, the ring <-> GPU DMA and
        ``cuMemcpy2DAsync`` between the pinned ring and those views' addresses). It registers
        host memory only (the ring, mapped object files), never the KV cache, and exports no
        handle of it (the NVLink fan-out all-gathers a staging buffer of its own), so any
        allocation works: vLLM's extensible KV cache stays on. vLLM then makes the connector after
        the KV cache's final commit and registers views of the committed blocks
        (``register_kv_caches``); sleep and a weight update release and recommit the pages at
        the same addresses, between ``unregister_kv_caches`` and ``restore_kv_caches``."""
        return kv_cache_access_in_process()

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """False (vLLM >= 0.34 asks; its default, stated): vLLM keeps lookahead block hashing
        (EAGLE block drop: each block hash also covers tokens past its block) off with this
        connector. Not yet verified with it: an EAGLE/MTP drafter's objects are named by the hash
        block that holds the next chunk's first token (``drafter.py``), a rule written for hashes
        that end at their block, and a hit is counted in whole hash blocks of the prompt."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss, never lost output."""
        return False

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    def _scheduler(self) -> AdpConnectorScheduler:
        # vLLM calls the scheduler's methods only on the SCHEDULER-role instance, which has one
        assert self.connector_scheduler is not None
        return self.connector_scheduler

    def _worker(self) -> AdpConnectorWorker:
        # vLLM calls these worker methods only on a WORKER-role instance, which has one
        assert self.connector_worker is not None
        return self.connector_worker

    # ========================================================================== scheduler
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: "Request") -> bool:
        """vLLM >= 0.34 (``--max-num-inflight-kv-loads``): see ``AdpConnectorScheduler.may_load_async``."""
        return self._scheduler().may_load_async(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict]]:
        return self._scheduler().request_finished(request)

    # ========================================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM >= 0.33): before the KV cache's memory is released."""
        if self.connector_worker is not None:
            self.connector_worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """Sleep mode (vLLM >= 0.33): after the wake-up, the KV cache's memory back."""
        if self.connector_worker is not None:
            self.connector_worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker.bind()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker().start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker().save_kv_layer(self._connector_metadata, layer_name)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self.connector_worker is None:
            return None, None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Also the asynchronous loads of a model with several KV cache groups: a request
        whose load failed is in ``failed_recving`` (vLLM recomputes it whole). A vLLM without
        it (0.26 to 0.29) never calls it, and the connector serves no such model there
        (``vllm_api.reports_failed_requests``)."""
        if self.connector_worker is None:
            return super().get_transfer_results(finished_req_ids)
        sending, recving, failed = self.connector_worker.transfer_results(finished_req_ids)
        results = transfer_results_type()
        assert results is not None, "only a vLLM that has KVConnectorTransferResults calls this"
        return results(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()
