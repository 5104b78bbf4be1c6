"""The job book every adapter keeps of its transfers: ids, completion, results handed out once.

An engine hands an adapter transfer jobs (vLLM's store/load jobs, LMCache's tasks, a step's
asynchronous loads) and later asks which ended and how. Each adapter's job is one or more
requests of a ``GatewayClient``: a ``JobBook`` tracks their futures and hands out each
finished job exactly once as a ``FinishedJob`` (per future its result, read through the one
reading ``request.DataResult`` gives GET and PUT results); the adapter translates that into
its engine's contract (``TransferResult`` lists, ``JobResult`` with its successful keys,
``L2StoreResult`` and bitmaps). What a job carries besides (sizes, keys, which objects belong
to which request) is the adapter's ``meta``, handed back with it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Generic, Iterable, Iterator, Optional, Sequence, TypeVar, Union

from adpkv_core.request import DataResult

logger = logging.getLogger("adpkv.jobs")

M = TypeVar("M")

Outcome = Union[DataResult, list[bool]]
"""What a job's future resolved with: a GET's or PUT's ``DataResult``, or an EXIST's found
flags (a lookup job)."""


def _flags(result: Optional[Outcome]) -> Optional[list[bool]]:
    """Per key of one request: moved (an EXIST: found); None when its future raised."""
    if result is None:
        return None
    return result.ok if isinstance(result, DataResult) else result


@dataclasses.dataclass(frozen=True)
class FinishedJob(Generic[M]):
    """A job that ended, as its ``JobBook`` hands it out (once).

    ``results[i]``: what future ``i`` (in the order given to ``submit``) resolved with; None
    when it raised or resolved with something else. ``failed``: the adapter said so at
    ``submit`` (the job could not send all its requests). ``seconds``: from ``submit`` to the
    last future done."""

    id: int
    meta: M
    results: tuple[Optional[Outcome], ...]
    failed: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """Every object of every request moved, and the job did not fail at ``submit``."""
        if self.failed:
            return False
        for r in self.results:
            flags = _flags(r)
            if flags is None or not all(flags):
                return False
        return True

    def flags(self, i: int, n: int) -> list[bool]:
        """Per key of future ``i``'s request (``n`` keys): moved (an EXIST: found); ``n`` times
        False when it raised or its result does not describe ``n`` keys."""
        flags = _flags(self.results[i])
        return [bool(x) for x in flags] if flags is not None and len(flags) == n else [False] * n


class _Running(Generic[M]):
    __slots__ = ("id", "meta", "futures", "failed", "left", "t0")

    def __init__(self, job_id: int, meta: M, futures: list[Future], failed: bool):
        self.id = job_id
        self.meta = meta
        self.futures = futures
        self.failed = failed
        self.left = len(futures)
        self.t0 = time.perf_counter()


class JobBook(Generic[M]):
    """An adapter's jobs, each one or more client futures, from ``submit`` to handed out.

    Contract:

    - ``submit(futures, meta, job_id=None, failed=False) -> id``: a new job of those futures
      (GET, PUT or EXIST futures of a ``GatewayClient``), under the engine's ``job_id`` or a
      fresh id from ``ids`` (an id still in the book is refused: ``ValueError``). It finishes
      once every future is done: at once, on the calling thread, when there is none;
      otherwise on the thread that completed the last one (the client's I/O thread, or a
      thread closing the client).
    - Success (``FinishedJob.ok``): every object of every request moved (``DataResult.ok``), and
      not ``failed`` (the adapter could not send all of the job's requests).
    - Each finished job is handed out exactly once: by ``pop_finished`` (all of them, in the
      order they finished) or ``pop`` (one, by id; None while it runs and after it was handed
      out). A job is handed out only after ``on_finish`` ran for it; ``notify`` runs once it
      can be handed out.
    - ``wait(job_ids=None, timeout=None) -> bool``: block until those jobs (None: every job
      running now) have finished, or until ``timeout`` seconds passed (False then). It hands
      nothing out; an id the book does not hold counts as finished.
    - ``wait_any(timeout) -> bool``: block until some finished job waits to be handed out or
      none runs, or until ``timeout`` seconds passed (False then). It hands nothing out.
    - ``close()``: what was not handed out is dropped; a job that finishes later still runs
      ``on_finish`` (the adapter's bookkeeping) but is not kept, and ``notify`` no longer runs.

    Threads: every method may be called from any thread; only ``wait`` blocks. ``on_finish(job)``
    and ``notify()`` run on the thread that finished the job (often the client's I/O thread):
    they must not block. An exception from either is logged, the job is kept all the same.
    """

    def __init__(self, on_finish: Optional[Callable[[FinishedJob[M]], None]] = None,
                 notify: Optional[Callable[[], None]] = None, ids: Optional[Iterator[int]] = None):
        """``on_finish``: the adapter's bookkeeping of a finished job, before it can be handed
        out; ``notify``: told once a job can be handed out (an engine's eventfd); ``ids``:
        where fresh ids come from (several books may share one; default 0, 1, 2 ...)."""
        self._on_finish = on_finish
        self._notify = notify
        self._ids = ids if ids is not None else itertools.count()
        self._cond = threading.Condition()
        self._running: dict[int, _Running[M]] = {}
        self._finished: dict[int, FinishedJob[M]] = {}
        self._closed = False

    def submit(self, futures: Sequence[Future], meta: M, job_id: Optional[int] = None,
               failed: bool = False) -> int:
        job: _Running[M]
        with self._cond:
            jid = next(self._ids) if job_id is None else job_id
            if jid in self._running or jid in self._finished:
                raise ValueError(f"job {jid} is in the book already")
            job = _Running(jid, meta, list(futures), failed)
            self._running[jid] = job
        if not job.futures:
            self._finish(job)
        for f in job.futures:       # a future done already calls back at once, on this thread
            f.add_done_callback(functools.partial(self._one_done, job))
        return jid

    def pop_finished(self) -> list[FinishedJob[M]]:
        """Every finished job not handed out yet, in the order they finished."""
        with self._cond:
            done = list(self._finished.values())
            self._finished.clear()
        return done

    def pop(self, job_id: int) -> Optional[FinishedJob[M]]:
        """Job ``job_id`` if it finished and was not handed out yet, else None."""
        with self._cond:
            return self._finished.pop(job_id, None)

    def wait(self, job_ids: Optional[Iterable[int]] = None, timeout: Optional[float] = None) -> bool:
        with self._cond:
            ids = set(self._running) if job_ids is None else set(job_ids)
            return self._cond.wait_for(lambda: ids.isdisjoint(self._running), timeout)

    def wait_any(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._finished) or not self._running, timeout)

    def running(self) -> int:
        """Jobs submitted and not finished."""
        with self._cond:
            return len(self._running)

    def pending(self) -> int:
        """Jobs submitted and not handed out (running, or finished and waiting for a pop)."""
        with self._cond:
            return len(self._running) + len(self._finished)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._finished.clear()

    # ---------------------------------------------------------------- completion
    def _one_done(self, job: _Running[M], _future: Future) -> None:
        with self._cond:
            job.left -= 1
            last = job.left == 0
        if last:
            self._finish(job)

    def _finish(self, job: _Running[M]) -> None:
        done = FinishedJob(job.id, job.meta, tuple(_outcome(f) for f in job.futures), job.failed,
                        time.perf_counter() - job.t0)
        if self._on_finish is not None:
            try:
                self._on_finish(done)
            except Exception:
                logger.exception("adpkv: the bookkeeping of job %s failed", job.id)
        with self._cond:
            del self._running[job.id]
            keep = not self._closed
            if keep:
                self._finished[job.id] = done
            self._cond.notify_all()
        if keep and self._notify is not None:
            try:
                self._notify()
            except Exception:
                logger.exception("adpkv: notifying job %s failed", job.id)


def _outcome(f: Future) -> Optional[Outcome]:
    """What a done future resolved with, when it is a request's result; else None."""
    try:
        r = f.result(timeout=0)
    except Exception:
        return None
    return r if isinstance(r, (DataResult, list)) else None
