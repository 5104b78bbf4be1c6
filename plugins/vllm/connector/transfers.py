"""The bookkeeping of one step's transfers on a worker (``worker.py``): where a load's
objects go (``ChunkPlanIndex``), which requests an asynchronous load serves (``AsyncLoad``,
the metadata of its job in the worker's ``adpkv_core.jobs.JobBook``) and whether each got
every object (``received``), when a PUT's pages are in the ring (``PutJob``). Nothing here
talks to the gateway; the copies are ``common/copy.py``'s."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from adpkv_core.jobs import FinishedJob

from .metadata import ChunkPlan


class ChunkPlanIndex:
    """The objects of one step's loads, in request order, and where their blocks go."""

    def __init__(self, plans: list[ChunkPlan], blocks_per_chunk: int):
        self.bpc = blocks_per_chunk
        self.digests: list[bytes] = []
        self.marks: list[int] = []
        dst: list[int] = []
        pos: list[int] = []       # global block position: object*bpc + block in object
        self._obj_blocks: list[list[int]] = []
        obj = 0
        for p in plans:
            positions = p.positions if p.positions is not None else list(range(len(p.digests) * self.bpc))
            per_obj: list[list[int]] = [[] for _ in p.digests]
            for b, q in zip(p.block_ids, positions):
                dst.append(b)
                pos.append(obj * self.bpc + q)
                per_obj[q // self.bpc].append(b)
            self._obj_blocks.extend(per_obj)
            self.digests.extend(p.digests)
            self.marks.extend(p.marks)
            obj += len(p.digests)
        self.dst = torch.as_tensor(dst, dtype=torch.long)
        self.pos = torch.as_tensor(pos, dtype=torch.long)
        self.all_blocks = dst
        self.full = len(dst) == obj * self.bpc   # every block of every object is written

    def object_blocks(self, i: int) -> list[int]:
        return self._obj_blocks[i]

    def batch_blocks(self, first: int, count: int, hits) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(destination block ids, positions within the batch or None) for a ring batch."""
        lo, hi = first * self.bpc, (first + count) * self.bpc
        if self.full and (hits is None or all(hits)):
            return self.dst[lo:hi], None
        sel = (self.pos >= lo) & (self.pos < hi)
        if hits is not None and not all(hits):
            hit_obj = torch.as_tensor([bool(h) for h in hits], dtype=torch.bool)
            sel &= hit_obj[((self.pos - lo) // self.bpc).clamp(0, count - 1)]
        if not bool(sel.any()):
            return None, None
        return self.dst[sel], self.pos[sel] - lo


@dataclass(frozen=True)
class AsyncLoad:
    """One step's asynchronous loads, as their job (one GET per layer: the job's futures, in
    the order of ``gets``) carries them: which objects of each group belong to which request,
    the blocks each request's load writes, and per GET the plans it follows and its objects."""

    spans: dict[str, dict[tuple[int, bool], tuple[int, int]]]   # req -> (group, drafter) -> (first object, end)
    blocks: dict[str, list[int]]        # req -> the blocks its load writes (a failure reported by block)
    gets: list[tuple[tuple[int, bool], int]]   # per GET: ((group index, drafter), its objects)


def received(job: FinishedJob[AsyncLoad]) -> set[str]:
    """The requests of a finished asynchronous load with every object of every layer read
    (none when it sent no GET)."""
    load = job.meta
    ok = set(load.spans) if job.results and not job.failed else set()
    for i, (plans, n) in enumerate(load.gets):
        hits = job.flags(i, n)
        for req, by_plans in load.spans.items():
            span = by_plans.get(plans)
            if span is not None and not all(hits[span[0]:span[1]]):
                ok.discard(req)
    return ok


class PutJob:
    """One PUT: when all its pages are in the ring, the blocks may be reused."""

    __slots__ = ("n", "_copied", "_event")

    def __init__(self, n: int):
        self.n = n
        self._copied = 0
        self._event = threading.Event()

    def copied(self, count: int) -> None:
        self._copied += count
        if self._copied >= self.n:
            self._event.set()

    def done(self) -> None:
        self._event.set()

    def is_copied(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)
