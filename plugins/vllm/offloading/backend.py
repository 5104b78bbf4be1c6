"""What both halves of ``AdpOffloadingSpec`` know of the backend: its settings and its key
scheme (``OffloadBackend``), and the ``LoadStoreSpec`` the manager hands the worker.

The spec (``spec.py``) builds one ``OffloadBackend`` from vLLM's offloading config and
gives it to the manager (``manager.py``) and to each worker (``worker.py``); neither half
imports the spec.

Keys: one object per (offloaded chunk, KV tensor, TP rank):
``keys_for_rank(rank).key(object_digest(offload_key), tensor)``; see ``spec.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LoadStoreSpec

from adpkv_core.attachment import reconnect_setting
from adpkv_core.keys import KeyBuilder, chunk_digest, key_namespace
from adpkv_core.settings import ClientConfig

from ..common.settings import ConfigInfoLabels
from ..common.vllm_api import offloading_kv_cache_layout

logger = logging.getLogger("adpkv.vllm")


def model_identity(config) -> dict:
    """What the spec knows of the model and of its objects' format, for ``key_namespace``:
    vLLM's offloading config carries no revision, so ``key_namespace_from_model`` (which
    requires one) gives a namespace private to this engine."""
    return dict(model=config.model.name, kv_dtype=config.model.dtype,
                geometry={"groups": [[g.tokens_per_block, len(g.layer_names)] for g in config.groups],
                          "kv_bytes_per_block": config.worker_kv_bytes_per_block},
                chunk_size=config.cache.blocks_per_chunk, tp_size=config.parallel.tp_size,
                layout=offloading_kv_cache_layout(config))


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


@dataclass(frozen=True)
class OffloadBackend:
    """The backend's settings, from vLLM's ``OffloadingConfig`` (its ``kv_connector_extra_config``)."""

    config: Any                 # vLLM's OffloadingConfig
    client_config: ClientConfig
    reconnect_s: float
    engine_id: str
    world: int                  # TP ranks (pipeline parallel size 1)
    namespace: str              # the key namespace (model identity included)
    shard_reads: int            # 0: auto, else parallel GETs per layer of a load
    info: AdpOffloadingInfo

    @classmethod
    def from_config(cls, config) -> "OffloadBackend":
        extra = dict(config.extra_config or {})
        client_config = ClientConfig.from_settings(extra, prefix="adpkv.", also=("shard_reads",),
                                                   where="adpkv.* key of AdpOffloadingSpec's kv_connector_extra_config")
        if not client_config.namespace:
            logger.warning("adpkv: no adpkv.namespace set; required on shared cards (the model and page "
                           "geometry are in the keys, the deployment is not)")
        shard_reads = parse_shard_reads(extra.get("adpkv.shard_reads", "auto"))
        if "adpkv.affinity_chunks" in extra:
            logger.info("adpkv: adpkv.affinity_chunks has no effect with AdpOffloadingSpec: vLLM's "
                        "offloading API does not give the manager a request's first chunks, so "
                        "objects are placed by key (use AdpKVConnector for dialog placement)")
        engine_id = f"vllm-offload-{config.engine_id}"
        world = max(1, int(config.parallel.world_size))
        if int(config.parallel.pp_size) != 1:
            raise ValueError("adpkv: AdpOffloadingSpec supports pipeline parallel size 1")
        namespace = key_namespace(client_config.namespace, model_identity(config),
                                  from_model=client_config.key_namespace_from_model,
                                  private_to=engine_id)
        info = AdpOffloadingInfo(adpkv_gateway=f"{client_config.host}:{client_config.port}",
                                 adpkv_namespace=namespace, adpkv_shard_reads=str(shard_reads or "auto"))
        return cls(config=config, client_config=client_config, reconnect_s=reconnect_setting(extra),
                   engine_id=engine_id, world=world, namespace=namespace, shard_reads=shard_reads,
                   info=info)

    def keys_for_rank(self, rank: int) -> KeyBuilder:
        """The keys of TP rank ``rank``: each rank stores its own part of a chunk."""
        return KeyBuilder(f"{self.namespace}/r{rank}of{self.world}")
