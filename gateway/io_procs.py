"""fs card reads in worker processes.

Python threads share one GIL: on a host with many cores the gateway's I/O
threads spend much of a page-cache read waiting for it. With ``io_processes: N``
the reads of fs cards run in N processes, each with its own GIL, that map the
same ring and read object files straight into their ring slots. The gateway
keeps every decision (index, LRU, placement, corrupt files) in its own process.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

from adpkv_core.ring import Ring

from .cards.fs import _Scratch, read_object_file

_ring: Optional[Ring] = None
_scratch: Optional[_Scratch] = None


def _init(ring_path: str, ring_size: int) -> None:
    global _ring, _scratch
    _ring = Ring.attach(ring_path, ring_size)
    _scratch = _Scratch()


def read_files(items: list) -> list:
    """``(j, path, fkey, ring offset, length, o_direct)`` items → ``(j, problem or None, seconds)``."""
    out = []
    for j, path, fkey, offset, length, o_direct in items:
        t0 = time.monotonic()
        problem = read_object_file(path, fkey, _ring.buf[offset:offset + length], o_direct, _scratch)
        out.append((j, problem, time.monotonic() - t0))
    return out


def start(processes: int, ring: Ring) -> ProcessPoolExecutor:
    """A pool of ``processes`` readers mapping ``ring`` (spawned: the gateway has threads).
    They open the ring through the gateway's descriptor (``/proc/<pid>/fd/<n>``)."""
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init, initargs=(f"/proc/{os.getpid()}/fd/{ring.fd}", ring.size))
    for f in [pool.submit(read_files, []) for _ in range(processes)]:
        f.result()          # start them now, not on the first restore
    return pool
