"""What the two roles of ``AdpKVConnector`` agree on: the configuration both are
built from (``ConnectorConfig``) and the metadata the scheduler role hands the
worker role every step (``AdpConnectorMetadata`` of ``ChunkPlan``s).

Contract: the scheduler role builds one ``AdpConnectorMetadata`` per engine step
(``build_connector_meta``); vLLM ships it to every worker, which binds it for
that step only. Both roles derive the same ``ConnectorConfig`` from the same
``VllmConfig``/``KVCacheConfig`` (``ConnectorConfig.resolve``), so they agree
on chunk size, layers, namespace and keys without talking to each other.
Nothing here touches the gateway or a KV tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from adpkv_core.attachment import reconnect_setting
from adpkv_core.keys import KeyBuilder

from .common import AdapterSettings, kv_cache_layout, ordered_layer_names, resolve_namespace

logger = logging.getLogger("adpkv.vllm")


# =============================================================================== per step
@dataclass
class ChunkPlan:
    """Chunks of one request to load or save: digests, marks and their blocks."""

    req_id: str
    digests: list[bytes]              # 16-byte chunk digests, one per chunk
    marks: list[int]                  # dialog mark per chunk
    block_ids: list[int]              # blocks_per_chunk ids per chunk (loads: only those written)
    positions: Optional[list[int]] = None   # loads: block positions in the objects (None = all)


@dataclass
class AdpConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for the workers.

    ``loads`` are read before the forward pass (``start_load_kv``, one GET per layer);
    ``saves`` are written per layer from ``save_kv_layer`` (prefill); ``deferred_saves``
    in one request per step from ``wait_for_save`` (chunks filled while decoding);
    ``preempted`` requests' blocks are reused after this step, so their pages must be
    in the ring before (``handle_preemptions``). ``step`` numbers the collective
    requests of a step (every TP rank sends the same tag)."""

    step: int = 0
    loads: list[ChunkPlan] = field(default_factory=list)
    saves: list[ChunkPlan] = field(default_factory=list)           # per layer from save_kv_layer
    deferred_saves: list[ChunkPlan] = field(default_factory=list)  # one request per step (decode)
    preempted: list[str] = field(default_factory=list)


# =============================================================================== configuration
@dataclass
class ConnectorConfig:
    """The connector's resolved configuration, the same in the scheduler and every worker."""

    settings: AdapterSettings
    reconnect_s: float
    block_size: int                   # tokens per KV block
    hash_block_size: int              # tokens per vLLM block hash
    chunk_size: int                   # tokens per stored object
    engine_id: str                    # the gateway engine id every role of this engine attaches under
    tp_size: int
    layer_names: list[str]            # attention layers, in key order (layer i -> key layer i)
    layout: str                       # device and KV cache layout (part of the identity)
    namespace: str
    keys: KeyBuilder
    supported: bool                   # False: no hits, no saves (why says why, logged once)
    why: str = ""
    sliding_window: Optional[int] = None   # tokens, for a sliding-window model; None: full attention

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def hashes_per_chunk(self) -> int:
        return self.chunk_size // self.hash_block_size

    @property
    def layer_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.layer_names)}

    @classmethod
    def resolve(cls, vllm_config, kv_cache_config, extra: dict[str, Any], engine_id: str) -> "ConnectorConfig":
        block_size = vllm_config.cache_config.block_size
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
        settings = AdapterSettings.from_extra_config(extra, block_size)
        chunk = settings.chunk_size
        if chunk % hash_block_size:
            raise ValueError(f"adpkv: chunk_size {chunk} must be a multiple of the hash "
                             f"block size {hash_block_size}")
        supported, why = _supported(vllm_config, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        window = None
        if supported and type(groups[0].kv_cache_spec).__name__ == "SlidingWindowSpec":
            window = int(groups[0].kv_cache_spec.sliding_window)
        cache_layout = kv_cache_layout(getattr(vllm_config.cache_config, "kv_cache_layout", None))
        layout = f"{vllm_config.device_config.device_type}:{cache_layout}"
        namespace = resolve_namespace(vllm_config, settings, layout, engine_id)
        return cls(settings=settings, reconnect_s=reconnect_setting(extra), block_size=block_size,
                   hash_block_size=hash_block_size, chunk_size=chunk, engine_id=f"vllm-{engine_id}",
                   tp_size=vllm_config.parallel_config.tensor_parallel_size,
                   layer_names=ordered_layer_names(groups[0].layer_names) if groups else [],
                   layout=layout, namespace=namespace, keys=KeyBuilder(namespace),
                   supported=supported, why=why, sliding_window=window)


def _supported(vllm_config, kv_cache_config) -> tuple[bool, str]:
    if kv_cache_config is None:
        return False, "no KV cache config"
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return False, (f"{len(groups)} KV cache groups: the connector restores models whose "
                       "attention layers share one KV cache group")
    spec_name = type(groups[0].kv_cache_spec).__name__
    if spec_name not in ("FullAttentionSpec", "SlidingWindowSpec"):
        # (subclasses such as R-SWA or chunked local attention free other blocks)
        return False, (f"KV cache spec {spec_name} is not supported (full attention or "
                       "sliding window only)")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        return False, "pipeline parallelism > 1 is not supported"
    return True, ""
