"""How the bytes of LMCache's MemoryObjs reach the gateway: LMCache's L1 region, or ring copies.

A load or store task hands the adapter MemoryObjs (buffers LMCache owns and keeps
valid until the task completes). ``send`` turns them into adpkv requests, one per
object size and path:

- objects inside LMCache's L1 pool, when that pool is a shared-memory file the
  gateway registered as a region (``L1Pool``): ``get_into`` / ``put_from``, the
  gateway reads from the card straight into L1 (or writes from it); no copy here;
- all others: ``get`` / ``put`` through the ring; ``ring_copier`` is the request's
  ``on_batch`` and moves each object between its ring slot and its MemoryObj with
  ``RingView.fill`` / ``drain`` (``adpkv_core.ringview``: one ``memmove`` per
  object, GIL released, no ``bytes``).

Threads: ``send`` runs on the submitting controller thread and only sends (it never
waits for the gateway). ``ring_copier``'s callback runs on the client's I/O thread
and must not block: it copies and returns True. ``L1Pool.register`` runs in the
attachment's ``on_attach`` (the constructor's thread for the first attachment, the
attachment's watcher thread after a re-attach), before any task can see the new
session; it blocks up to ``connect_timeout_s`` for the gateway's answer.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional, Sequence

import numpy as np
import torch

from lmcache.logging import init_logger

from adpkv_core.attachment import Session
from adpkv_core.ringview import RingView
from adpkv_core.client import BatchCallback
from adpkv_core.grouping import group_by_size
from adpkv_core.memory.regions import SharedFile, shared_file_of

logger = init_logger("adpkv_lmcache")

# (address, size, keepalive) of one MemoryObj's bytes
Buffer = tuple[int, int, Any]


def buffer_of(obj) -> Buffer:
    """(address, size, keepalive) of the logical bytes of a MemoryObj (no copy)."""
    size = int(obj.get_size())
    raw = getattr(obj, "raw_data", None)
    if isinstance(raw, torch.Tensor):
        if raw.device.type != "cpu" or not raw.is_contiguous():
            raise ValueError("adpkv L2 adapter needs contiguous host-memory objects")
        if raw.numel() * raw.element_size() < size:
            raise ValueError(f"MemoryObj reports {size} bytes but its buffer holds fewer")
        return raw.data_ptr(), size, raw
    # Other MemoryObj kinds expose their bytes through the buffer protocol.
    arr = np.frombuffer(obj.byte_array, dtype=np.uint8)
    if arr.nbytes < size:
        raise ValueError(f"MemoryObj reports {size} bytes but its buffer holds fewer")
    return arr.ctypes.data, size, arr


def ring_copier(ring: RingView, bufs: Sequence[Buffer], op: str) -> BatchCallback:
    """The ``on_batch`` of a ring GET/PUT: objects between their ring slots and LMCache's
    buffers. The closure keeps the buffers referenced while the request lives."""
    addrs = [b[0] for b in bufs]
    if op == "PUT":
        return lambda batch: ring.fill(batch, addrs) and bufs is not None
    return lambda batch: ring.drain(batch, addrs) and bufs is not None


class L1Pool:
    """LMCache's L1 pool (its ``L1MemoryDesc``: ``ptr``, ``size``) and, when it is a file in
    /dev/shm and ``direct`` is on, its registration as a region of each attachment
    (``session.state["region"]``: the region id, or None: the ring path)."""

    def __init__(self, desc: Any, direct: bool):
        self.desc = desc
        self.file: Optional[SharedFile] = self._find_file(desc) if direct else None

    @property
    def path(self) -> Optional[str]:
        return self.file.path if self.file is not None else None

    @staticmethod
    def _find_file(desc: Any) -> Optional[SharedFile]:
        """The /dev/shm file of LMCache's L1 pool, when it is one (else None: the ring path)."""
        ptr, size = int(getattr(desc, "ptr", 0) or 0), int(getattr(desc, "size", 0) or 0)
        found = shared_file_of(ptr, size) if ptr and size else None
        if found is not None:
            logger.info("adpkv L2 adapter: LMCache's L1 pool is %s; the gateway reads and writes it directly",
                        found.path)
        elif ptr and size:
            logger.info("adpkv L2 adapter: LMCache's L1 is not in shared memory, so objects go through the "
                        "gateway's ring (one copy more); start the server with --shm-name NAME to let the "
                        "gateway read into L1 directly")
        return found

    def register(self, s: Session, timeout_s: float) -> None:
        """Register the pool with a new attachment (regions go with the gateway process)."""
        s.state["region"] = None
        if self.file is None:
            return
        try:
            s.state["region"] = s.client.register_region(self.file.path, self.file.offset, self.desc.size
                                                         ).result(timeout_s)
        except Exception:
            s.state["region"] = None
        if s.state["region"] is None:
            logger.warning("adpkv L2 adapter: the gateway did not map LMCache's L1 pool %s; "
                           "loads and stores go through the ring", self.file.path)

    @staticmethod
    def region(s: Session) -> Optional[int]:
        return s.state.get("region")

    def holds(self, s: Session, buf: Buffer) -> bool:
        """Whether ``buf`` lies inside the pool and the pool is a region of session ``s``."""
        return self.region(s) is not None and 0 <= buf[0] - self.desc.ptr <= self.desc.size - buf[1]


def send(s: Session, l1: L1Pool, op: str, keys: Sequence[bytes], marks: Optional[Sequence[int]],
         bufs: Sequence[Buffer]) -> tuple[list[tuple[list[int], Future]], int]:
    """One GET or PUT per object size and path (straight to the L1 region, or through the
    ring): ``([(indices, future), ...], objects sent straight to the region)``."""
    parts: list[tuple[list[int], Future]] = []
    direct_count = 0
    for size, idx in group_by_size([b[1] for b in bufs]).items():
        direct: list[int] = []
        ringed: list[int] = []
        for i in idx:
            (direct if l1.holds(s, bufs[i]) else ringed).append(i)
        for sub in (direct, ringed):
            if not sub:
                continue
            sub_keys = [keys[i] for i in sub]
            sub_marks = [marks[i] for i in sub] if marks is not None else None
            fut: Future
            if sub is direct:
                region = l1.region(s)
                assert region is not None   # holds() said the pool is a region of s
                at = [bufs[i][0] - l1.desc.ptr for i in sub]
                if op == "GET":
                    fut = s.client.get_into(region, at, sub_keys, size, marks=sub_marks)
                else:
                    fut = s.client.put_from(region, at, sub_keys, size, marks=sub_marks)
            else:
                ring = s.ring
                # the adapter sends on enabled sessions of rank 0, and those have their ring
                # (Session.enabled)
                assert ring is not None, "an enabled session of a rank without a ring"
                copier = ring_copier(ring, [bufs[i] for i in sub], op)
                if op == "GET":
                    fut = s.client.get(sub_keys, size, copier, marks=sub_marks)
                else:
                    fut = s.client.put(sub_keys, size, copier, marks=sub_marks)
            parts.append((sub, fut))
        direct_count += len(direct)
    return parts, direct_count
