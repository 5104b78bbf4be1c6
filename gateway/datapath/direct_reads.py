"""MAP: an engine's rank gets read-only descriptors of its objects' files, checked in place.

A restore through the ring costs a host copy (page cache -> ring) before the GPU's DMA; with
MAP the engine maps the object's file itself (``adpkv_core.direct_map``) and the GPU copies
from the page cache. What the gateway does for one MAP (``DirectReads.serve``, on the loop):

- who: only a door session with an attached rank of an engine its user owns (as RING), and
  only for keys of namespaces that user owns (``NamespaceOwners.verdict``, and claimed as GET
  claims them). FORBIDDEN whole otherwise, before any card is asked about an object.
- what: on the I/O pool, through the store (``ObjectStore.open_verified``: it finds the card
  and asks it), for each key whose object is one fragment, held by a card that hands its files
  (``Card.hands_files``, ``Card.open_placed``: the fs card), the file opened ``O_RDONLY``; then
  the object checked where it lies (``verify_in_place``, given to the store: header, size,
  write id, xxh3 of the payload read through a private mapping of the page cache, no copy into
  any buffer), in the I/O processes when the gateway has some (``verify_paths`` run there).
  A failed check is a miss, never a descriptor, and its verdict goes to the card as a failed
  read's does (``Card.placed_checked``: a corrupt object is removed).
- the reply, on the loop: ``MapOk`` with one descriptor per hit (``SCM_RIGHTS``); the
  gateway's own copies are closed once sent. Never a path, never a directory, never a
  writable descriptor.

Why the bytes cannot change under the engine after the check: a placed file is never written
again (the fs card writes a new file under a temporary name and renames it into place; an
eviction, a delete or a corrupt verdict unlinks the name). The engine's descriptor holds the
inode it was handed: an unlink or a rewrite leaves that inode's bytes whole until the last
descriptor and mapping go. Only a writer with the card's own rights (the gateway's user, root)
could change a placed file, and those can change anything.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Optional, Sequence

from adpkv_core.wire import protocol as P

from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.base import Read
from adpkv_gateway.cards.fs.files import verdict_of
from adpkv_gateway.cards.objfile import HEADER_BYTES
from adpkv_gateway.cards.checksum import xxh3_64
from adpkv_gateway.store.card_io import OpenedFile
from adpkv_gateway.store.object_store import ObjectStore

logger = logging.getLogger("adpkv.gateway")


def verify_in_place(fd: int, fkey: bytes, n: int, write_id: Optional[int]) -> Read:
    """The verdict on the object file open at ``fd`` as fragment ``fkey`` of ``n`` payload
    bytes (of the write ``write_id``; None: any): its header read with one ``pread``, its
    payload hashed through a private read-only use of the page cache (``ACCESS_COPY``: nothing
    is written, so no page is copied; writable only so the hash runs without the GIL)."""
    try:
        if os.fstat(fd).st_size < HEADER_BYTES + n:
            return Read.TRUNCATED
        header = os.pread(fd, HEADER_BYTES, 0)
        verdict = objfmt.check_header(header, fkey, n, write_id)
        if verdict is not Read.HIT:
            return verdict
        with mmap.mmap(fd, HEADER_BYTES + n, access=mmap.ACCESS_COPY) as mapped:
            view = memoryview(mapped)
            try:
                ok = xxh3_64(view[HEADER_BYTES:HEADER_BYTES + n]) == objfmt.payload_checksum(header)
            finally:
                view.release()
    except OSError as exc:
        return verdict_of(exc)
    return Read.HIT if ok else Read.BAD_CHECKSUM


def verify_paths(paths: Sequence[str], fkeys: Sequence[bytes], n: int,
                 write_ids: Sequence[Optional[int]]) -> list[Read]:
    """``verify_in_place`` of files reached by ``/proc/<gateway>/fd/<n>`` (an I/O process:
    the very inodes the gateway opened, whatever their names are now)."""
    out = []
    for path, fkey, write_id in zip(paths, fkeys, write_ids):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            out.append(Read.TRANSIENT if verdict_of(exc).drops else verdict_of(exc))   # about /proc, not the file
            continue
        try:
            out.append(verify_in_place(fd, fkey, n, write_id))
        finally:
            os.close(fd)
    return out


def open_verified(store: ObjectStore, keys: Sequence[bytes], marks: Optional[Sequence[int]], n: int,
                  procs=None) -> list[Optional[int]]:
    """On the I/O pool: for each key, a read-only descriptor of its object's file, checked in
    place, or None (``ObjectStore.open_verified``: not stored, several fragments, a card that
    hands no files, a failed check: its verdict applied by the card). ``procs``: the gateway's
    I/O processes (the checks are shared among them), or None (checked on this thread)."""
    return store.open_verified(keys, marks, n, lambda files: _verify(files, n, procs))


def _verify(files: list[OpenedFile], n: int, procs) -> list[Read]:
    if procs is None or len(files) < 2:
        return [verify_in_place(f.fd, f.fkey, n, f.write_id) for f in files]
    share = -(-len(files) // procs.processes)
    futures = []
    for at in range(0, len(files), share):
        part = files[at:at + share]
        futures.append(procs.submit(verify_paths, [f"/proc/{os.getpid()}/fd/{f.fd}" for f in part],
                                    [f.fkey for f in part], n, [f.write_id for f in part]))
    out: list[Read] = []
    for fut in futures:
        try:
            out.extend(fut.result())
        except Exception as exc:                 # a reader died: these are misses, nothing dropped
            logger.warning("MAP: a check in an I/O process failed (%s); its objects are misses", exc)
            out.extend([Read.TRANSIENT] * (min(share, len(files) - len(out))))
    return out


class DirectReads:
    """MAP for one gateway (see the module): ``serve(session, request)`` on the loop.

    ``gateway`` is the ``server.Gateway`` (its engines, namespaces, store, pools, door); its
    ``counters`` (STATS) count ``map_requests``, ``map_handed`` (descriptors) and ``map_misses``."""

    def __init__(self, gateway):
        self.gw = gateway

    def serve(self, session, msg: P.MapRequest) -> None:
        self.gw.rank_session_engine(session, "object files are")
        self._checked(session, msg, None)

    def _checked(self, session, msg: P.MapRequest, settled) -> None:
        gw = self.gw
        unresolved = gw.namespaces.verdict(session.uid, msg, settled)      # FORBIDDEN: nothing is handed
        if unresolved is not None:    # owners not known yet: asked of the cards (and claimed, as GET does)
            def found(owners):
                gw.namespaces.learn(owners)
                try:
                    self._checked(session, msg, owners)
                except P.ProtocolError as exc:
                    gw.door.answer(session, P.error(msg.id, exc.code, exc.message))
            gw._run(gw.pool, lambda: gw.namespaces.resolve(unresolved), found,
                    lambda exc: gw.door.answer(session, P.error(msg.id, P.CARD_ERROR, f"the cards did not answer "
                                                                f"who owns the key namespaces: {exc}")))
            return
        keys, marks, n = msg.keys, msg.marks, msg.obj

        def answer(fds: list[Optional[int]]) -> None:
            handed = [fd for fd in fds if fd is not None]
            gw.counters["map_requests"] += 1
            gw.counters["map_handed"] += len(handed)
            gw.counters["map_misses"] += len(fds) - len(handed)
            try:
                gw.door.answer(session, P.MapOk(id=msg.id, hits=P.pack_flags(fd is not None for fd in fds),
                                                offset=HEADER_BYTES), handed)
            finally:
                for fd in handed:
                    os.close(fd)

        gw._run(gw.pool, lambda: open_verified(gw.store, keys, marks, n, gw.procs), answer,
                lambda exc: gw.door.answer(session, P.error(msg.id, P.CARD_ERROR, f"the cards did not answer: {exc}")))
