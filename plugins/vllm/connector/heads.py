"""Objects that read the same at every tensor-parallel size (issue 27).

The **canonical object** of a chunk of one attention layer is the object a TP=1 engine stores:
the pages of its blocks back to back, each page vLLM's standardized per-layer view of one block
(``[H, N, C]``: all H KV heads, the block's tokens, K and V; ``[k, H, N/k, C]`` with kernel
block splitting) in that logical order. A rank ``r`` of a TP=T engine holds heads
``[r·H/T, (r+1)·H/T)`` of every page, so its share of a canonical object is, per block,
``prod(page dims before the heads)`` rows of ``H/T · prod(dims after)`` elements, one every
``H · prod(dims after)`` elements: ``HeadShare.view`` is that share as a strided view of a ring
slot. A collective GET reads each object once into the ring for the whole engine and every
rank copies exactly its rows; a collective PUT has every rank write its rows of the same slot,
and the gateway stores the object once all wrote. At TP=1 the share is the whole object, the
copy is the plain one of ``copy.PagedLayer`` (as before issue 27).

What is TP-portable (``tp_portable_why`` returns "" for it) is decided from the configuration
alone, the same in the scheduler and in every worker (the namespace depends on it): attention
groups (full, sliding) whose every layer holds ``H/T`` of the model's ``H`` KV heads (no KV
head replication, ``T`` divides ``H``), no padded pages, no per-token-head quantization, no
decode or prefill context parallelism; MLA groups (latent pages every rank holds: one object
for all ranks, written by rank 0). Recurrent state (Mamba-type layers: conv and SSM state
sharded over the ranks in model-specific ways) and an EAGLE/MTP drafter in an attention group
stay per TP size. A worker whose KV tensors turn out not to have the standardized view turns
the cache off on that rank (``HeadShare.of`` returns None): never a wrong hit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def tp_portable_why(vllm_config, kv_cache_config, groups: Sequence, drafter) -> str:
    """Why this model's objects depend on the tensor-parallel size ("" when they do not)."""
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    if getattr(pc, "decode_context_parallel_size", 1) != 1 or getattr(pc, "prefill_context_parallel_size", 1) != 1:
        return "context parallelism shards tokens over the ranks"
    if any(g.recurrent for g in groups):
        return "recurrent state (Mamba-type layers) is stored per TP rank"
    if all(g.tp_shared for g in groups):
        return ""        # MLA: one latent page for every rank
    if drafter is not None:
        return "an EAGLE/MTP drafter's layers in an attention group are stored per TP rank"
    try:
        total = vllm_config.model_config.get_total_num_kv_heads()
    except Exception:
        return "the model's KV head count is unknown"
    if not total or total % tp:
        return f"{tp} ranks do not split the model's {total} KV heads evenly (replicated heads)"
    for g in groups:
        for name, spec in layer_specs(kv_cache_config.kv_cache_groups[g.index].kv_cache_spec, g.layer_names):
            if getattr(spec, "num_kv_heads", None) != total // tp:
                return f"layer {name} holds {getattr(spec, 'num_kv_heads', None)} KV heads, not {total}/{tp}"
            if getattr(spec, "page_size_padded", None):
                return f"layer {name} has padded pages"
            quant = getattr(spec, "kv_quant_mode", None)
            if quant is not None and getattr(quant, "is_per_token_head", False):
                return f"layer {name} has per-token-head KV scales"
    return ""


def layer_specs(group_spec, layer_names: Sequence[str]):
    """(layer, its spec) of a KV cache group (vLLM's UniformTypeKVCacheSpecs: one per layer)."""
    per_layer = getattr(group_spec, "kv_cache_specs", None)
    for name in layer_names:
        yield name, (per_layer[name] if isinstance(per_layer, dict) and name in per_layer else group_spec)


@dataclass(frozen=True)
class HeadShare:
    """This rank's KV heads in a canonical object: ``shards`` ranks, this one ``index``, the
    heads at page dimension ``dim`` (``page_shape``: this rank's page, ``heads`` of them)."""

    dim: int
    shards: int
    index: int
    page_shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, page_shape: Sequence[int], dtype: torch.dtype, local_heads: int, head_size: int,
           tp_size: int, rank: int) -> Optional["HeadShare"]:
        """The share of a layer whose page is vLLM's standardized ``[H, N, C]`` (or
        ``[k, H, N/k, C]``, kernel block splitting) with ``local_heads`` heads of
        ``head_size`` (C = 2 · head_size: K and V); None for any other page."""
        shape = tuple(page_shape)
        if len(shape) not in (3, 4) or shape[-3] != local_heads or shape[-1] != 2 * head_size:
            return None
        return cls(len(shape) - 3, tp_size, rank, shape, dtype)

    @property
    def elem_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of this rank's heads (its heads' part of one index before them)."""
        return math.prod(self.page_shape[self.dim:]) * self.elem_bytes

    def view(self, ring: torch.Tensor, offset: int, stride: int, count: int, nblocks: int) -> torch.Tensor:
        """This rank's heads of ``count`` canonical objects (``nblocks`` pages each) at
        ``offset`` in the ring, one every ``stride`` bytes: a ``(count, nblocks, *page_shape)``
        view of our dtype (no copy)."""
        rows = nblocks * math.prod(self.page_shape[:self.dim])
        pitch = self.row_bytes * self.shards
        raw = ring.as_strided((count, rows, self.row_bytes), (stride, pitch, 1),
                              ring.storage_offset() + offset + self.index * self.row_bytes)
        return raw.view(self.dtype).view(count, nblocks, *self.page_shape)
