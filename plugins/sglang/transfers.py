"""The data paths of the SGLang backend: one GET or PUT per call, pages or tensors ⇄ ring.

- v1 (zero copy, ``interface_v1``): ``get_pages`` / ``set_pages`` move host-pool pages
  named by SGLang's ``host_indices``; each ring batch is copied between the ring slots
  and the pool's page segments (``pages.PageGeometry``: one ``memmove`` per segment).
- generic: ``get_values`` / ``set_values`` move SGLang's flat data pages (tensors),
  one request per object size.

Both store the same objects (a page in SGLang's flat-data-page format), so each path
reads what the other wrote. Keys, dialog marks, the session and the ``Tally`` come from
the facade (``backend.AdpHiCacheStorage``), which also turns any exception into SGLang's
failure value.

Threads: these functions run on the SGLang thread that called the backend
(``batch_get_v1``: the prefetch I/O thread; ``batch_set_v1``: the backup thread; the
generic path: whichever calls it) and block until the request resolves; the client
resolves every request (at the latest when it turns off after ``timeout_s``), so they
never return while a copy into or out of SGLang's memory could still run. The copy
callbacks (``on_batch``) run on the client's I/O thread and must not block: they copy
one batch and return True.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, List, Optional, Sequence

import torch

from adpkv_core.attachment import Session
from adpkv_core.client import RingBatch, StoreResult
from adpkv_core.grouping import group_by_size

from .housekeeping import Tally
from .pages import (
    PageGeometry,
    copy_pages_to_ring,
    copy_ring_to_pages,
    copy_ring_to_tensor,
    copy_tensor_to_ring,
    tensor_nbytes,
)


def stored_flags(result: StoreResult) -> list:
    """The per-key stored flags of a PUT's result."""
    return list(result.stored)


def _pick(seq: Optional[Sequence], idx: Sequence[int]) -> Optional[list]:
    return None if seq is None else [seq[i] for i in idx]


# ---------------------------------------------------------------------------- v1 (zero copy)
def get_pages(s: Session, geo: PageGeometry, host_indices: torch.Tensor, keys: List[bytes],
              marks: Optional[List[int]], tally: Tally) -> List[bool]:
    """GET ``keys`` into the pool pages at ``host_indices``; hits per key (misses untouched)."""
    n = len(keys)
    ptrs = geo.pointers(geo.page_starts(host_indices, n))
    ring = s.ring

    def copy_out(batch: RingBatch) -> bool:
        copy_ring_to_pages(geo, ring, ptrs, batch)
        return True

    t0 = time.perf_counter()
    tally.count("get_requests")
    hits = s.client.get(keys, geo.page_bytes, copy_out, marks).result()
    got = sum(1 for h in hits if h)
    tally.count("pages_read", got)
    tally.record("prefetch", got, time.perf_counter() - t0, geo.page_bytes)
    return [bool(h) for h in hits]


def set_pages(s: Session, geo: PageGeometry, host_indices: torch.Tensor, keys: List[bytes],
              marks: Optional[List[int]], skip_existing: bool, tally: Tally) -> List[bool]:
    """PUT the pool pages at ``host_indices`` under ``keys``; stored per key. With
    ``skip_existing`` one EXIST first: pages stored already count as stored and are not sent."""
    n = len(keys)
    ptrs = geo.pointers(geo.page_starts(host_indices, n))
    ring = s.ring
    result = [False] * n
    todo = list(range(n))
    if skip_existing:
        # pages stored already (by an earlier backup, another replica) are not copied again
        have = s.client.exist(keys, marks).result()
        todo = [i for i in range(n) if not have[i]]
        for i in range(n):
            result[i] = bool(have[i])
        if not todo:
            return result
        if len(todo) < n:
            ptrs = ptrs[todo]
            keys = _pick(keys, todo)
            marks = _pick(marks, todo)

    def fill(batch: RingBatch) -> bool:
        copy_pages_to_ring(geo, ring, ptrs, batch)
        return True

    t0 = time.perf_counter()
    tally.count("put_requests")
    flags = stored_flags(s.client.put(keys, geo.page_bytes, fill, marks).result())
    stored = sum(1 for f in flags if f)
    tally.count("pages_written", stored)
    tally.record("backup", stored, time.perf_counter() - t0, geo.page_bytes)
    for i, f in zip(todo, flags):
        result[i] = bool(f)
    return result


# ---------------------------------------------------------------------------- generic path
def get_values(s: Session, keys: List[bytes], targets: List[torch.Tensor],
               tally: Tally) -> List[Optional[torch.Tensor]]:
    """GET ``keys`` into the flat ``targets`` (one request per size); the target of a hit, None
    for a miss. No dialog marks: SGLang's generic path passes no prefix keys."""
    n = len(keys)
    results: List[Optional[torch.Tensor]] = [None] * n
    ring = s.ring
    futures: list[tuple[list[int], Future]] = []
    for size, idx in group_by_size(tensor_nbytes(t) for t in targets).items():

        def copy_out(batch: RingBatch, idx=idx) -> bool:
            for j in range(batch.count):
                if batch.hits is None or batch.hits[j]:
                    copy_ring_to_tensor(ring, batch.offset + j * batch.stride, targets[idx[batch.first + j]])
            return True

        tally.count("get_requests")
        futures.append((idx, s.client.get(_pick(keys, idx), size, copy_out)))
    for idx, f in futures:
        for i, hit in zip(idx, f.result()):
            if hit:
                results[i] = targets[i]
                tally.count("pages_read")
    return results


def set_values(s: Session, keys: List[bytes], values: List[torch.Tensor], tally: Tally) -> bool:
    """PUT the flat ``values`` under ``keys`` (one request per size); True when all were stored."""
    ring = s.ring
    futures: list[Future] = []
    for size, idx in group_by_size(tensor_nbytes(v) for v in values).items():

        def fill(batch: RingBatch, idx=idx) -> bool:
            for j in range(batch.count):
                copy_tensor_to_ring(values[idx[batch.first + j]], ring, batch.offset + j * batch.stride)
            return True

        tally.count("put_requests")
        futures.append(s.client.put(_pick(keys, idx), size, fill))
    ok = True
    for f in futures:
        flags = stored_flags(f.result())
        tally.count("pages_written", sum(1 for x in flags if x))
        ok = ok and all(flags)
    return ok
