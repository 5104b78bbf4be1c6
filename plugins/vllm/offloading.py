"""``AdpOffloadingSpec``: adpkv as a backend of vLLM's own ``OffloadingConnector``.

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"AdpOffloadingSpec","spec_module_path":"adpkv_vllm",
        "block_size":256,"adpkv.port":5557,"adpkv.namespace":"llama-3-8b-tp1"}}'

This module is the spec: the settings and the key scheme of the backend, and the
factory vLLM calls for the two halves. API: the offloading framework of vLLM
0.32 (``vllm.v1.kv_offload.base``): ``OffloadingSpec(OffloadingConfig)`` with
``get_manager()`` (scheduler: ``offload_manager.AdpOffloadingManager``, lookups
and pins) and ``get_worker(CanonicalKVCaches)`` (each worker:
``offload_worker.AdpOffloadingWorker``, the PUT/GET jobs). Older vLLM (no
``OffloadingWorker``) gets a clear error at import.

Keys: one object per (offloaded chunk, KV tensor, TP rank):
``keys_for_rank(rank).key(object_digest(offload_key), tensor)``. The offload key
is vLLM's hash of the chunk's last block + KV cache group; the namespace comes
from ``adpkv_core.keys.key_namespace`` over the deployment namespace and the
model identity the spec knows (``model_identity``: model, KV dtype, page
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

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .vllm_api import required_vllm_api

with required_vllm_api(
        "adpkv_vllm.AdpOffloadingSpec",
        needs="vLLM's offloading API with OffloadingManager.lookup/prepare_load/prepare_store and "
              "OffloadingWorker.submit_load/submit_store/get_finished/wait (vllm.v1.kv_offload.base, "
              "vLLM 0.32 shape)",
        instead="Use the KV connector instead: kv_connector=AdpKVConnector, "
                "kv_connector_module_path=adpkv_vllm"):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCaches,
        LoadStoreSpec,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
    )

from adpkv_core.attachment import reconnect_setting
from adpkv_core.keys import KeyBuilder, chunk_digest, key_namespace
from adpkv_core.settings import ClientConfig

from .common import ConfigInfoLabels, ensure_logging

if TYPE_CHECKING:
    from .offload_manager import AdpOffloadingManager
    from .offload_worker import AdpOffloadingWorker

logger = logging.getLogger("adpkv.vllm")


def model_identity(config) -> dict:
    """What the spec knows of the model and of its objects' format, for ``key_namespace``:
    vLLM's offloading config carries no revision, so ``key_namespace_from_model`` (which
    requires one) gives a namespace private to this engine."""
    return dict(model=config.model.name, kv_dtype=config.model.dtype,
                geometry={"groups": [[g.tokens_per_block, len(g.layer_names)] for g in config.groups],
                          "kv_bytes_per_block": config.worker_kv_bytes_per_block},
                chunk_size=config.cache.blocks_per_chunk, tp_size=config.parallel.tp_size,
                # unset: the attention backend's default (asked in neither process, so the
                # manager and the workers agree)
                layout=str(config.kv_cache_layout or "backend-default"))


def object_digest(offload_key: bytes) -> bytes:
    """The chunk digest of the objects of one offloaded chunk (its offload key, normalised)."""
    return chunk_digest(bytes(offload_key))


class AdpLoadStoreSpec(LoadStoreSpec):
    """Where chunks live on the gateway: their offload keys (block hash + group)."""

    def __init__(self, keys: list[bytes]):
        self.keys = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"AdpLoadStoreSpec({len(self.keys)} chunks)"


@dataclass(frozen=True)
class AdpOffloadingInfo(ConfigInfoLabels):
    """What ``vllm:kv_offload_config_info`` says of this spec (vLLM >= 0.33)."""

    adpkv_gateway: str          # host:port of the engine's gateway
    adpkv_namespace: str        # the key namespace this engine derived (model identity included)
    adpkv_shard_reads: str      # "auto" or parallel GETs per layer of a load


def parse_shard_reads(value) -> int:
    """``adpkv.shard_reads``: ``auto`` (0) or the number of parallel GETs per layer of a load."""
    if value is None or str(value).strip().lower() == "auto":
        return 0
    n = int(value)
    if n < 1:
        raise ValueError(f"adpkv: adpkv.shard_reads must be 'auto' or >= 1, not {value!r}")
    return n


class AdpOffloadingSpec(OffloadingSpec):
    """adpkv gateway as the offloading medium (``spec_module_path: adpkv_vllm``).

    One instance per process; ``get_manager``/``get_worker`` build their half once."""

    def __init__(self, config):
        super().__init__(config)
        ensure_logging()
        extra = dict(self.extra_config or {})
        self.client_config = ClientConfig.from_settings(extra, prefix="adpkv.")
        self.reconnect_s = reconnect_setting(extra)
        if not self.client_config.namespace:
            logger.warning("adpkv: no adpkv.namespace set; required on shared cards (the model and page "
                           "geometry are in the keys, the deployment is not)")
        self.shard_reads = parse_shard_reads(extra.get("adpkv.shard_reads", "auto"))
        if "adpkv.affinity_chunks" in extra:
            logger.info("adpkv: adpkv.affinity_chunks has no effect with AdpOffloadingSpec: vLLM's "
                        "offloading API does not give the manager a request's first chunks, so "
                        "objects are placed by key (use AdpKVConnector for dialog placement)")
        self.engine_id = f"vllm-offload-{config.engine_id}"
        self.world = max(1, int(config.parallel.world_size))
        if int(config.parallel.pp_size) != 1:
            raise ValueError("adpkv: AdpOffloadingSpec supports pipeline parallel size 1")
        self.namespace = key_namespace(self.client_config.namespace, model_identity(config),
                                       from_model=self.client_config.key_namespace_from_model,
                                       private_to=self.engine_id)
        self.info = AdpOffloadingInfo(adpkv_gateway=f"{self.client_config.host}:{self.client_config.port}",
                                      adpkv_namespace=self.namespace,
                                      adpkv_shard_reads=str(self.shard_reads or "auto"))
        self._manager: Optional["AdpOffloadingManager"] = None
        self._worker: Optional["AdpOffloadingWorker"] = None

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels the manager fills on ``vllm:kv_offload_config_info`` (vLLM >= 0.33)."""
        return AdpOffloadingInfo.label_names()

    def keys_for_rank(self, rank: int) -> KeyBuilder:
        """The keys of TP rank ``rank``: each rank stores its own part of a chunk."""
        return KeyBuilder(f"{self.namespace}/r{rank}of{self.world}")

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .offload_manager import AdpOffloadingManager
            self._manager = AdpOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .offload_worker import AdpOffloadingWorker
            self._worker = AdpOffloadingWorker(self, kv_caches)
        return self._worker
