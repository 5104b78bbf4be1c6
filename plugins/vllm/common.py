"""What the vLLM KV connector and the OffloadingSpec backend share: settings,
namespace, layer numbering, chunk hashes, logging.

Nothing here touches a KV tensor (see ``copy.py``) or the gateway (both hold it
through ``adpkv_core.attachment``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from adpkv_core.keys import chunk_digest, key_namespace
from adpkv_core.settings import ClientConfig, parse_bool

logger = logging.getLogger("adpkv.vllm")

PREFIX = "adpkv."


def ensure_logging() -> None:
    """Make adpkv's log lines (``adpkv.*`` loggers: this adapter and the client SDK)
    visible inside vLLM, which configures only its own ``vllm`` loggers. Nothing is
    added when the application has configured logging itself."""
    root_adpkv = logging.getLogger("adpkv")
    if root_adpkv.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s pid=%(process)d] %(message)s",
                                           "%m-%d %H:%M:%S"))
    root_adpkv.addHandler(handler)
    if root_adpkv.level == logging.NOTSET:
        root_adpkv.setLevel(os.environ.get("ADPKV_LOG_LEVEL", "INFO").upper())
DEFAULT_CHUNK_TOKENS = 256


@dataclass
class AdapterSettings:
    """``adpkv.*`` keys of kv_connector_extra_config, resolved."""

    client: ClientConfig
    chunk_size: int                 # tokens per stored object (a multiple of the block size)
    exist_layers: str = "ends"      # "ends": EXIST layer 0 and the last layer; "all": every layer
    lookup_wait_s: float = 0.05     # how long the scheduler waits for an EXIST before asking again
    respect_fail_policy: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, block_size: int,
                          chunk_key: str = "chunk_size") -> "AdapterSettings":
        extra = dict(extra or {})
        client = ClientConfig.from_settings(extra, prefix=PREFIX)
        raw = extra.get(PREFIX + chunk_key, extra.get(chunk_key))
        if raw is None:
            chunk = max(block_size, DEFAULT_CHUNK_TOKENS)
            chunk = -(-chunk // block_size) * block_size
        else:
            chunk = int(raw)
        if chunk <= 0 or chunk % block_size:
            raise ValueError(f"adpkv: {PREFIX}{chunk_key}={chunk} must be a positive multiple of "
                             f"the block size {block_size}")
        exist_layers = str(extra.get(PREFIX + "exist_layers", "ends"))
        if exist_layers not in ("ends", "all"):
            raise ValueError(f"adpkv: {PREFIX}exist_layers must be 'ends' or 'all', not {exist_layers!r}")
        return cls(client=client, chunk_size=chunk, exist_layers=exist_layers,
                   lookup_wait_s=float(extra.get(PREFIX + "lookup_wait_s", 0.05)),
                   respect_fail_policy=parse_bool(extra.get(PREFIX + "respect_fail_policy", False),
                                                  PREFIX + "respect_fail_policy"))


# --------------------------------------------------------------------------- hashing
_warned_hash = False


def check_hash_stability(vllm_config) -> bool:
    """Warn (once per process) when vLLM's block hashes change from one process to the next.

    vLLM seeds its chained block hash with NONE_HASH. For the non-cryptographic
    ``xxhash``/``xxhash_cbor`` algorithms it draws that seed at random per process
    unless PYTHONHASHSEED is set: every key would then be new after a restart and
    the external cache would never hit. Returns True when hashes are stable.
    """
    global _warned_hash
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    stable = not (algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None)
    if not stable and not _warned_hash:
        _warned_hash = True
        logger.warning(
            "adpkv: prefix_caching_hash_algo=%s without PYTHONHASHSEED makes vLLM's block hashes "
            "random per process: nothing this engine stores can be found after a restart or by "
            "another replica. Set PYTHONHASHSEED to the same value for every vLLM process (e.g. "
            "PYTHONHASHSEED=0) or use --prefix-caching-hash-algo sha256.", algo)
    return stable


def chunk_hashes(block_hashes: Sequence[bytes], blocks_per_chunk: int, limit_chunks: int) -> list[bytes]:
    """16-byte digests of the first chunks of a request: chunk i is named by the
    hash of its last block (vLLM's hash is chained, so it covers every token before
    it, plus cache_salt, LoRA and multimodal inputs)."""
    n = min(limit_chunks, len(block_hashes) // blocks_per_chunk)
    return [chunk_digest(bytes(block_hashes[(i + 1) * blocks_per_chunk - 1])) for i in range(n)]


# --------------------------------------------------------------------------- layers
def ordered_layer_names(layer_names: Sequence[str]) -> list[str]:
    """Attention layers in a stable order (by the layer number in the module name)."""
    def key(name: str):
        nums = [int(p) for p in name.split(".") if p.isdigit()]
        return (nums or [1 << 30], name)
    return sorted(layer_names, key=key)


# --------------------------------------------------------------------------- namespace
def resolve_namespace(vllm_config, settings: AdapterSettings, layout: str, engine_id: str) -> str:
    """The key namespace of the KV connector (``adpkv_core.keys.key_namespace``).

    ``adpkv.namespace`` as given; with ``adpkv.key_namespace_from_model`` derived from it
    and the model identity (model, revision, KV dtype, geometry, TP size, chunk size,
    layout). An unknown field gives a namespace private to this engine (a cold cache,
    never a wrong hit); it is the same in the scheduler and the workers because it
    derives from the engine id they share.
    """
    cfg = settings.client
    identity = None
    if cfg.key_namespace_from_model:
        mc = vllm_config.model_config
        hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
        try:
            geometry = [getattr(hf, "num_hidden_layers", None), mc.get_total_num_kv_heads(),
                        mc.get_head_size(), vllm_config.cache_config.block_size]
        except Exception:
            geometry = None
        identity = dict(model=mc.model, revision=mc.revision, kv_dtype=kv_dtype(vllm_config),
                        geometry=geometry if geometry and None not in geometry else None,
                        tp_size=vllm_config.parallel_config.tensor_parallel_size,
                        chunk_size=settings.chunk_size, layout=layout)
    return key_namespace(cfg.namespace, identity, from_model=cfg.key_namespace_from_model,
                         private_to=f"vllm-{engine_id}")


def kv_dtype(vllm_config) -> str:
    cd = vllm_config.cache_config.cache_dtype
    if cd and cd != "auto":
        return str(cd)
    return str(vllm_config.model_config.dtype)


def kv_cache_layout(cache_layout) -> str:
    """The KV cache layout vLLM runs with (``cache_config.kv_cache_layout``, or the
    layout the attention backend picks when that is unset)."""
    if cache_layout:
        return str(getattr(cache_layout, "name", cache_layout))
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
        return str(get_kv_connector_cache_layout())
    except Exception:
        return "default"
