"""Recurrent state (Mamba, Mamba-2, Gated DeltaNet: vLLM's ``MambaSpec`` in ``align`` mode)
as the KV connector stores and restores it.

How vLLM 0.32 keeps it (``MambaManager``, ``mamba_cache_mode="align"``, the default with
prefix caching): a request's Mamba block table holds null blocks except for the block of
its running state; a prefill step is split so that it ends on a block boundary
(``Scheduler._mamba_block_aligned_split``), and the block at index ``k - 1`` then holds the
state after exactly ``k`` blocks of tokens. vLLM caches that block under the block hash of
block ``k - 1`` and hands the connector the exact block (``SchedulerOutput.
kv_connector_block_state.boundary_state_offloads``: request -> ``(group, block id,
boundary tokens)``; the table is not append-only, so the block cannot be found by position).
Its own prefix-cache hit at boundary ``k`` gives the request that block at index ``k - 1``
(null blocks before it); the running state continues from there.

The connector does the same:

- **save**: a handed-off state whose boundary is a chunk boundary ``h * chunk`` is one object
  per Mamba layer, keyed with the digest of chunk ``h - 1`` (the chunk that ends at the
  boundary), the layer and the group; it is copied into the ring from ``wait_for_save``,
  before the step ends (the offer holds committed bytes only until the end of the pass
  that made it);
- **lookup**: a hit of ``h`` chunks needs the state at exactly boundary ``h``
  (``scheduler.hit_chunks``);
- **load**: the state object goes into the block vLLM reserved for the hit boundary (index
  ``h * blocks_per_chunk - 1`` of the group's table, as for its own hit); the load is an
  asynchronous one (``WAITING_FOR_REMOTE_KVS``): the request runs only once every GET
  ended, and one missing object fails the whole request (recomputed from its first token).

An object is a block's state bytes of one layer: the block's slice of every state tensor
(e.g. conv and SSM state), as vLLM lays them out in the layer's page (``state_pages``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from .metadata import ChunkPlan, ConnectorConfig


def state_pages(tensors, num_blocks: int) -> torch.Tensor:
    """One Mamba layer's state tensors (``kv_caches[layer]``: a list of views, block index
    first, over one shared page per block) as a ``(num_blocks, state bytes)`` uint8 view:
    row ``b`` is block ``b``'s state, from the start of its page to the end of the last
    state tensor's part (the page's padding is left out)."""
    ts = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    if not ts or any(not isinstance(t, torch.Tensor) or t.shape[0] != num_blocks for t in ts):
        raise ValueError(f"adpkv: a Mamba layer's state is not {num_blocks} blocks of tensors: "
                         f"{[tuple(getattr(t, 'shape', ())) for t in ts]}")
    page = ts[0].stride(0) * ts[0].element_size()
    base = min(t.data_ptr() for t in ts)
    for t in ts:
        if t.stride(0) * t.element_size() != page or t.untyped_storage().data_ptr() != ts[0].untyped_storage().data_ptr():
            raise ValueError("adpkv: a Mamba layer's state tensors do not share one page per block")
        if not t[0].is_contiguous():
            raise ValueError("adpkv: a Mamba layer's state of one block is not contiguous")
    content = max(t.data_ptr() - base + t[0].numel() * t.element_size() for t in ts)
    if content > page:
        raise ValueError(f"adpkv: a Mamba layer's state ({content} bytes) exceeds its page ({page} bytes)")
    storage = ts[0].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=ts[0].device).set_(storage)
    offset = base - storage.data_ptr()
    if offset + (num_blocks - 1) * page + content > storage.nbytes():
        raise ValueError("adpkv: a Mamba layer's state pages run past their storage")
    return raw.as_strided((num_blocks, content), (page, 1), offset)


def plan_state_saves(cfg: ConnectorConfig, offloads: Mapping[str, Sequence[tuple[int, int, int]]],
                     request_of: Callable[[str], Optional[tuple[object, int]]],
                     digests_of: Callable[[object, int], list[bytes]],
                     marks_of: Callable[[list[bytes]], list[int]]) -> list[ChunkPlan]:
    """The recurrent states of this step to store: vLLM's boundary-state hand-offs
    (``offloads``: request -> ``(group id, block id, boundary tokens)``) at chunk boundaries.

    ``request_of(req_id)``: ``(request, restored chunks)`` of a request the connector
    follows, or None; a state at or below the restored boundary is what was just loaded
    (stored already). ``digests_of(request, n)``: its first ``n`` chunk digests."""
    groups = {g.index for g in cfg.groups if g.recurrent}
    plans: list[ChunkPlan] = []
    if not groups:
        return plans
    for req_id, entries in offloads.items():
        found = request_of(req_id)
        if found is None:
            continue
        request, restored = found
        wanted = [(gid, block, tokens // cfg.chunk_size) for gid, block, tokens in entries
                  if gid in groups and tokens > 0 and tokens % cfg.chunk_size == 0
                  and tokens // cfg.chunk_size > restored]
        if not wanted:
            continue
        digests = digests_of(request, max(h for _, _, h in wanted))
        marks = marks_of(digests)
        for gid, block, h in wanted:
            if h <= len(digests):       # the chunk's block hashes exist (always, in a prompt)
                plans.append(ChunkPlan(req_id, [digests[h - 1]], [marks[h - 1]], [block], group=gid))
    return plans
