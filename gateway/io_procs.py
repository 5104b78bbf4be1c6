"""Card reads in worker processes.

Python threads share one GIL: on a host with many cores the gateway's I/O
threads spend much of a page-cache read waiting for it. With ``io_processes: N``
the reads that a card can hand out as a task (``Card.process_read``: the fs card
does) run in N processes, each with its own GIL, that map the same ring and read
straight into their ring slots. The gateway keeps every decision (index, LRU,
placement, corrupt files, statistics, health) in its own process
(``Card.process_read_result``).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

from adpkv_core.ring import Ring

_ring: Optional[Ring] = None


def _init(ring_path: str, ring_size: int) -> None:
    global _ring
    _ring = Ring.attach(ring_path, ring_size)


def read_files(items: list) -> list:
    """``(j, task, ring offset, length)`` items → ``(j, problem or None, seconds)``; ``task``
    is what the card's ``process_read`` gave (it reads itself into a view of the ring)."""
    out = []
    for j, task, offset, length in items:
        t0 = time.monotonic()
        problem = task.read_into(_ring.buf[offset:offset + length])
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
