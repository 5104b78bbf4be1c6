"""Transfers: the life of GET and PUT jobs, batch by batch, between the cards and the ring.

A job (``jobs.DataJob``) is one request of one rank, or of every rank of a collective.
It runs as batches of ring extents (at most half the ring each, two in flight per job),
so the ring never limits a request. Each batch goes through its stages in order; one
stage ends when its work (card I/O, the ranks' copies, a region copy) is all done, and
``_advance`` then starts the next — the only place that moves a batch on:

    GET:  LOOKUP (``store.plan_reads``: which card holds each object, its fragments'
          reads) -> READ (card -> ring, checked; a card with ``direct_reads`` straight into
          the engine's region) -> TO_RANKS (BATCH; every rank copies out and RELEASEs)
             or TO_REGION (the gateway pwrites into the engine's region)  -> RETIRED
    PUT:  FILL (BATCH; every rank fills and answers FILLED; none for a region)
          -> WRITE (``store.put``: which objects exist already, and ring -> cards of the
             others; from a region: a card with ``direct_writes`` reads the object from the
             region's descriptor itself, one copy; any other card gets it through the ring,
             preadv into the slot, then written)  -> RETIRED

``batch.flags`` carries one byte per object through the stages: found / still good
(GET), in the ring / stored (PUT). At RETIRED they become the job's results, the ring
extent is freed, waiting jobs get extents, and a job with no batch left and none to
open answers DONE to its participants (``_finish``, from ``_pump``: after ``start`` and
``_retire``). BATCH and DONE go to the ranks straight from here, through the data path's
sender (``replies.Replies``: ``batch``, ``done``), which answers the ranks it reached.

Everything here runs on the gateway loop's thread; card I/O runs on the pool (or the
I/O processes) through ``run`` and comes back to ``_io_done`` on the loop. Transfers never
touches a card: every card call, the choice of what a card can do, and their accounting
are the store's (``store.ObjectStore``). The copies
between the cards or the ring and a client's region are ``region_io.py``'s.

Rings: every engine has a ring of its own (``ring_alloc.EngineRing``, made by ``engine_ring``
the first time the engine needs it: its first rank's RING at the door, or its first data
request), and a job moves only through the ring of the engine that asked (``job.ring``).
When the engine detaches, ``retire_ring`` stops every batch from starting on its ring (its
jobs, whose ranks are all gone, end with what they had); the gateway unmaps the ring when
the last batch holding an extent of it retires.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from concurrent.futures import Executor
from typing import Callable, Optional

from adpkv_core.wire import protocol as P
from adpkv_core.memory.ring import Ring, align_up

from adpkv_gateway.datapath import io_procs
from adpkv_gateway.datapath.handoff import RunOnPool
from adpkv_gateway.datapath.jobs import Batch, DataJob, RegionTarget, ScatterTarget, Stage
from adpkv_gateway.observe.latency import LatencyBuckets
from adpkv_gateway.datapath.region_io import RegionSource, RingSource, direct_reads, to_region
from adpkv_gateway.datapath.replies import Replies
from adpkv_gateway.datapath.ring_alloc import EngineRing
from adpkv_gateway.datapath.scatter import ScatterSource, to_scatter
from adpkv_gateway.datapath.writing import Writing
from adpkv_gateway.store.card_io import NoProcessRead, Outcome, PutSource, ReadInto
from adpkv_gateway.store.object_store import ObjectStore, PutItem, ReadPlan

logger = logging.getLogger("adpkv.gateway")

IO_TASK_ITEMS = 16        # fragments (reads) or objects (writes) per pool task


# How a stage's per-object I/O results combine into the batch's flags.
_CLEARS = {Stage.READ, Stage.TO_REGION}        # an object that failed is no longer good
_SETS = {Stage.WRITE}                          # the result says whether the object made it


class Transfers:
    """The jobs and batches in flight, and the ring extents they hold.

    ``pool`` runs the card I/O, ``lookups`` a GET's lookup stage (``ObjectStore.plan_reads``:
    a restore waits for it, so it never queues behind the writes of earlier stores);
    ``writing`` holds the keys of the batches in their WRITE stage (``writing.Writing``): a
    GET's lookup stage naming one of them waits for its writes (an EXIST does not);
    ``run(executor, work, then, fail)`` runs ``work()`` on an executor and calls ``then(result)``
    (or ``fail(exc)``) back on the loop; ``replies`` sends BATCH and DONE to the ranks still
    attached (``replies.Replies``); ``unpin(identity, keys)`` drops a rank's pins on keys (a
    GET with ``unlock``); ``make_ring()`` creates a fresh ring of ``ring_size`` bytes
    (``Ring.create``) for an engine.
    """

    def __init__(self, ring_size: int, make_ring: Callable[[], Ring], store: ObjectStore, pool: Executor,
                 lookups: Executor, procs: Optional[io_procs.ReaderPool], io_threads: int, run: RunOnPool,
                 replies: Replies,
                 unpin: Callable[[bytes, list], None]):
        self.ring_size = align_up(ring_size)
        self._make_ring = make_ring
        self.rings: dict[int, EngineRing] = {}       # by number: the rings still mapped here
        self._ring_numbers = itertools.count(1)
        self.max_batch_bytes = self.ring_size // 2
        self.store = store
        self.pool = pool
        self.lookups = lookups
        self.writing = Writing()
        self.procs = procs
        self.io_threads = io_threads
        self._run = run
        self._replies = replies
        self._unpin = unpin
        self.jobs: "collections.OrderedDict[int, DataJob]" = collections.OrderedDict()
        self.batches: dict[int, Batch] = {}
        # seconds from a request's arrival to its DONE, by op (the loop's thread only)
        self.request_latency = {P.Op.GET: LatencyBuckets(), P.Op.PUT: LatencyBuckets()}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ entry points
    def start(self, job: DataJob) -> None:
        self.jobs[id(job)] = job
        self._pump()

    def ack(self, identity: bytes, msg) -> None:
        """A rank's RELEASE (GET) or FILLED (PUT) of a batch it was given."""
        batch = self.batches.get(msg.batch)
        if batch is None or identity not in batch.waiting:
            raise P.ProtocolError(P.UNKNOWN_BATCH, f"batch {msg.batch} is not waiting for this rank")
        want = P.Release if batch.job.op is P.Op.GET else P.Filled
        if not isinstance(msg, want):
            raise P.ProtocolError(P.BAD_MESSAGE, f"batch {msg.batch} of a {batch.job.op} wants "
                                  f"{want.__struct_config__.tag}")
        self._rank_done(batch, identity, isinstance(msg, P.Release) or msg.ok)

    def rank_left(self, identity: bytes) -> None:
        """A rank detached: no batch waits for it any more (a PUT it did not fill stores nothing)."""
        for batch in list(self.batches.values()):
            if identity in batch.waiting:
                self._rank_done(batch, identity, filled=batch.job.op is P.Op.GET)

    # ------------------------------------------------------------------ rings
    def engine_ring(self, engine) -> EngineRing:
        """The ring of ``engine`` (an ``engines.EngineSession``), made now if it has none yet."""
        if engine.ring is None:
            number = next(self._ring_numbers)
            engine.ring = self.rings[number] = EngineRing(self._make_ring(), number)
            # its pages allocated off the loop; in use meanwhile they fault in as needed
            self._run(self.pool, engine.ring.ring.populate, lambda _: None, lambda _: None)
            logger.info("Ring %d of engine %s: %d bytes (a sealed memfd of its own)", number, engine.engine_id,
                        self.ring_size)
        return engine.ring

    def retire_ring(self, ring: EngineRing) -> None:
        """Its engine detached: no batch starts on ``ring`` any more; unmapped once none holds it."""
        ring.retired = True
        self._pump()
        self._drop_if_idle(ring)

    def _drop_if_idle(self, ring: EngineRing) -> None:
        if ring.retired and ring.batches == 0 and self.rings.pop(ring.number, None) is not None:
            # freed off the loop, now, not by whichever process drops the last mapping (an I/O
            # process, at the next engine's first restore: Ring.discard)
            self._run(self.pool, ring.ring.discard, lambda _: None, lambda _: None)
            logger.info("Ring %d unmapped (its engine detached, nothing in flight uses it)", ring.number)

    def ring_in_use(self) -> int:
        """Bytes of ring extents held by batches now, over every ring."""
        return sum(r.alloc.in_use for r in self.rings.values())

    # ------------------------------------------------------------------ ring extents
    def _pump(self) -> None:
        """Give ring extents to jobs that want them, oldest first on each ring, restores before
        stores: a GET that finds no room holds back every later job of its ring (what is freed
        next is its own); a PUT, which may take only ``EngineRing.store_room`` (the stores'
        share of the ring), holds back only the later PUTs of its ring. So a store never keeps
        a returning prompt waiting for the ring while its card writes run. A job whose engine
        detached gets no extent any more: it ends with what its batches so far found or stored."""
        held: set[int] = set()            # rings whose later jobs wait (a GET found no room)
        stores_held: set[int] = set()     # rings whose later PUTs wait (a PUT found no room)
        for job in list(self.jobs.values()):
            ring = job.ring
            if ring.retired:
                job.next = job.n
            get = job.op is P.Op.GET
            while job.wants_more() and ring.number not in held and (get or ring.number not in stores_held):
                room = ring.alloc.largest_free() if get else ring.store_room()
                count = min(job.n - job.next, self.max_batch_bytes // job.stride, room // job.stride)
                if count <= 0:   # the ring is busy: wait for a release, keep the order
                    (held if get else stores_held).add(ring.number)
                    break
                nbytes = count * job.stride
                offset = ring.alloc.alloc(nbytes)
                assert offset is not None               # count fits the largest free extent
                batch = Batch(next(self._ids), job, job.next, count, offset, nbytes)
                ring.batches += 1
                if not get:
                    ring.store_bytes += nbytes
                job.next += count
                job.batches[batch.id] = batch
                self.batches[batch.id] = batch
                if get:
                    self._enter(batch, Stage.LOOKUP)
                elif job.target is not None:
                    batch.flags[:] = b"\x01" * count          # in the region: to be stored
                    self._enter(batch, Stage.WRITE)
                else:
                    self._enter(batch, Stage.FILL)
            if job.finished() and id(job) in self.jobs:
                self._finish(job)         # a request of no keys has no batch to retire

    def _slot(self, batch: Batch, j: int, offset: int = 0, length: Optional[int] = None) -> memoryview:
        """Bytes ``offset..offset+length`` of object ``j`` of a batch, in the ring."""
        return batch.job.ring.ring.slot(batch.object_offset(j) + offset,
                              batch.job.object_bytes if length is None else length)

    def _put_source(self, batch: Batch, j: int) -> PutSource:
        """Where object ``j`` of a PUT batch is: its ring slot (the ranks filled it), or a
        client's region (a card that writes from it reads it there, others get it through the
        slot), or pieces of several (gathered into the slot)."""
        job = batch.job
        i, slot, target = batch.first + j, self._slot(batch, j), job.target
        if target is None:
            return RingSource(slot)
        if isinstance(target, ScatterTarget):
            return ScatterSource(target.scatter, target.places[i], slot, job.region_by)
        return RegionSource(target.region, target.places[i], slot, job.region_by)

    # ------------------------------------------------------------------ stages
    def _enter(self, batch: Batch, stage: Stage) -> None:
        """Start ``stage`` of a batch; a stage with nothing to wait for advances at once."""
        batch.stage = stage
        job = batch.job
        keys = job.keys[batch.first:batch.first + batch.count]
        marks = job.marks[batch.first:batch.first + batch.count] if job.marks else None
        if stage is Stage.LOOKUP:
            batch.pending += 1
            into_region = isinstance(job.target, RegionTarget)     # a scattered GET goes through the ring
            self.writing.after(keys, lambda: self._run(
                self.lookups, lambda: self.store.plan_reads(keys, marks, job.object_bytes, into_region),
                lambda plan: self._looked_up(batch, plan), lambda exc: self._looked_up(batch, ReadPlan([], []))))
        elif stage is Stage.WRITE:
            items = []
            for j in range(batch.count):
                if batch.flags[j]:
                    i = batch.first + j
                    items.append(PutItem(j, job.keys[i], job.mark(i), self._put_source(batch, j)))
            batch.flags[:] = bytes(batch.count)
            batch.writes = [item.key for item in items]
            self.writing.begin(batch.id, batch.writes)
            self._submit(batch, lambda group: self.store.put(group, job.object_bytes), items)
        elif stage in (Stage.TO_RANKS, Stage.FILL):
            batch.waiting = self._replies.batch(batch)          # BATCH to the ranks still attached
            if stage is Stage.FILL and not batch.waiting:
                batch.filled = False
        elif stage is Stage.TO_REGION:
            target, by = job.target, job.region_by
            assert target is not None         # TO_REGION is a region or scattered GET's stage
            copies = [(j, self._slot(batch, j), target.places[batch.first + j])
                      for j in range(batch.count) if batch.flags[j] and j not in batch.direct]
            if isinstance(target, ScatterTarget):
                self._submit(batch, lambda group: to_scatter(target.scatter, group, by), copies)
            else:
                self._submit(batch, lambda group: to_region(target.region, group, by), copies)
        if batch.pending == 0 and not batch.waiting:
            self._advance(batch)

    def _advance(self, batch: Batch) -> None:
        """The batch's current stage is complete: go on to the next."""
        job, stage = batch.job, batch.stage
        if stage is Stage.READ:
            self.store.count_reads(job.namespace, sum(batch.flags), batch.count, job.object_bytes)
            self._enter(batch, Stage.TO_REGION if job.target is not None else Stage.TO_RANKS)
        elif stage is Stage.FILL:
            if batch.filled:
                batch.flags[:] = b"\x01" * batch.count
            else:
                batch.flags[:] = bytes(batch.count)      # a rank did not fill its part: store none
            if any(batch.flags):
                self._enter(batch, Stage.WRITE)
            else:
                self._retire(batch)
        elif stage is Stage.WRITE:
            self.writing.end(batch.id, batch.writes)
            self._retire(batch)
        elif stage in (Stage.TO_RANKS, Stage.TO_REGION):
            self._retire(batch)

    def _looked_up(self, batch: Batch, plan: ReadPlan) -> None:
        """A GET's LOOKUP is done: ``plan`` has the fragments to read of every object found
        (none when the lookup failed: all miss); start them (READ)."""
        batch.pending -= 1
        job = batch.job
        first, flags, base, stride = batch.first, batch.flags, batch.offset, job.stride
        for j in plan.found():
            flags[j] = 1
        reads = [(j, f, base + j * stride + f.offset) for j, f in plan.ring]   # (j, fragment, ring offset)
        batch.direct.update(j for j, _ in plan.direct)
        batch.stage = Stage.READ
        if self.procs:
            reads = self._read_in_processes(batch, reads)
        slot = job.ring.ring.slot
        self._submit(batch, self.store.io.read_many, [ReadInto(j, f, slot(at, f.length)) for j, f, at in reads])
        target, write_by = job.target, job.region_by
        if plan.direct and isinstance(target, RegionTarget):    # only a region GET asks for direct reads
            # card -> the engine's region in one copy, by its descriptor (no ring)
            direct = [(j, f, target.places[first + j] + f.offset) for j, f in plan.direct]
            self._submit(batch, lambda group: direct_reads(self.store, target.region, group, write_by), direct)
        if batch.pending == 0:
            self._advance(batch)

    def _rank_done(self, batch: Batch, identity: bytes, filled: bool) -> None:
        """A rank is done with a batch (released it, filled it, or left)."""
        batch.waiting.discard(identity)
        if not filled:
            batch.filled = False
        if not batch.waiting and batch.pending == 0:
            self._advance(batch)

    def _retire(self, batch: Batch) -> None:
        """The batch is done with the ring: its flags become results, its extent is freed,
        and its job moves on (or finishes)."""
        job = batch.job
        batch.stage = Stage.RETIRED
        job.results[batch.first:batch.first + batch.count] = batch.flags
        if job.op is P.Op.PUT:
            self.store.count_writes(job.namespace, sum(batch.flags), batch.count, job.object_bytes)
        job.ring.alloc.free(batch.offset, batch.nbytes)
        job.ring.batches -= 1
        if job.op is P.Op.PUT:
            job.ring.store_bytes -= batch.nbytes
        del job.batches[batch.id]
        del self.batches[batch.id]
        self._drop_if_idle(job.ring)
        self._pump()
        if job.finished() and id(job) in self.jobs:
            self._finish(job)

    def _finish(self, job: DataJob) -> None:
        del self.jobs[id(job)]
        self.request_latency[job.op].add(time.monotonic() - job.started)
        answered = self._replies.done(job)                      # DONE to the ranks still attached
        if job.op is P.Op.GET and job.unlock:
            for identity in answered:
                self._unpin(identity, job.keys)

    # ------------------------------------------------------------------ I/O on the pool
    def _submit(self, batch: Batch, work, items: list) -> None:
        """Run ``work(group)`` on the pool for each group of a batch's I/O items: few tasks,
        one per thread at most ``IO_TASK_ITEMS`` items, keep the loop and the GIL out of the
        way of the I/O itself."""
        if not items:
            return
        per = min(IO_TASK_ITEMS, -(-len(items) // self.io_threads))
        for k in range(0, len(items), per):
            group = items[k:k + per]
            batch.pending += 1
            self._run(self.pool, functools.partial(work, group), functools.partial(self._io_done, batch),
                      functools.partial(self._io_failed, batch, group))

    def _io_failed(self, batch: Batch, items: list, exc: BaseException) -> None:
        """An I/O task of the batch's stage raised: each of its ``items`` (object ``j`` first)
        failed."""
        self._io_done(batch, [Outcome(item[0], False) for item in items])

    def _io_done(self, batch: Batch, results: list[Outcome]) -> None:
        """One I/O task of the batch's stage finished with an ``Outcome`` per object."""
        batch.pending -= 1
        if batch.stage in _CLEARS:
            for r in results:
                if not r.ok:
                    batch.flags[r.j] = 0
        elif batch.stage in _SETS:
            existed = batch.job.existed
            for r in results:
                batch.flags[r.j] = 1 if r.ok else 0
                if r.existed:
                    existed[batch.first + r.j] = 1
        if batch.pending == 0 and not batch.waiting:
            self._advance(batch)

    def _read_in_processes(self, batch: Batch, reads: list) -> list:
        """Hand the ``(j, fragment, ring offset)`` reads that a card can do in the I/O
        processes to them (fs cards; each card's tasks made in one call), one ``ReadTask``
        per process and card: every reader busy with the batch at once, and as few tasks
        to send and account for as that allows; return the others for the pool."""
        rest = []
        by_card: dict[int, list] = collections.defaultdict(list)
        for read in reads:
            by_card[read[1].card].append(read)
        procs = self.procs
        assert procs is not None                        # the caller checked it
        for card, group in by_card.items():
            kept: list = []                            # (read, the card's FileRead) for the processes
            for read, how in zip(group, self.store.io.process_reads(card, [frag for _, frag, _ in group])):
                if how is NoProcessRead.HERE:
                    rest.append(read)
                elif how is NoProcessRead.ABSENT:        # the card knows the object is gone
                    batch.flags[read[0]] = 0
                else:
                    kept.append((read, how))
            per = max(1, -(-len(kept) // procs.processes))
            for k in range(0, len(kept), per):
                part, files = [read for read, _ in kept[k:k + per]], [how for _, how in kept[k:k + per]]
                task = io_procs.ReadTask.of(files, [at for _, _, at in part], [frag.length for _, frag, _ in part],
                                            batch.job.ring, min(self.rings))
                batch.pending += 1
                self._run(procs, functools.partial(io_procs.read_task, task),
                          functools.partial(self._process_reads_done, batch, card, part, files, task),
                          functools.partial(self._io_failed, batch, part))
        return rest

    def _process_reads_done(self, batch: Batch, card: int, part: list, files: list, task: "io_procs.ReadTask",
                            result: tuple) -> None:
        """An I/O process ran ``task`` (``part``'s reads of one card, the card's ``files``):
        its missed reads' ``(k, verdict)`` and every read's seconds, accounted by the store
        (``process_reads_done``). A read that missed goes to the object's next replica on the
        pool, as ``CardIO.read_many`` does there."""
        misses, seconds = result
        self.store.io.process_reads_done(card, files, task.lengths, misses, seconds)
        done, again = [], []
        for k, _ in misses:
            j, frag, offset = part[k]
            if frag.others:
                again.append(ReadInto(j, frag, batch.job.ring.ring.slot(offset, frag.length)))
            else:
                done.append(Outcome(j, False))
        if again:
            self._submit(batch, self.store.io.read_from_replicas, again)
        self._io_done(batch, done)
