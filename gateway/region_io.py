"""Region copies of GET and PUT batches: bytes between the cards or the ring and a client's
region, on the region's descriptor (``door.Region``: the client's file, passed at the door).

Contract (every function runs on the I/O pool, takes a batch's items and returns
``(j, ok)`` per item, ``j`` the object's index in its batch, as ``Transfers._io_done``
expects):

- The gateway never maps a region: ``pwritev``/``preadv`` on its descriptor only, so a
  region the client shrank or closed fails a call, it cannot fault the gateway.
- Nothing is written into a region once the client gave up on the request (``write_by``
  passed: its engine may reuse the buffer), nor past the region's size now (a write would
  grow the client's file); ``door.Region.size_now`` is that check, made again before every
  write, and those checks and the writes of a task happen under a lock the client waits for
  before it takes its buffer back (``adpkv_core.region_lock.holding``).
- Nothing read from a region is stored once the client gave up on a PUT (``read_by``), nor
  from a region shorter than the object.

A scattered PUT (an object as pieces of several regions) goes through ``write_via_ring`` too
(``Scatter.gather``); a scattered GET's copy out of the ring is ``scatter.to_scatter``.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from adpkv_core.region_lock import holding

from .scatter import Scatter
from .store import ObjectStore


def direct_reads(store: ObjectStore, region, items: list, write_by: Optional[float]) -> list[tuple[int, bool]]:
    """Read ``(j, fragment, file offset)`` items from their cards straight into a client's
    region (runs on the pool), each only while the client still waits for it (checked again
    before every write into the region) and only where the region is still as large as
    registered. A fragment that misses on its card is read from the object's next replica
    whose card reads into regions (one without ``direct_reads`` is passed over: the
    fragment misses on this path)."""
    out = []
    with holding(_span(region, [(place, frag.length) for _, frag, place in items]), write_by) as may_write:
        for j, frag, place in items:
            ok = False
            for card in (frag.card, *frag.others) if may_write else ():
                if card != frag.card and not (store.in_service(card) and store.cards[card].direct_reads):
                    continue
                size_now = region.size_now(write_by)
                if size_now is None or place + frag.length > size_now:
                    break
                replica = frag if card == frag.card else frag._replace(card=card, others=())
                (_, ok), = store.read_to_fds([(j, replica, region.fd, place)], write_by)
                if ok:
                    break
            out.append((j, ok))
    return out


def to_region(region, items: list, write_by: Optional[float]) -> list[tuple[int, bool]]:
    """Copy ``(j, ring view, file offset)`` items from the ring into a client's region with
    ``pwritev`` on its descriptor (runs on the pool). The gateway never maps a region: a
    region the client shrank fails these calls, it cannot fault the gateway. A region
    shorter now than registered takes nothing (a write would grow the client's file), and
    nothing is written once the client gave up on the request (``write_by``)."""
    out = []
    with holding(_span(region, [(place, len(view)) for _, view, place in items]), write_by) as may_write:
        for j, view, place in items:
            size_now = region.size_now(write_by) if may_write else None
            ok = False
            if size_now is not None and place + len(view) <= size_now:
                try:
                    ok = os.pwritev(region.fd, [view], place) == len(view)
                except OSError:
                    pass
            out.append((j, ok))
    return out


def _span(region, places: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The byte span of a task's writes (file offset, length) in ``region``, as ``holding`` takes it."""
    if not places:
        return []
    return [(region.fd, min(p for p, _ in places), max(p + n for p, n in places))]


def write_via_ring(store: ObjectStore, region, items: list, read_by: Optional[float]) -> list[tuple[int, bool]]:
    """Store ``(j, replica plans, ring view, file offset)`` items of a client's region on
    cards that cannot read it themselves: ``preadv`` into the ring slot, then written as a
    ring PUT (runs on the pool). A region shorter than the object stores nothing of it, nor
    does a read that ended at or after ``read_by`` (the client had given up: its engine may
    have put other bytes there)."""
    out = []
    for j, plans, view, place in items:
        try:
            if isinstance(region, Scatter):
                ok = region.gather(view, place)
            else:
                ok = os.preadv(region.fd, [view], place) == len(view)
        except OSError:
            ok = False
        ok = ok and (read_by is None or time.monotonic() < read_by)
        out.append((j, ok and store.write_replicas(plans, view)))
    return out

