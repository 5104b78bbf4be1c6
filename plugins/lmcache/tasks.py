"""The tasks of the adpkv L2 adapter: ``adpkv_core.jobs.JobBook`` per kind, and LMCache's eventfds.

LMCache's L2 interface is submit-then-poll: ``submit_store_task``,
``submit_lookup_and_lock_task`` and ``submit_load_task`` return a task id at once;
when the task completes the eventfd of its kind is signalled, and LMCache's controllers
poll the fds and collect each result exactly once (``pop_completed_store_tasks``,
``query_lookup_and_lock_result``, ``query_load_result``).

A task is a job of its kind's ``JobBook`` (the three books share one id sequence, so a
task id names one task of any kind): its futures are the requests it sent, its ``meta``
a ``Task`` (which objects each request covers). The book hands each finished task out
once; the adapter's bookkeeping of a finished task (counters, pins, listeners) is the
book's ``on_finish`` and runs before LMCache can collect it; the eventfd is signalled
after. ``merged_flags`` and ``merged_stores`` read a finished task per object.

Threads (LMCache's store and prefetch controllers call the adapter from two threads):
``Tasks.submit``, ``pop_all``, ``pop`` run on the calling controller thread and never
wait; a task finishes (``on_finish``, the eventfd) wherever its last request resolved:
the client's I/O thread, the thread calling ``close()`` (closing the attachment fails
what is in flight), or inline on the submitting thread (a task that sent no request).
After ``close()`` finished tasks are dropped and no eventfd is signalled.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

from adpkv_core.attachment import Session
from adpkv_core.client import StoreResult
from adpkv_core.jobs import FinishedJob, JobBook

from ._compat import L2TaskId, create_event_notifier

KINDS = ("store", "lookup", "load")


@dataclasses.dataclass(frozen=True)
class Task:
    """What a task carries through its book: LMCache's keys of its objects, their adpkv keys
    and sizes (a lookup: no sizes), per request it sent (its job's futures, in order) the
    indices of the objects that request covers, and the session the requests went out on
    (None: it sent none)."""

    keys: Sequence[Any]
    adp: Sequence[bytes] = ()
    sizes: Sequence[int] = ()
    covers: Sequence[Sequence[int]] = ()
    session: Optional[Session] = None


FinishedTask = FinishedJob[Task]


class Tasks:
    """The adapter's tasks: one ``JobBook`` per kind (``store``, ``lookup``, ``load``) and one
    eventfd per kind (distinct fds, as LMCache's controllers require; closed by ``close()``).
    ``on_finish[kind]``: the adapter's bookkeeping of a finished task of that kind."""

    def __init__(self, on_finish: dict[str, Callable[[FinishedTask], None]]) -> None:
        ids = itertools.count()
        self._efd = {k: create_event_notifier() for k in KINDS}
        self._books: dict[str, JobBook[Task]] = {
            k: JobBook(on_finish[k], functools.partial(self._signal, k), ids) for k in KINDS}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def fd(self, kind: str) -> int:
        """The eventfd LMCache polls for completed tasks of ``kind``."""
        return self._efd[kind].fileno()

    def submit(self, kind: str, futures: Sequence[Future], task: Task, failed: bool = False) -> L2TaskId:
        """A task of ``kind`` of those requests (``task.covers`` says which objects each covers);
        ``failed``: it could not start. Its id."""
        return self._books[kind].submit(futures, task, failed=failed)

    def pop_all(self, kind: str) -> list[FinishedTask]:
        """Every finished task of ``kind`` not handed out yet (the store controller's call)."""
        return self._books[kind].pop_finished()

    def pop(self, kind: str, tid: L2TaskId) -> Optional[FinishedTask]:
        """Task ``tid`` of ``kind``, once it finished; None while it runs (or after it was handed out)."""
        return self._books[kind].pop(tid)

    def in_flight(self) -> dict[str, int]:
        return {k: book.running() for k, book in self._books.items()}

    def close(self) -> None:
        """Drop undelivered tasks and close the eventfds; tasks finishing later are not kept."""
        self._closed = True
        for book in self._books.values():
            book.close()
        for efd in self._efd.values():
            efd.close()

    def _signal(self, kind: str) -> None:
        try:
            self._efd[kind].notify()
        except OSError:
            pass  # closed under us


# ---------------------------------------------------------------------------- reading a task
def merged_flags(job: FinishedTask) -> list[bool]:
    """Per object of a finished task: read (a load), found (a lookup) or stored (a store); False
    for objects of a request that failed, and for all when the task sent none."""
    flags = [False] * len(job.meta.keys)
    for r, idx in enumerate(job.meta.covers):
        for i, ok in zip(idx, job.flags(r, len(idx))):
            flags[i] = ok
    return flags


def merged_stores(job: FinishedTask) -> tuple[list[bool], list[bool]]:
    """``(stored, existed)`` per object of a finished store task; ``existed[i]`` only where stored."""
    n = len(job.meta.keys)
    stored = [False] * n
    held = [False] * n
    for r, idx in enumerate(job.meta.covers):
        res = job.results[r]
        if not isinstance(res, StoreResult) or len(res.stored) != len(idx) or len(res.existed) != len(idx):
            continue      # failed: nothing stored
        for j, i in enumerate(idx):
            stored[i] = res.stored[j]
            held[i] = res.stored[j] and res.existed[j]
    return stored, held
