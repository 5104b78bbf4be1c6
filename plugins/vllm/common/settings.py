"""What the vLLM KV connector and the OffloadingSpec backend share: settings,
namespace, layer numbering, chunk hashes, logging.

Nothing here touches a KV tensor (see ``copy.py``) or the gateway (both hold it
through ``adpkv_core.attachment``).
"""

from __future__ import annotations

import logging
import math
import os
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

from adpkv_core.keys import DEFAULT_NAMESPACE, chunk_digest, key_namespace
from adpkv_core.settings import ClientConfig, parse_bool, parse_byte_count, parse_number

logger = logging.getLogger("adpkv.vllm")

PREFIX = "adpkv."


def ensure_logging() -> None:
    """Make adpkv's log lines (``adpkv.*`` loggers: this adapter and the client SDK)
    visible inside vLLM, which configures only its own ``vllm`` loggers. Nothing is
    added when the application has configured logging itself."""
    root_adpkv = logging.getLogger("adpkv")
    level = os.environ.get("ADPKV_LOG_LEVEL")
    if level and root_adpkv.level == logging.NOTSET:
        root_adpkv.setLevel(level.upper())     # asked for explicitly: also under the application's handlers
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
    nvlink_fanout: bool = False     # MLA with TP: each rank copies its share, NVLink the rest (connector/fanout.py)
    direct_map_bytes: int = 0       # > 0: restores from mapped object files, this many bytes mapped at most (0: off)
    load_choice: str = "measured"   # "measured": a hit slower to load than to compute is recomputed; "always"

    # this adapter's own ``adpkv.*`` settings besides the shared ones (ClientConfig.setting_names)
    # and the chunk size: every other ``adpkv.`` key is refused (ClientConfig.from_settings)
    OWN: ClassVar[tuple[str, ...]] = ("exist_layers", "lookup_wait_s", "respect_fail_policy",
                                      "nvlink_fanout", "direct_map_bytes", "load_choice")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, block_size: int,
                          chunk_key: str = "chunk_size", hash_block_size: int | None = None,
                          one_block_chunks: bool = False) -> "AdapterSettings":
        """``block_size``/``hash_block_size``: the tokens of a KV block and of one of vLLM's
        block hashes; a chunk is a whole number of both. A chunk size that is not is
        rounded up to the next one that is, with one log line: a setting that cannot
        apply never stops the engine (vLLM picks block sizes per model, e.g. 544 tokens
        for a Gated DeltaNet hybrid, so no fixed chunk size fits every model).

        ``one_block_chunks`` (a model with recurrent state): the chunk is that unit, whatever
        the setting asks (a larger value is logged once and not used). vLLM keeps such a
        model's state only at the prompt's last block boundary (``(N - 1) // block * block``,
        its replay boundary), so a hit needs an object boundary at every block boundary: with
        chunks of k blocks, k - 1 prompts in k would find no state at a chunk boundary."""
        extra = dict(extra or {})
        client = ClientConfig.from_settings(extra, prefix=PREFIX, also=(*cls.OWN, chunk_key),
                                            where="adpkv.* key of kv_connector_extra_config")
        unit = math.lcm(block_size, hash_block_size or block_size)
        raw = extra.get(PREFIX + chunk_key, extra.get(chunk_key))
        chunk = rounded_chunk(raw, unit, PREFIX + chunk_key, unit if one_block_chunks else None)
        if one_block_chunks and chunk != unit:
            warn_once(f"adpkv: {PREFIX}{chunk_key}={raw} is not used for a model with recurrent state: "
                      f"vLLM keeps its state only at the prompt's last block boundary, so an object is "
                      f"one block ({unit} tokens)")
            chunk = unit
        exist_layers = str(extra.get(PREFIX + "exist_layers", "ends"))
        if exist_layers not in ("ends", "all"):
            raise ValueError(f"adpkv: {PREFIX}exist_layers must be 'ends' or 'all', not {exist_layers!r}")
        load_choice = str(extra.get(PREFIX + "load_choice", "measured"))
        if load_choice not in ("measured", "always"):
            raise ValueError(f"adpkv: {PREFIX}load_choice must be 'measured' or 'always', not {load_choice!r}")
        return cls(client=client, chunk_size=chunk, exist_layers=exist_layers, load_choice=load_choice,
                   lookup_wait_s=parse_number(extra.get(PREFIX + "lookup_wait_s", 0.05), PREFIX + "lookup_wait_s", "seconds"),
                   respect_fail_policy=parse_bool(extra.get(PREFIX + "respect_fail_policy", False),
                                                  PREFIX + "respect_fail_policy"),
                   nvlink_fanout=parse_bool(extra.get(PREFIX + "nvlink_fanout", False), PREFIX + "nvlink_fanout"),
                   direct_map_bytes=parse_byte_count(extra.get(PREFIX + "direct_map_bytes", 0), PREFIX + "direct_map_bytes"))


def rounded_chunk(raw: Any, unit: int, name: str, default: int | None = None) -> int:
    """Tokens per stored object: ``raw`` (the setting; None: ``default``, or else
    ``DEFAULT_CHUNK_TOKENS``) rounded up to a positive multiple of ``unit`` (the block and
    hash block sizes). A value that had to change is logged once, with what it became."""
    if raw is None:
        return -(-max(unit, default or DEFAULT_CHUNK_TOKENS) // unit) * unit
    try:
        asked = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"adpkv: {name}={raw!r} is not a number of tokens") from None
    chunk = -(-max(asked, 1) // unit) * unit
    if chunk != asked:
        warn_once(f"adpkv: {name}={asked} is not a positive multiple of this model's block size "
                  f"({unit} tokens); using {chunk}")
    return chunk


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log a warning once per process (the scheduler and worker roles of one engine may
    share a process and resolve the same settings)."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


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


def chunk_hashes(block_hashes: Sequence[bytes], blocks_per_chunk: int, limit_chunks: int,
                 first: int = 0) -> list[bytes]:
    """16-byte digests of the chunks ``first`` .. ``limit_chunks - 1`` of a request: chunk i is
    named by the hash of its last block (vLLM's hash is chained, so it covers every token
    before it, plus cache_salt, LoRA and multimodal inputs)."""
    n = min(limit_chunks, len(block_hashes) // blocks_per_chunk)
    return [chunk_digest(bytes(block_hashes[(i + 1) * blocks_per_chunk - 1])) for i in range(first, n)]


# --------------------------------------------------------------------------- layers
def ordered_layer_names(layer_names: Sequence[str]) -> list[str]:
    """Attention layers in a stable order (by the layer number in the module name)."""
    def key(name: str):
        nums = [int(p) for p in name.split(".") if p.isdigit()]
        return (nums or [1 << 30], name)
    return sorted(layer_names, key=key)


# --------------------------------------------------------------------------- namespace
def resolve_namespace(vllm_config, settings: AdapterSettings, layout: str, engine_id: str,
                      layout_tp_size: int = 1, page_tokens: Optional[int] = None) -> str:
    """The key namespace of the KV connector (``adpkv_core.keys.key_namespace``).

    ``adpkv.namespace`` as given; with ``adpkv.key_namespace_from_model`` derived from it
    and the model identity (model, revision, KV dtype, geometry, TP size, chunk size,
    layout). An unknown field gives a namespace private to this engine (a cold cache,
    never a wrong hit); it is the same in the scheduler and the workers because it
    derives from the engine id they share.

    ``layout_tp_size``: the TP size whose layout the objects have, the identity's TP size: 1
    where they are canonical (a TP=1 engine's objects, read and written at every TP size:
    ``connector/heads.py``), else the engine's. Objects of a per-TP layout of more than one rank are
    also kept apart under a given ``adpkv.namespace`` (suffix ``/tp<size>``): the same
    deployment namespace at another TP size never reads them.

    ``page_tokens``: the block size, where the objects' bytes depend on it and their keys do
    not say it (``ConnectorConfig.resolve``: blocks larger than the block hashes); under a given
    ``adpkv.namespace`` those objects are kept apart too (suffix ``/block<tokens>``). The model
    identity of ``key_namespace_from_model`` has the block size already.
    """
    cfg = settings.client
    identity = None
    if not cfg.key_namespace_from_model and (layout_tp_size > 1 or page_tokens):
        suffix = (f"/tp{layout_tp_size}" if layout_tp_size > 1 else "") + \
            (f"/block{page_tokens}" if page_tokens else "")
        return key_namespace(f"{cfg.namespace or DEFAULT_NAMESPACE}{suffix}")
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
                        tp_size=layout_tp_size, chunk_size=settings.chunk_size, layout=layout)
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


# --------------------------------------------------------------------------- config info
class ConfigInfoLabels:
    """Static facts of one adpkv component for vLLM's ``vllm:kv_offload_config_info`` metric
    (vLLM >= 0.33: ``OffloadingSpec.config_info_keys`` declares the label names,
    ``OffloadingManager.config_info`` / ``SecondaryTierManager.config_info`` fill them once).
    A subclass is a frozen dataclass: each field is one label, named ``adpkv_*`` so that it
    never collides with another tier's; the values are fixed for the process lifetime.
    vLLM 0.32 has no such metric and never calls these."""

    @classmethod
    def label_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))   # type: ignore[arg-type]

    def labels(self) -> dict[str, str | int | float | bool]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}   # type: ignore[arg-type]
