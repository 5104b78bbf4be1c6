"""Card reads in worker processes.

Python threads share one GIL: on a host with many cores the gateway's I/O
threads spend much of a page-cache read waiting for it. With ``io_processes: N``
the reads that a card can hand out (``Card.process_reads``: the fs card's ``FileRead``s)
run in N processes, each with its own GIL, that map the ring of the engine that asked
(each engine has its own: a task names it, a reader maps it by the gateway's descriptor
the first time it sees it and drops the rings the gateway no longer holds) and read
straight into their ring slots. A GET batch goes to them as about one ``ReadTask`` per process
(flat lists and arrays, not an object per read), and comes back as the few reads that
failed and an array of durations. The gateway keeps every decision (index, LRU,
placement, corrupt files, statistics, health) in its own process
(``Card.process_read_result``).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import multiprocessing
import os
import threading
import time
from array import array
from concurrent.futures import Executor, Future
from multiprocessing.connection import wait
from typing import Callable, Optional, Sequence

from adpkv_core.memory.ring import Ring

from adpkv_gateway.cards.base import FileRead, Read
from adpkv_gateway.cards.fs.files import object_name, verdict_of
from adpkv_gateway.cards.objfile import Scratch, read_object_file

logger = logging.getLogger("adpkv.gateway")

_rings: dict[int, Ring] = {}          # a reader's mappings of engine rings, by ring number
_scratch: Optional[Scratch] = None
_dirs: dict[str, int] = {}          # a FileRead's dir_ref -> this process's descriptor of that directory


def _process_scratch() -> Scratch:
    """This process's scratch buffers, made on first use (a reader makes them as it starts)."""
    global _scratch
    if _scratch is None:
        _scratch = Scratch()
    return _scratch


def _ring_of(number: int, path: str, size: int, oldest_live: int) -> Ring:
    """The reader's mapping of ring ``number`` (mapped now by ``path`` if new: the gateway's
    descriptor stays open while a task of that ring is in flight); rings older than
    ``oldest_live`` (closed by the gateway) are dropped first."""
    for old in [k for k in _rings if k < oldest_live]:
        _rings.pop(old).close()
    ring = _rings.get(number)
    if ring is None:
        ring = _rings[number] = Ring.attach(path, size)
    return ring


def _dir_fd(ref: str) -> int:
    """This process's descriptor of a card database's directory, opened once through the
    gateway's own checked descriptor (``/proc/<gateway>/fd/<n>``: that very directory,
    whatever now sits at its path)."""
    fd = _dirs.get(ref)
    if fd is None:
        fd = _dirs[ref] = os.open(ref, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return fd


NO_WRITE_ID = 0     # in ``ReadTask.write_ids``: any write (write ids are never 0)


class ReadTask:
    """A reader process's share of a GET batch: the fs card's ``FileRead``s (``process_reads``:
    directory, fragment key, expected write id, O_DIRECT) and the ring extents they go to,
    packed into flat fields (two lists, three arrays) that pickle as such, not as an object
    per read."""

    __slots__ = ("dirs", "fkeys", "write_ids", "offsets", "lengths", "o_direct", "ring")

    def __init__(self, dirs: list[str], fkeys: list[bytes], write_ids: array, offsets: array, lengths: array,
                 o_direct: bool, ring: tuple[int, str, int, int]):
        self.dirs, self.fkeys, self.write_ids = dirs, fkeys, write_ids
        self.offsets, self.lengths, self.o_direct = offsets, lengths, o_direct
        self.ring = ring        # (number, path to the gateway's descriptor, size, oldest ring still live)

    @classmethod
    def of(cls, reads: Sequence[FileRead], offsets: Sequence[int], lengths: Sequence[int], ring,
           oldest_live: int) -> "ReadTask":
        """The reads of one card (one ``o_direct``), read ``k`` into bytes ``offsets[k]``
        .. ``+ lengths[k]`` of ``ring`` (a ``ring_alloc.EngineRing``: the asking engine's);
        ``oldest_live``: the number of the oldest ring the gateway still holds."""
        return cls([r.dir_ref for r in reads], [r.fkey for r in reads],
                   array("Q", [NO_WRITE_ID if r.write_id is None else r.write_id for r in reads]),
                   array("q", offsets), array("q", lengths), reads[0].o_direct if reads else False,
                   (ring.number, f"/proc/{os.getpid()}/fd/{ring.ring.fd}", ring.ring.size, oldest_live))

    def __reduce__(self):
        return ReadTask, (self.dirs, self.fkeys, self.write_ids, self.offsets, self.lengths, self.o_direct,
                          self.ring)

    def __len__(self) -> int:
        return len(self.fkeys)


def read_task(task: ReadTask) -> tuple[list[tuple[int, Read]], array]:
    """Run a ``ReadTask`` in a reader process: ``(misses, seconds)``, ``misses`` the
    ``(k, verdict)`` of each read that was no hit (none when all went well), ``seconds``
    each read's duration."""
    misses: list[tuple[int, Read]] = []
    seconds = array("d", bytes(8 * len(task.fkeys)))
    buf, o_direct, scratch, clock = _ring_of(*task.ring).buf, task.o_direct, _process_scratch(), time.monotonic
    for k, (ref, fkey, write_id, offset, length) in enumerate(zip(task.dirs, task.fkeys, task.write_ids,
                                                                  task.offsets, task.lengths)):
        t0 = clock()
        try:
            verdict = read_object_file(_dir_fd(ref), object_name(fkey), fkey, buf[offset:offset + length], o_direct,
                                       scratch, None if write_id == NO_WRITE_ID else write_id)
        except OSError as exc:              # the directory could not be opened (EMFILE, ...)
            verdict = verdict_of(exc)
            if verdict.drops:
                verdict = Read.TRANSIENT    # about the directory, not the object
        seconds[k] = clock() - t0
        if verdict is not Read.HIT:
            misses.append((k, verdict))
    return misses, seconds


def _serve(tasks, task_lock, results, result_lock) -> None:
    """A reader process: run the tasks of the shared task pipe until told to stop (None)."""
    _process_scratch()
    with result_lock:
        results.send((None, True, None))          # ready
    while True:
        try:
            with task_lock:
                item = tasks.recv()
        except EOFError:
            return                             # the gateway is gone (e.g. killed): nothing to serve
        if item is None:
            return
        task_id, fn, args = item
        try:
            msg = (task_id, True, fn(*args))
        except BaseException as exc:       # noqa: BLE001 -- handed back to the caller's future
            msg = (task_id, False, exc)
        with result_lock:
            results.send(msg)


READY_TIMEOUT_S = 120
PIPE_BYTES = 1 << 20      # the task pipe holds this much (about 300 tasks) before a submit waits


class ReaderPool(Executor):
    """``processes`` spawned readers (the gateway has threads) mapping the engines' rings, fed from one
    task pipe that the submitting thread writes itself; one thread here reads the results.

    Against ``ProcessPoolExecutor``: a task crosses no manager or feeder thread of the gateway
    (each a wait for the GIL while the control loop runs), and every task of a batch is queued
    at once, so a reader that finishes takes the next one without waiting for the gateway
    (a ``ProcessPoolExecutor`` queues only one task more than it has processes).
    A reader that dies (killed, crashed) takes the others with it: every pending future fails
    (its reads are misses) and a fresh set of readers with fresh pipes starts, so no task
    queued before can still write into a ring slot that was handed on since.
    """

    def __init__(self, processes: int):
        self._ctx = multiprocessing.get_context("spawn")
        self.processes = processes             # readers per set
        self._lock = threading.Lock()          # the generation and its futures
        self._ids = itertools.count()
        self._closed = False
        self._generation = self._spawn()

    def _spawn(self) -> "_Generation":
        gen = _Generation(self._ctx, self._collect)
        gen.procs = [self._ctx.Process(target=_serve, args=(gen.task_r, gen.task_lock,
                                                            gen.result_w, gen.result_lock),
                                       name=f"adpkv-io-{i}", daemon=True) for i in range(self.processes)]
        for proc in gen.procs:
            proc.start()
        gen.collector.start()
        return gen

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every reader of the current set has started."""
        return self._generation.ready.wait(timeout)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if kwargs:
            raise TypeError("ReaderPool tasks take positional arguments only")
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the reader pool is shut down")
            gen, task_id = self._generation, next(self._ids)
            gen.futures[task_id] = fut
        try:
            with gen.send_lock:             # outside self._lock: a full pipe waits for readers, not the collector
                gen.task_w.send((task_id, fn, args))
        except OSError as exc:              # the generation was torn down meanwhile
            with self._lock:
                gen.futures.pop(task_id, None)
            if not fut.done():
                fut.set_exception(exc)
        return fut

    def _collect(self, gen: "_Generation") -> None:
        """Hand results to their futures; on a reader's death, fail everything and start anew."""
        sentinels = [p.sentinel for p in gen.procs]
        while True:
            ready = wait([gen.result_r] + sentinels)
            if gen.result_r in ready:
                msg = gen.result_r.recv()
                if msg is None:
                    return                      # shut down
                task_id, ok, value = msg
                if task_id is None:
                    gen.started += 1
                    if gen.started == len(gen.procs):
                        gen.ready.set()
                    continue
                with self._lock:
                    fut = gen.futures.pop(task_id, None)
                if fut is not None:
                    fut.set_result(value) if ok else fut.set_exception(value)
                continue
            if self._closed:
                return                          # readers leaving at shutdown
            with self._lock:                    # a reader died: all go, then a fresh set
                for p in gen.procs:
                    p.kill()
                for p in gen.procs:
                    p.join()
                dead = [f"{p.name} (exit {p.exitcode})" for p in gen.procs if p.sentinel in ready]
                pending, gen.futures = list(gen.futures.values()), {}
                if not self._closed:
                    logger.error("gateway I/O process %s died: %d pending read tasks fail (misses); "
                                 "the I/O processes start again", ", ".join(dead), len(pending))
                    self._generation = self._spawn()
            gen.close()
            for fut in pending:
                fut.set_exception(RuntimeError("a gateway I/O process died"))
            return

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            gen = self._generation
        with gen.send_lock:
            for _ in gen.procs:
                gen.task_w.send(None)
        if wait:
            for p in gen.procs:
                p.join()
        gen.result_w.send(None)
        gen.collector.join()
        if wait:
            gen.close()
        for fut in gen.futures.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the reader pool is shut down"))


class _Generation:
    """One set of readers: their pipes and locks, the futures of the tasks sent to them."""

    def __init__(self, ctx, collect: Callable[["_Generation"], None]):
        self.task_r, self.task_w = ctx.Pipe(duplex=False)
        self.result_r, self.result_w = ctx.Pipe(duplex=False)
        self.task_lock, self.result_lock = ctx.Lock(), ctx.Lock()
        self.send_lock = threading.Lock()
        self.futures: dict[int, Future] = {}
        self.procs: list = []
        self.collector = threading.Thread(target=collect, args=(self,), name="adpkv-io-results", daemon=True)
        self.started = 0                        # readers that started
        self.ready = threading.Event()
        try:
            fcntl.fcntl(self.task_w.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (OSError, AttributeError):
            pass                                # the default pipe size: submits wait sooner

    def close(self) -> None:
        for end in (self.task_r, self.task_w, self.result_r, self.result_w):
            end.close()


def start(processes: int) -> ReaderPool:
    """A pool of ``processes`` readers. They open each engine's ring through the gateway's
    descriptor (``/proc/<pid>/fd/<n>``) when a task first names it."""
    pool = ReaderPool(processes)
    if not pool.wait_ready(READY_TIMEOUT_S):          # started now, not on the first restore
        logger.warning("gateway I/O processes: not all %d started within %d s", processes,
                       READY_TIMEOUT_S)
    return pool

