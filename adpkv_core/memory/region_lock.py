"""Handing a region's buffer back to the engine: no gateway write lands after the client gave up.

A GET into a region carries ``write_by`` (the client's give-up moment, CLOCK_MONOTONIC): the
gateway writes nothing into the region after it. A check and a write are two steps, though: a
gateway stalled between them (SIGSTOP, swapped out, a long page fault) would write after the
client gave up and the engine reused its buffer. Open-file-description byte-range locks
(``F_OFD_SETLK``, they work on memfds and /dev/shm files, the only regions there are) close
that window:

- the gateway (``holding``) takes a *shared* lock on the bytes an I/O task is about to write,
  without waiting, then checks ``write_by`` and writes, object by object, and drops the lock
  when the task is done. A refused lock means the client holds its exclusive one: it gave up,
  nothing is written (a client that holds its lock for long only makes its own requests miss:
  the gateway never waits for a client);
- a client that gave up (``take_back``, once ``write_by`` passed) takes an *exclusive* lock
  on the whole file on a descriptor of its own (an OFD lock belongs to an open file
  description: the gateway's is the one the client passed at the door, so the client opens
  the file again for its lock), waiting for writes in progress, and drops it at once. Any
  gateway write that starts after that finds ``write_by`` passed. Only then does the request
  resolve and the engine get its buffer back.

A gateway stopped in the middle of a write holds its lock until it resumes (or dies: its
locks go with its descriptors). The client waits for it, however long, with a warning when
it has to wait and one when the gateway let go: waiting is what keeps the engine's data
right; a buffer the gateway may still write into is never handed back.

The gateway's locks are all of one open file description per region (its descriptor), so two
of its tasks writing into overlapping bytes at once (a client with two GETs into the same bytes
in flight: they race with each other anyway) do not hold each other's lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import time
from typing import Iterable, Iterator, Optional, Sequence

logger = logging.getLogger("adpkv.client")


def _flock(kind: int, start: int, length: int) -> bytes:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padded to 32 bytes
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, length, 0)


@contextlib.contextmanager
def holding(spans: Sequence[tuple[int, int, int]], write_by: Optional[float]) -> Iterator[bool]:
    """The gateway's side, around one I/O task's writes into client regions: a shared lock on
    each ``(fd, start, end)`` byte span, taken without waiting, for the task's duration; yields
    whether the task may write at all (False: a client holds its exclusive lock, it gave up).
    Every ``write_by`` check and write of the task happen inside. No lock without ``write_by``
    (a request with no give-up moment has nothing to hand back). One lock per task, not per
    object: the lock's cost (two ``fcntl`` calls, each a release of the GIL) is paid once for
    up to ``transfers.IO_TASK_ITEMS`` objects."""
    held: list[tuple[int, int, int]] = []
    try:
        if write_by is not None:
            for fd, start, end in spans:
                try:
                    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_RDLCK, start, end - start))
                except OSError:
                    yield False         # EAGAIN: the client took its buffer back (or the lock failed)
                    return
                held.append((fd, start, end))
        yield True
    finally:
        for fd, start, end in held:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, start, end - start))
            except OSError:
                pass                    # the descriptor is gone with its session: so is the lock


def take_back(fds: Iterable[int], what: str = "a region request") -> None:
    """The client's side, once ``write_by`` of a request passed: wait until the gateway writes
    into none of the regions behind ``fds`` (the client's own descriptors of them, open for
    writing), so that none writes after this returns. Blocks as long as the gateway holds a
    lock (logged)."""
    for fd in fds:
        try:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, 0, 0))
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                t0 = time.monotonic()
                logger.warning("The gateway is writing into a region of %s after it was given up (stopped or "
                               "stalled?); the buffer goes back to the engine only once it stops", what)
                fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK, 0, 0))
                logger.warning("The gateway let go of the region of %s after %.3f s", what, time.monotonic() - t0)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, 0, 0))
        except OSError as exc:
            logger.warning("Cannot lock a region to take it back from the gateway (%s)", exc)
