"""The data paths of the SGLang backend: one GET or PUT per call, pages or tensors ⇄ ring.

- pool pages (v1 ``interface_v1`` for the KV pool, v2 for the auxiliary pools):
  ``read_pages`` / ``write_pages`` move the host-pool pages starting at ``starts``; each
  ring batch is copied between the ring slots and the pool (``pools.PageIO``: the pool's
  own page segments, one ``memmove`` per segment, or SGLang's flat data pages), and, for a
  hybrid model, each object's stamp (``groups.Stamps``) as its last segment.
- generic: ``get_values`` / ``set_values`` move SGLang's flat data pages (tensors),
  one request per object size.

Both store a page in SGLang's flat-data-page format, so each path reads what the other
wrote (unstamped objects). Keys, dialog marks, the session and the ``Tally`` come from
the facade (``backend.AdpHiCacheStorage``), which also decides which hits it takes and
turns any exception into SGLang's failure value.

Threads: these functions run on the SGLang thread that called the backend
(``batch_get_v1``/``batch_get_v2``: the prefetch I/O thread; ``batch_set_v1``/``batch_set_v2``:
the backup thread; the generic path: whichever calls it) and block until the request
resolves; the client resolves every request (at the latest when it turns off after
``timeout_s``), so they never return while a copy into or out of SGLang's memory could
still run. The copy callbacks (``on_batch``) run on the client's I/O thread and must not
block: they copy one batch and return True.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, TypeVar, overload

import numpy as np
import torch

from adpkv_core.attachment import Session
from adpkv_core.client import RingBatch, StoreResult
from adpkv_core.ringview import RingView
from adpkv_core.grouping import group_by_size

from .groups import Stamps
from .housekeeping import Tally
from .pages import copy_ring_to_tensor, copy_tensor_to_ring, tensor_nbytes
from .pools import HostPool
from .shm import Route, ShmRegions


T = TypeVar("T")


@overload
def _pick(seq: Sequence[T], idx: Sequence[int]) -> list[T]: ...
@overload
def _pick(seq: Optional[Sequence[T]], idx: Sequence[int]) -> Optional[list[T]]: ...
def _pick(seq: Optional[Sequence[T]], idx: Sequence[int]) -> Optional[list[T]]:
    return None if seq is None else [seq[i] for i in idx]


def _ring(s: Session) -> RingView:
    """The session's ring view. The facade passes only enabled sessions (``backend._live``) of a
    rank (every SGLang process attaches with one), and such a session has its ring
    (``Session.enabled``)."""
    ring = s.ring
    assert ring is not None, "an enabled session of a rank without a ring"
    return ring


# ---------------------------------------------------------------------------- pool pages (v1 and v2)
Moved = TypeVar("Moved")


def _in_place_or_ring(s: Session, hp: HostPool, starts: np.ndarray, stamps: Optional[Stamps],
                      regions: Optional[ShmRegions], for_get: bool, in_place: Callable[[Route], Moved],
                      by_ring: Callable[[Any, Any, Any], Moved]) -> tuple[Moved, Any, bool]:
    """One GET or PUT of the pool pages starting at ``starts``: ``in_place(route)`` when the
    pool lies in shared memory the gateway reaches (``regions``: a scattered region request
    over the route's pieces, the same objects as the ring path's), else ``by_ring(ring,
    addresses, segments)`` (the pages' addresses and segments for the ring copies). Returns
    the request's result, what ``hp.io.finish_get`` needs (flat pages; None in place, and
    alive until the request resolved), and whether it went in place."""
    route = regions.route(s, hp, starts, stamps) if regions is not None else None
    if route is not None:
        assert regions is not None
        try:
            if sum(n for _, n in route.pieces) != hp.object_bytes:
                raise ValueError(f"pieces of {sum(n for _, n in route.pieces)} bytes for objects of {hp.object_bytes}")
            return in_place(route), None, True
        finally:
            regions.release(route)
    addrs, held = hp.io.addresses(starts, stamps, for_get=for_get)
    return by_ring(s.ring, addrs, hp.io.segments(stamps is not None)), held, False


def read_pages(s: Session, hp: HostPool, starts: np.ndarray, keys: List[bytes], marks: Optional[List[int]],
               stamps: Optional[Stamps], tally: Tally, kind: str = "prefetch",
               regions: Optional[ShmRegions] = None) -> tuple[List[bool], Any]:
    """GET ``keys`` into the pool pages starting at ``starts`` (and their stamps into
    ``stamps``); the hits, and what ``hp.io.finish_get`` needs (flat pages) once the caller
    decided which hits it takes. Misses are never written. A pool in shared memory is
    written by the gateway in place (``regions``), any other through the ring."""

    def in_place(route: Route) -> list[bool]:
        assert regions is not None
        found = s.client.get_scattered(route.pieces, route.at, keys, marks).result().hits
        if stamps is not None:
            regions.read_stamps(route, stamps)
        return found

    def by_ring(ring, addrs, segments) -> list[bool]:
        return s.client.get(keys, hp.object_bytes, lambda b: ring.drain(b, addrs, segments), marks).result().hits

    t0 = time.perf_counter()
    tally.count("get_requests")
    found, held, placed = _in_place_or_ring(s, hp, starts, stamps, regions, True, in_place, by_ring)
    hits = [bool(h) for h in found]
    got = sum(hits)
    tally.count("pages_read", got)
    if placed:
        tally.count("pages_read_in_place", got)
    tally.record(kind, got, time.perf_counter() - t0, hp.io.page_bytes)
    return hits, held


def write_pages(s: Session, hp: HostPool, starts: np.ndarray, keys: List[bytes], marks: Optional[List[int]],
                stamps: Optional[Stamps], skip_existing: bool, tally: Tally,
                rewrite: Optional[Sequence[bool]] = None,
                regions: Optional[ShmRegions] = None) -> tuple[List[bool], List[bool]]:
    """PUT the pool pages starting at ``starts`` under ``keys``; per key: stored, and stored
    already (the gateway keeps the first object of a key: keys name content). With
    ``skip_existing`` one EXIST first: pages stored already count as stored and are not
    sent. Pages marked in ``rewrite`` must carry this write's stamp: a stored one is deleted
    first and written again."""
    n = len(keys)
    stored, existed = [False] * n, [False] * n
    todo = list(range(n))
    if rewrite is not None and not any(rewrite):
        rewrite = None   # nothing to rewrite
    if skip_existing or rewrite is not None:
        have = list(s.client.exist(keys, marks).result())
        if rewrite is not None:
            stale = [i for i in range(n) if have[i] and rewrite[i]]
            if stale:
                s.client.delete(_pick(keys, stale), _pick(marks, stale)).result()
                tally.count("pages_rewritten", len(stale))
                for i in stale:
                    have[i] = False
        if skip_existing:
            # pages stored already (by an earlier backup, another replica) are not copied again
            todo = [i for i in range(n) if not have[i]]
            for i in range(n):
                stored[i] = existed[i] = bool(have[i])
    if not todo:
        return stored, existed
    if len(todo) < n:
        starts = starts[todo]
        keys = _pick(keys, todo)
        marks = _pick(marks, todo)
        if stamps is not None:
            stamps = stamps.subset(todo)
    t0 = time.perf_counter()
    tally.count("put_requests")
    result, _, placed = _in_place_or_ring(
        s, hp, starts, stamps, regions, False,
        lambda route: s.client.put_scattered(route.pieces, route.at, keys, marks).result(),
        lambda ring, addrs, segments: s.client.put(keys, hp.object_bytes,
                                                   lambda b: ring.fill(b, addrs, segments), marks).result())
    flags, was = result.stored, result.existed
    written = sum(1 for f, e in zip(flags, was) if f and not e)
    tally.count("pages_written", written)
    if placed:
        tally.count("pages_written_in_place", written)
    tally.record("backup", written, time.perf_counter() - t0, hp.io.page_bytes)
    for i, f, e in zip(todo, flags, was):
        stored[i] = bool(f)
        existed[i] = bool(e)
    return stored, existed


# ---------------------------------------------------------------------------- generic path
def get_values(s: Session, keys: List[bytes], targets: List[torch.Tensor],
               tally: Tally) -> List[Optional[torch.Tensor]]:
    """GET ``keys`` into the flat ``targets`` (one request per size); the target of a hit, None
    for a miss. No dialog marks: SGLang's generic path passes no prefix keys."""
    n = len(keys)
    results: List[Optional[torch.Tensor]] = [None] * n
    ring = _ring(s)
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
        for i, hit in zip(idx, f.result().hits):
            if hit:
                results[i] = targets[i]
                tally.count("pages_read")
    return results


def set_values(s: Session, keys: List[bytes], values: List[torch.Tensor], tally: Tally) -> bool:
    """PUT the flat ``values`` under ``keys`` (one request per size); True when all were stored."""
    ring = _ring(s)
    futures: list[Future[StoreResult]] = []
    for size, idx in group_by_size(tensor_nbytes(v) for v in values).items():

        def fill(batch: RingBatch, idx=idx) -> bool:
            for j in range(batch.count):
                copy_tensor_to_ring(values[idx[batch.first + j]], ring, batch.offset + j * batch.stride)
            return True

        tally.count("put_requests")
        futures.append(s.client.put(_pick(keys, idx), size, fill))
    ok = True
    for f in futures:
        flags = f.result().stored
        tally.count("pages_written", sum(1 for x in flags if x))
        ok = ok and all(flags)
    return ok
