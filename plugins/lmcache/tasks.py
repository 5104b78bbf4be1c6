"""Task bookkeeping of the adpkv L2 adapter: task ids, results handed out once, eventfds.

LMCache's L2 interface is submit-then-poll: ``submit_store_task``,
``submit_lookup_and_lock_task`` and ``submit_load_task`` return a task id at once;
when the task completes its result is recorded here and the eventfd of its kind is
signalled; LMCache's controllers poll the fds and collect each result exactly once
(``pop_completed_store_tasks``, ``query_lookup_and_lock_result``,
``query_load_result``). This module holds only that life cycle and the reading of
the client's futures into per-key flags; what a task does is the adapter's.

Threads (LMCache's store and prefetch controllers call the adapter from two threads):

- ``TaskBook.new``, ``pop_all``, ``pop``: the calling controller thread; they take
  one lock and never wait.
- ``TaskBook.finish``: wherever a task completes: the client's I/O thread (the last
  request of the task resolved), the thread calling ``close()`` (closing the
  attachment fails what is in flight), or inline on the submitting thread (a task
  that needed no request, or failed to start). It must not block: one lock, one
  eventfd write. After ``close()`` results are dropped (nobody polls any more).
- ``when_all``: its continuation runs on the thread that resolved the last future
  (normally the client's I/O thread), so it must not block either.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from adpkv_core.client import LoadResult, StoreResult

from ._compat import L2TaskId, create_event_notifier

KINDS = ("store", "lookup", "load")

# (indices of the task's objects a request covers, that request's future: its hits)
Parts = Sequence[tuple[Sequence[int], "Future[LoadResult]"]]


class TaskBook:
    """Ids, in-flight counts and completed results of the adapter's tasks, per kind
    (``store``, ``lookup``, ``load``), and one eventfd per kind (distinct fds, as
    LMCache's controllers require; closed by ``close()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._in_flight = dict.fromkeys(KINDS, 0)
        self._done: dict[str, dict[L2TaskId, Any]] = {k: {} for k in KINDS}
        self._efd = {k: create_event_notifier() for k in KINDS}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def fd(self, kind: str) -> int:
        """The eventfd LMCache polls for completed tasks of ``kind``."""
        return self._efd[kind].fileno()

    def new(self, kind: str) -> L2TaskId:
        """A fresh task id of ``kind``, counted in flight until ``finish``."""
        with self._lock:
            tid = self._next_id
            self._next_id += 1
            self._in_flight[kind] += 1
        return tid

    def finish(self, kind: str, tid: L2TaskId, result: Any) -> None:
        """Record the result of task ``tid`` and signal the kind's eventfd (once per task)."""
        with self._lock:
            self._in_flight[kind] -= 1
            if self._closed:
                return
            self._done[kind][tid] = result
        try:
            self._efd[kind].notify()
        except OSError:
            pass  # closed under us

    def pop_all(self, kind: str) -> dict:
        """Every completed result of ``kind`` not handed out yet (the store controller's call)."""
        with self._lock:
            done, self._done[kind] = self._done[kind], {}
        return done

    def pop(self, kind: str, tid: L2TaskId) -> Any:
        """The result of task ``tid``, once; None while it runs (or after it was handed out)."""
        with self._lock:
            return self._done[kind].pop(tid, None)

    def in_flight(self) -> dict:
        with self._lock:
            return dict(self._in_flight)

    def close(self) -> None:
        """Drop undelivered results and close the eventfds; later ``finish`` records nothing."""
        with self._lock:
            self._closed = True
            for done in self._done.values():
                done.clear()
        for efd in self._efd.values():
            efd.close()


# ---------------------------------------------------------------------------- completion
def when_all(futures: Sequence[Future], then: Callable[[], None]) -> None:
    """Call ``then`` once every future is done, on the thread that finishes last (inline
    when there is none)."""
    if not futures:
        then()
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one_done)


def flags(f: "Future[list[bool]] | Future[LoadResult]", n: int) -> list[bool]:
    """The per-key flags a done EXIST (found) or GET (its hits) future resolved with; all False
    when it failed or does not describe ``n`` keys."""
    try:
        r = f.result(timeout=0)
    except Exception:
        return [False] * n
    found = r.hits if isinstance(r, LoadResult) else r
    return [bool(x) for x in found] if len(found) == n else [False] * n


def store_result(f: "Future[StoreResult]", n: int) -> StoreResult:
    """What a done PUT future resolved with; nothing stored when it failed or does not
    describe ``n`` keys."""
    try:
        r = f.result(timeout=0)
    except Exception:
        return StoreResult.none(n)
    return r if len(r.stored) == n and len(r.existed) == n else StoreResult.none(n)


def merged_hits(parts: Parts, n: int) -> list[bool]:
    """The flags of a task of ``n`` objects from its requests (each covering some indices)."""
    hits = [False] * n
    for idx, fut in parts:
        for i, ok in zip(idx, flags(fut, len(idx))):
            hits[i] = ok
    return hits


def merged_stores(parts: "Sequence[tuple[Sequence[int], Future[StoreResult]]]",
                  n: int) -> tuple[list[bool], list[bool]]:
    """``(stored, existed)`` of a store task of ``n`` objects; ``existed[i]`` only where stored."""
    stored = [False] * n
    held = [False] * n
    for idx, fut in parts:
        r = store_result(fut, len(idx))
        for j, i in enumerate(idx):
            stored[i] = r.stored[j]
            held[i] = r.stored[j] and r.existed[j]
    return stored, held
