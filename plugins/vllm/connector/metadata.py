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

from ..common.settings import AdapterSettings, kv_cache_layout, ordered_layer_names, resolve_namespace
from ..common.vllm_api import reports_failed_requests
from .drafter import DrafterSpec, drafter_of
from .heads import layer_specs, tp_portable_why

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
    group: int = 0                    # the KV cache group (``CacheGroup.index``) of these blocks
    drafter: bool = False             # for the group's EAGLE/MTP drafter layers (drafter.py keys)
    # a recurrent-state group's objects are one block each (the state at a chunk boundary):
    # ``digests[i]`` names the chunk that ends at the boundary, ``block_ids[i]`` its state block


@dataclass
class AdpConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for the workers.

    ``loads`` are read before the forward pass (``start_load_kv``, one GET per layer);
    ``saves`` are written per layer from ``save_kv_layer`` (prefill); ``deferred_saves``
    in one request per step from ``wait_for_save`` (chunks filled while decoding);
    ``preempted`` requests' blocks are reused after this step, so their pages must be
    in the ring before (``handle_preemptions``); ``failed_loads`` are hits the scheduler
    could not plan a load for (reported as failed loads: vLLM recomputes them). ``step``
    numbers the collective requests of a step (every TP rank sends the same tag).
    ``state_saves`` are recurrent states at chunk boundaries (vLLM's exact boundary-state
    hand-offs, ``recurrent.py``), written from ``wait_for_save`` and in the ring before
    the step ends (vLLM may free or reuse their blocks from the next step on)."""

    step: int = 0
    loads: list[ChunkPlan] = field(default_factory=list)
    saves: list[ChunkPlan] = field(default_factory=list)           # per layer from save_kv_layer
    deferred_saves: list[ChunkPlan] = field(default_factory=list)  # one request per step (decode)
    state_saves: list[ChunkPlan] = field(default_factory=list)     # recurrent states, end of step
    preempted: list[str] = field(default_factory=list)
    failed_loads: dict[str, list[int]] = field(default_factory=dict)   # req -> its hit's blocks
    # every load of the step settled in start_load_kv, before the pass: vLLM may replay the
    # step as a FULL CUDA graph, which calls no layer hook (``ConnectorConfig.full_graphs``)
    loads_before_pass: bool = False
    # the step computes no token (every request waits, e.g. for its asynchronous load): the
    # worker's ``get_finished`` may wait a moment for a load to end (``worker.IDLE_WAIT_S``)
    idle: bool = False


# =============================================================================== configuration
@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups as the connector stores it: layers that share one
    block table. Its objects' keys carry ``index`` as the key's kind, so two groups
    never share a key even where a layer number could repeat."""

    index: int                        # vLLM's KV cache group id (position in kv_cache_groups)
    kind: str                         # "full" | "sliding" | "mla" | "state" (Mamba-type, align mode)
    layer_names: tuple[str, ...]      # in key order
    sliding_window: Optional[int] = None   # tokens whose blocks vLLM keeps ("sliding" only)
    # caches read before any layer hook runs (DeepSeek sparse attention's indexer keys,
    # MLAAttentionSpec with cache_role "indexer"): loaded completely before the pass
    before_pass: tuple[str, ...] = ()

    @property
    def recurrent(self) -> bool:
        """A recurrent state (``MambaSpec`` in vLLM's ``align`` mode): one state per block
        boundary, not pages of tokens. An object is the state at the end of a chunk (one
        block of the group); a hit of h chunks needs the state at exactly boundary h."""
        return self.kind == "state"

    @property
    def tp_shared(self) -> bool:
        """MLA: every TP rank holds the same latent pages, so an object is one page per
        block for all ranks (no rank slice), written by rank 0 and read by every rank."""
        return self.kind == "mla"

    def describe(self) -> str:
        w = f" {self.sliding_window}" if self.sliding_window else ""
        return f"{self.kind}{w} x{len(self.layer_names)}"


@dataclass
class ConnectorConfig:
    """The connector's resolved configuration, the same in the scheduler and every worker."""

    settings: AdapterSettings
    reconnect_s: float
    block_size: int                   # tokens per KV block (every group's)
    hash_block_size: int              # tokens per vLLM block hash
    chunk_size: int                   # tokens per stored object
    engine_id: str                    # the gateway engine id every role of this engine attaches under
    tp_size: int
    layer_names: list[str]            # layers of every group, in key order (layer i -> key layer i)
    layout: str                       # device and KV cache layout (part of the identity)
    namespace: str
    keys: KeyBuilder
    supported: bool                   # False: no hits, no saves (why says why, logged once)
    why: str = ""
    groups: list[CacheGroup] = field(default_factory=list)
    drafter: Optional[DrafterSpec] = None   # an EAGLE/MTP drafter's layers (drafter.py)
    # why the objects depend on the TP size ("": they do not, heads.py: a TP=1 engine's objects,
    # read and written at any TP size that splits the KV heads, each rank its heads)
    tp_dependent: str = ""
    # attention layers (not MLA): (this rank's KV heads, head size), as vLLM's spec says
    layer_heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    # which steps vLLM may run as a FULL CUDA graph (no layer hook called in them): "none",
    # "uniform_decode" (FULL_AND_PIECEWISE, FULL_DECODE_ONLY: a batch whose every request
    # computes one token, plus its speculative ones), "all" (FULL)
    full_graphs: str = "none"
    # vLLM schedules a step before the last one's output is back (``async_scheduling``, on by
    # default on GPUs): see ``loads_async``
    async_scheduling: bool = False

    @property
    def head_sharded(self) -> bool:
        """Attention objects are canonical (every KV head) and this engine has several ranks:
        each rank copies its heads' rows of every object (``heads.HeadShare``)."""
        return not self.tp_dependent and self.tp_size > 1

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def hashes_per_chunk(self) -> int:
        return self.chunk_size // self.hash_block_size

    def object_blocks(self, group: CacheGroup) -> int:
        """Blocks in one object of ``group``: a chunk's, or one (a recurrent state)."""
        return 1 if group.recurrent else self.blocks_per_chunk

    @property
    def layer_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.layer_names)}

    @property
    def loads_async(self) -> bool:
        """Several KV cache groups: a load runs before the request is scheduled (vLLM's
        asynchronous load, ``WAITING_FOR_REMOTE_KVS``), not layer by layer inside the pass.
        vLLM 0.32 cannot take a block-level load failure of such a model (its block ids are
        not unique over groups: it raises), so a failed load must be reported per request
        (``failed_recving``), which only an asynchronous load can do; the request is then
        recomputed whole. A recurrent state is read before the pass (the model reads it at
        its first token), so a model with one loads asynchronously too (pure Mamba2).

        Under vLLM's asynchronous scheduling every load is asynchronous: vLLM cannot roll back
        a request whose load inside the pass failed once its next step is scheduled already
        (vllm#34484; on an H200 with vLLM 0.26 a failed in-pass restore gave wrong tokens, and a
        timed-out one a device-side assert). A request that waits for its KV, unscheduled, is
        recomputed from its first failed block."""
        return loads_async(self.groups) or self.async_scheduling

    @property
    def group_of_layer(self) -> dict[str, CacheGroup]:
        return {n: g for g in self.groups for n in g.layer_names}

    @classmethod
    def resolve(cls, vllm_config, kv_cache_config, extra: dict[str, Any], engine_id: str) -> "ConnectorConfig":
        block_size = vllm_config.cache_config.block_size
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
        groups, why = cache_groups(vllm_config, kv_cache_config)
        drafter = None
        if not why:
            drafter, why = drafter_of(vllm_config, groups)
        supported = not why
        if supported:
            block_size = _group_block_size(kv_cache_config)
            # recurrent state: vLLM keeps it only at the prompt's last block boundary, so an
            # object is one block and every such boundary is a chunk boundary
            settings = AdapterSettings.from_extra_config(
                extra, block_size, hash_block_size=hash_block_size,
                one_block_chunks=any(g.recurrent for g in groups))
        else:    # nothing is stored: the chunk size does not matter (and is not rounded)
            settings = AdapterSettings.from_extra_config(extra, 1)
        cache_layout = kv_cache_layout(getattr(vllm_config.cache_config, "kv_cache_layout", None))
        layout = f"{vllm_config.device_config.device_type}:{cache_layout}"
        if len(groups) > 1 or (groups and groups[0].kind in ("mla", "state")):
            # the group structure is part of what an object means
            layout += ":" + ",".join(g.describe() for g in groups)
        if drafter is not None:     # what the drafter layers' objects mean
            layout += ":" + drafter.identity
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tp_dependent = tp_portable_why(vllm_config, kv_cache_config, groups, drafter) if supported else ""
        # the TP size whose layout the objects have: 1 for canonical objects, at every TP size
        namespace = resolve_namespace(vllm_config, settings, layout, engine_id,
                                      layout_tp_size=tp_size if tp_dependent else 1,
                                      page_tokens=block_size if pages_name_block_size(
                                          groups, block_size, hash_block_size) else None)
        layer_names = ordered_layer_names([n for g in groups for n in g.layer_names])
        layer_heads = {n: (spec.num_kv_heads, spec.head_size) for g in groups if g.kind in ("full", "sliding")
                       for n, spec in layer_specs(kv_cache_config.kv_cache_groups[g.index].kv_cache_spec,
                                                  g.layer_names)}
        return cls(settings=settings, reconnect_s=reconnect_setting(extra), block_size=block_size,
                   hash_block_size=hash_block_size, chunk_size=settings.chunk_size,
                   engine_id=f"vllm-{engine_id}",
                   tp_size=tp_size,
                   layer_names=layer_names if supported else [],
                   layout=layout, namespace=namespace, keys=KeyBuilder(namespace),
                   supported=supported, why=why, groups=groups if supported else [],
                   drafter=drafter if supported else None, tp_dependent=tp_dependent,
                   layer_heads=layer_heads if supported else {}, full_graphs=full_graph_steps(vllm_config),
                   async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))


def pages_name_block_size(groups: list[CacheGroup], block_size: int, hash_block_size: int) -> bool:
    """Whether the objects' keys leave out a block size their bytes depend on.

    A key is vLLM's hash of a chunk's last hash block: two engines whose hash blocks are equal
    name a chunk alike whatever their block size. An object is the chunk's pages back to back,
    and an attention page is ``[heads, block tokens, ...]`` (heads outermost, vLLM >= 0.32's
    standardized view; an indexer cache keeps per-block scales after its tokens), so the same
    chunk at another block size is other bytes. Where blocks and hash blocks have one size (vLLM
    0.26 to 0.33's default: 16 and 16; 0.34's: 64 and 64) the key implies the block size and
    nothing changes; where blocks are larger (``prefix_match_unit``, a hybrid model's gcd) the
    namespace says the block size, so a 0.34 engine with 64-token blocks hashed by 16 never
    reads a 16-token-block engine's objects as its own (a miss, never wrong bytes). Latent
    MLA pages (``[block tokens, latent]``, token-major) and recurrent states (one per chunk) read
    the same at any block size: their namespace is unchanged."""
    if block_size == hash_block_size:
        return False
    return any(g.kind in ("full", "sliding") or g.before_pass for g in groups)


def full_graph_steps(vllm_config) -> str:
    """``ConnectorConfig.full_graphs`` from vLLM's final CUDA graph mode (``CUDAGraphMode``:
    its ``mixed_mode()`` is what a batch with a prefill runs, ``decode_mode()`` what a
    uniform decode batch runs)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None or not hasattr(mode, "mixed_mode"):
        return "none"
    if mode.mixed_mode().name == "FULL":
        return "all"
    return "uniform_decode" if mode.decode_mode().name == "FULL" else "none"


# the spec classes the connector restores, by exact class (a subclass such as R-SWA or
# chunked local attention frees other blocks than its base class)
_GROUP_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "MLAAttentionSpec": "mla",
                "MambaSpec": "state"}


def _reference_cpu_mla(vllm_config) -> bool:
    """Whether vLLM-CPU runs this MLA model on its reference CPU_MLA backend (vLLM 0.32
    ``platforms/cpu.py``: an MLA model on a CPU without AMX tiles, e.g. AMD EPYC, or with
    the CPU_MLA backend asked for). vLLM forces its own prefix caching and chunked prefill
    off there, and rightly: a prefill over a cached prefix on it gives other tokens than a
    full prefill, with the prefix restored by the connector (P2 of ``test_drafter``, fp32: 384
    restored tokens, then 816 computed) as with vLLM's own prefix cache forced back on (P2
    after its 496-token hit), so the connector stays off too. On AMX_MLA (x86 with AMX) vLLM keeps prefix caching, and so does the connector."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu() or not getattr(vllm_config.model_config, "use_mla", False):
        return False
    import torch
    from vllm.platforms.interface import CpuArchEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    amx = (current_platform.get_cpu_architecture() == CpuArchEnum.X86
           and torch.cpu._is_amx_tile_supported())
    return not amx or vllm_config.attention_config.backend == AttentionBackendEnum.CPU_MLA


def cache_groups(vllm_config, kv_cache_config) -> tuple[list[CacheGroup], str]:
    """The KV cache groups the connector stores, or why it cannot serve this model
    (non-empty: the external cache stays off for the engine, no hit, no save)."""
    if kv_cache_config is None:
        return [], "no KV cache config"
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        return [], "pipeline parallelism > 1 is not supported"
    if _reference_cpu_mla(vllm_config):
        return [], ("vLLM-CPU's reference MLA backend (CPU_MLA: no AMX tiles on this CPU, or that "
                    "backend asked for) computes a prefill over a cached prefix unlike a full "
                    "prefill; vLLM turns its own prefix caching off for it")
    groups: list[CacheGroup] = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue      # an accelerator-side replica vLLM rebuilds from its source group
        specs = list(_layer_specs(g.kv_cache_spec))
        names = {type(sp).__name__ for sp in specs}
        if len(names) != 1:
            return [], f"KV cache group {gid} mixes {sorted(names)}"
        name = names.pop()
        if name == "MambaSpec":
            mode = getattr(specs[0], "mamba_cache_mode", "none")
            if mode != "align":
                return [], (f"recurrent state (MambaSpec) in KV cache group {gid} with "
                            f"mamba_cache_mode={mode!r}: vLLM keeps no state at block boundaries "
                            "(turn prefix caching on for block-aligned states), so there is nothing "
                            "to store or restore")
            if any(getattr(sp, "num_speculative_blocks", 0) for sp in specs):
                return [], (f"recurrent state (MambaSpec) in KV cache group {gid} with speculative "
                            "blocks: not restored")
        kind = _GROUP_KINDS.get(name)
        if kind is None:
            return [], (f"KV cache spec {name} (group {gid}) is not supported (full attention, "
                        "sliding window, MLA or Mamba-type state in align mode)")
        # a sliding group keeps its blocks from ``window + extra_retained_tokens`` back (vLLM
        # retains, unattended, the extra ones for multi-module spec decoding): all are restored
        window: Optional[int] = None
        if kind == "sliding":
            windows = {sp.sliding_window + getattr(sp, "extra_retained_tokens", 0) for sp in specs}
            if len(windows) != 1:
                return [], f"KV cache group {gid} mixes sliding windows {sorted(windows)}"
            window = windows.pop()
        per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        roles = {n: getattr(per_layer[n] if isinstance(per_layer, dict) else g.kv_cache_spec,
                            "cache_role", None) for n in g.layer_names}
        groups.append(CacheGroup(index=gid, kind=kind,
                                 layer_names=tuple(ordered_layer_names(g.layer_names)),
                                 sliding_window=window,
                                 before_pass=tuple(n for n in g.layer_names
                                                   if getattr(roles[n], "value", roles[n]) == "indexer")))
    if not groups:
        return [], "no KV cache group to store"
    sizes = {kv_cache_config.kv_cache_groups[g.index].kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        return [], f"KV cache groups with different block sizes {sorted(sizes)}"
    if len({g.tp_shared for g in groups}) != 1:
        return [], "MLA and non-MLA KV cache groups in one model"
    if loads_async(groups) and not reports_failed_requests():
        return [], ("several KV cache groups or a recurrent state, whose restores load asynchronously: "
                    "this vLLM cannot take a failed load of such a model (it has no get_transfer_results "
                    "to fail a request, and its scheduler raises on failed blocks of several groups; "
                    "vLLM 0.26 to 0.29), so nothing is restored; vLLM 0.30 and later restore it")
    return groups, ""


def loads_async(groups: list[CacheGroup]) -> bool:
    """Whether a model of these groups restores asynchronously (``ConnectorConfig.loads_async``)."""
    return len(groups) > 1 or any(g.recurrent for g in groups)


def _layer_specs(spec):
    inner = getattr(spec, "kv_cache_specs", None)    # UniformTypeKVCacheSpecs: one spec per layer
    return inner.values() if isinstance(inner, dict) else (spec,)


def _group_block_size(kv_cache_config) -> int:
    transfer = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    return transfer[0].kv_cache_spec.block_size
