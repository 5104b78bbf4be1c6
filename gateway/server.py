"""The gateway process: one loop for control, a thread pool for card I/O.

All request state lives in the loop's thread. Everything that touches a card
(data, but also EXIST, DELETE, CLEAN and the usage behind STATS and the status
file) runs on the pool and reports back through a completion queue that wakes
the loop: one slow card never stalls another engine's control messages.

Who may do what: a control-port request is served only on a session from the
door (``gateway/door.py``); an engine belongs to the uid that attached it first,
and only an operator cleans.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Union

import zmq

from adpkv_core import protocol as P
from adpkv_core.door import SHM_DIR, door_path
from adpkv_core.ring import MEMFD_NAME_PREFIX, Ring, max_parallel_ios, object_stride

from . import io_procs
from .cards import CardUsage, FsCard, open_cards
from .config import GatewayConfig, socket_mode
from .door import DoorServer, Session, claim_door
from .engines import EngineRegistry, Peer
from .health import HealthMonitor
from .jobs import Batch, DataJob, Participant
from .ring_alloc import RingAllocator
from .status import render_status, write_status_file
from .store import ObjectStore

logger = logging.getLogger("adpkv.gateway")

MAX_FRAME_BYTES = 128 << 20   # a request of protocol.MAX_KEYS keys with marks fits
IO_TASK_ITEMS = 16        # fragments (reads) or objects (writes) per thread-pool task


class Gateway:
    """Serves one engine's ranks on ``bind_address:port`` from the configured cards."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.started = time.time()
        # First of all, before any card or shared memory is touched: own the door (and
        # so the port), or refuse to start. A second gateway on a busy port changes nothing.
        self.door_file = config.control_socket or door_path(config.port)
        self._door_lock = claim_door(self.door_file)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            self.sock.bind(f"tcp://{config.bind_address}:{config.port}")
        except zmq.ZMQError as exc:
            self.sock.close(0)
            self.ctx.term()
            raise SystemExit(f"cannot listen on {config.bind_address}:{config.port}: {exc}") from None
        _remove_legacy_ring(config.port)
        holder: dict = {}
        cards = open_cards(config, is_pinned=lambda key: holder["store"].is_pinned(key))
        self.store = holder["store"] = ObjectStore(cards, config.storage_slots, config.num_dbs,
                                                   config.key_placement, config.fragment_size,
                                                   config.fragment_spread_across_dbs, config.replicas)
        self.health = HealthMonitor(self.store, config.io_timeout_ms, config.io_timeout_strikes)
        logger.info("Key layout fingerprint %s", self.store.fingerprint)
        all_known = all(c.serial for c in cards)
        if config.key_layout_fingerprint and config.key_layout_fingerprint != self.store.fingerprint:
            if all_known:
                raise SystemExit(f"key layout fingerprint {self.store.fingerprint} differs from the configured "
                                 f"key_layout_fingerprint {config.key_layout_fingerprint}: this gateway would "
                                 "place keys elsewhere than its peers; refusing to start")
            logger.warning("Not every card answered: the key layout fingerprint is checked when they join")
            self.health.expected_fingerprint = config.key_layout_fingerprint
        for card in cards:
            if card.serial:
                logger.info("Card %s (%s %s) Group Health: active", card.serial, card.kind, card.device)
        logger.info("Key placement %s over %d slots, %d database(s) per card, %d replica(s)",
                    config.key_placement, config.storage_slots, config.num_dbs, config.replicas)
        if int(config.start_clean):
            logger.info("start_clean: removed %d objects", self.store.clean())
        self.ring = Ring.create(config.port, config.shared_memory_size)
        self.alloc = RingAllocator(self.ring.size)
        logger.info("Ring %s: %d bytes (a sealed memfd, handed out at the door)", self.ring.name, self.ring.size)
        self.object_sizes_logged: set[int] = set()
        self.pool = ThreadPoolExecutor(config.thread_pool_size, thread_name_prefix="adpkv-io")
        self.procs = io_procs.start(config.io_processes, self.ring) if config.io_processes else None
        if self.procs:
            logger.info("fs card reads run in %d I/O processes", config.io_processes)
        self.health.start()
        self.engines = EngineRegistry(config.engine_timeout_s)
        self.done_q: "queue.SimpleQueue" = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        self.sessions_by_peer: dict[bytes, Session] = {}
        self.door = DoorServer(self.door_file, socket_mode(config), config.control_socket_group,
                               config.operator_group, self.ring,
                               register=lambda fd: self.poller.register(fd, zmq.POLLIN),
                               unregister=self.poller.unregister, on_session_closed=self._on_session_closed)
        self.status_writing = False
        self.jobs: "collections.OrderedDict[int, DataJob]" = collections.OrderedDict()
        self.batches: dict[int, Batch] = {}
        self.collectives: dict[str, dict[int, tuple[bytes, dict]]] = {}
        self.ids = itertools.count(1)
        self.counters = collections.Counter()
        self.stopping = False
        self.max_batch_bytes = self.ring.size // 2
        logger.info("Gateway listening on %s:%d", config.bind_address, config.port)

    # ================================================================ the loop
    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        next_tick = 0.0
        try:
            while not self.stopping:
                for what, _ in self.poller.poll(200):
                    if isinstance(what, int) and what != self.wake_r:
                        self.door.on_readable(what)
                self._drain_completions()
                for _ in range(1000):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
                    self._drain_completions()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + 1.0
                    self._tick()
        finally:
            self._shutdown()

    def stop(self) -> None:
        self.stopping = True
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _tick(self) -> None:
        for ident in self.engines.expired():
            self._detach(ident, f"no message for {self.config.engine_timeout_s:.0f} s")
        if self.config.status_file and not self.status_writing:
            self.status_writing = True
            self._collect_stats(self._write_status)

    def _write_status(self, stats: dict) -> None:
        """Render and write the status file on the pool (a slow disk never stalls the loop)."""
        def write():
            try:
                write_status_file(self.config.status_file, render_status(stats))
            except OSError as exc:
                logger.warning("cannot write the status file %s: %s", self.config.status_file, exc)

        self._offload(write, lambda _: setattr(self, "status_writing", False))

    def _shutdown(self) -> None:
        logger.info("Gateway stopping: finishing card I/O in flight")
        self.pool.shutdown(wait=True)
        if self.procs:
            self.procs.shutdown(wait=True)
        self.health.stop()
        self._drain_completions()
        if self.config.status_file:
            try:
                write_status_file(self.config.status_file, render_status(self._merge_stats(
                    self._loop_stats(), self._card_usages())))
            except OSError:
                pass
        self.door.close()
        self.sock.close(0)
        self.ctx.term()
        for card in self.store.cards:
            card.close()
        self.ring.close()
        logger.info("Gateway stopped")

    # ================================================================ messages
    def _send(self, identity: bytes, msg: P.Message) -> None:
        try:
            self.sock.send_multipart([identity, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("reply to a gone peer dropped: %s", exc)

    def _on_frames(self, frames: list) -> None:
        if len(frames) != 2:
            if frames:
                self._send(frames[0], P.error(None, P.BAD_MESSAGE, f"expected one frame, got {len(frames) - 1}"))
            return
        identity, frame = frames
        req_id = None
        try:
            try:
                msg = P.decode_request(frame)
            except P.ProtocolError:
                req_id = P.request_id(frame)
                raise
            req_id = msg.id
            peer = self.engines.seen(identity)
            if peer is None and not isinstance(msg, (P.Hello, P.Ping, P.Stats, P.Clean)):
                raise P.ProtocolError(P.NOT_ATTACHED, f"{msg.op} before HELLO")
            self._handlers[type(msg)](self, identity, peer, msg)
        except zmq.ZMQError:
            raise
        except P.ProtocolError as exc:
            self.counters["bad_requests"] += 1
            logger.warning("Refused a request from %s: %s", identity.hex(), exc)
            self._send(identity, P.error(req_id, exc.code, exc.message))
        except Exception as exc:  # a bug must not take the gateway down for everyone
            logger.exception("Internal error on a request")
            self._send(identity, P.error(req_id, P.INTERNAL, str(exc)))

    def _session(self, identity: bytes, msg: Union[P.Hello, P.Stats, P.Clean]) -> Session:
        """The door session behind a request: the one its connection attached with, or the
        one its ``session`` token names. FORBIDDEN without one."""
        session = self.sessions_by_peer.get(identity)
        if session is not None:
            return session
        session = self.door.by_token.get(msg.session) if msg.session is not None else None
        if session is None:
            raise P.ProtocolError(P.FORBIDDEN, f"{msg.op} needs a session: connect through the door "
                                  f"{self.door_file} first (its permissions say who may)")
        return session

    def _on_hello(self, identity, peer, msg: P.Hello):
        session = self._session(identity, msg)
        self.engines.attach(identity, msg, session.uid)
        self.sessions_by_peer[identity] = session
        session.identities.add(identity)
        self._send(identity, P.HelloOk(id=msg.id, ring_size=self.ring.size, max_batch_bytes=self.max_batch_bytes))

    def _on_session_closed(self, session: Session) -> None:
        """A client's door closed (it exited, or closed its client): what it attached goes now."""
        for identity in list(session.identities):
            self._detach(identity, "its process closed its session")

    def _on_bye(self, identity, peer, msg: P.Bye):
        self._send(identity, P.Ok(id=msg.id))
        self._detach(identity, "closed")

    def _on_ping(self, identity, peer, msg: P.Ping):
        self._send(identity, P.Ok(id=msg.id))

    def _on_exist(self, identity, peer: Peer, msg: P.Exist):
        keys = msg.keys
        self.counters["exist_requests"] += 1

        def answer(hits):
            if msg.lock and self.engines.peers.get(identity) is peer:
                locked = [k for k, h in zip(keys, hits) if h]
                self.store.pin(locked)
                peer.pins.update(locked)
            self._send(identity, P.ExistOk(id=msg.id, hits=P.pack_flags(hits)))

        self._offload(lambda: self.store.exists(keys, msg.marks), answer, identity, msg)

    def _on_unlock(self, identity, peer: Peer, msg: P.Unlock):
        self._release_pins(peer, msg.keys)
        self._send(identity, P.Ok(id=msg.id))

    def _release_pins(self, peer: Peer, keys) -> None:
        mine = [k for k in keys if peer.pins.get(k)]
        for k in mine:
            peer.pins[k] -= 1
            if peer.pins[k] <= 0:
                del peer.pins[k]
        self.store.unpin(mine)

    def _on_delete(self, identity, peer, msg: P.Delete):
        self._offload(lambda: self.store.delete(msg.keys, msg.marks),
                      lambda deleted: self._send(identity, P.DeleteOk(id=msg.id, deleted=deleted)), identity, msg)

    def _on_clean(self, identity, peer, msg: P.Clean):
        session = self._session(identity, msg)
        if not session.operator:
            raise P.ProtocolError(P.FORBIDDEN, "only an operator cleans (root, the gateway's user, or "
                                  "operator_group); nothing was deleted")
        if self.config.shared_storage:
            logger.warning("CLEAN refused: shared_storage is set; nothing was deleted")
            raise P.ProtocolError(P.CLEAN_REFUSED, "shared_storage: the cards are shared, nothing was deleted")
        if self.jobs:
            raise P.ProtocolError(P.CLEAN_REFUSED, "requests are in flight; nothing was deleted")

        def cleaned(deleted):
            logger.info("CLEAN by uid %d: %d objects deleted", session.uid, deleted)
            self._send(identity, P.DeleteOk(id=msg.id, deleted=deleted))

        self._offload(self.store.clean, cleaned, identity, msg)

    def _on_stats(self, identity, peer, msg: P.Stats):
        session = self._session(identity, msg)
        engine = self.engines.engine
        shows_engine = session.operator or (engine is not None and engine.uid == session.uid)

        def answer(stats):
            if not shows_engine and stats["engine"] is not None:
                stats["engine"] = {"id": "(another user's)", "world": stats["engine"]["world"],
                                   "ranks": stats["engine"]["ranks"], "namespace": "(another user's)"}
            self._send(identity, P.StatsOk(id=msg.id, stats=stats))

        self._collect_stats(answer, identity, msg)

    # ================================================================ the pool, for card metadata
    def _offload(self, work, then, identity: Optional[bytes] = None, msg: Optional[P.Message] = None) -> None:
        """Run ``work()`` on the I/O pool; ``then(result)`` back on the loop. When ``work``
        fails, the request (``identity``, ``msg``), if any, gets an ERROR reply."""
        def done(fut: Future):
            self._complete(("call", (then, identity, msg), fut))
        self.pool.submit(work).add_done_callback(done)

    def _call_done(self, then, identity, msg, fut: Future) -> None:
        exc = fut.exception()
        if exc is not None:
            logger.error("card metadata request failed: %r", exc)
            if identity is not None:
                self._send(identity, P.error(msg.id, P.CARD_ERROR, f"the cards did not answer: {exc}"))
            return
        then(fut.result())

    # ================================================================ data requests
    def _on_data(self, identity, peer: Peer, msg: Union[P.Get, P.Put]):
        if peer.rank is None:
            raise P.ProtocolError(P.BAD_MESSAGE, f"a lookup peer cannot {msg.op}; attach as a rank")
        keys, marks, obj, tag, region = msg.keys, msg.marks, msg.obj, msg.tag, msg.region
        unlock = isinstance(msg, P.Get) and msg.unlock
        stride = object_stride(obj)
        if obj not in self.object_sizes_logged and len(self.object_sizes_logged) < 8:
            self.object_sizes_logged.add(obj)
            logger.info("Objects of %d bytes (io_size): max_parallel_ios = %d", obj,
                        max_parallel_ios(self.ring.size, obj))
        if stride > self.max_batch_bytes:
            raise P.ProtocolError(P.TOO_LARGE, f"an object of {obj} bytes does not fit half the ring "
                                  f"({self.max_batch_bytes} bytes); raise shared_memory_size")
        if region is not None:
            regions = self.sessions_by_peer[identity].regions
            if region >= len(regions):
                raise P.ProtocolError(P.BAD_REGION, f"region {region} is not registered by this session")
            job = DataJob(msg.op, keys, marks, obj, stride, [Participant(identity, msg.id)], unlock)
            job.region = regions[region]
            job.places = job.region.places(msg.at, obj)
            self.counters[job.op.lower() + "_region_requests"] += 1
            self._start(job)
            return
        engine = self.engines.engine
        if tag is None or engine is None or engine.world == 1:
            self._start(DataJob(msg.op, keys, marks, obj, stride, [Participant(identity, msg.id)], unlock))
            return
        parts = self.collectives.setdefault(tag, {})
        if peer.rank in parts:
            del self.collectives[tag]
            self._fail_collective(parts, f"rank {peer.rank} sent tag {tag!r} twice")
            raise P.ProtocolError(P.COLLECTIVE_MISMATCH, f"rank {peer.rank} sent tag {tag!r} twice")
        parts[peer.rank] = (identity, msg)
        if len(parts) < engine.world:
            return
        del self.collectives[tag]
        first = parts[0][1] if 0 in parts else next(iter(parts.values()))[1]
        for ident, m in parts.values():
            if type(m) is not type(first) or m.keys != first.keys or m.obj != first.obj:
                self._fail_collective(parts, f"ranks sent different requests for tag {tag!r}")
                return
        self._start(DataJob(msg.op, keys, marks, obj, stride,
                            [Participant(ident, m.id) for ident, m in parts.values()], unlock))

    def _fail_collective(self, parts, why: str) -> None:
        for ident, m in parts.values():
            self._send(ident, P.error(m.id, P.COLLECTIVE_MISMATCH, why))

    def _start(self, job: DataJob) -> None:
        self.counters[job.op.lower() + "_requests"] += 1
        self.jobs[id(job)] = job
        self._pump()

    def _open_batch(self, job: DataJob, count: int, offset: int, nbytes: int) -> Batch:
        """The job's next ``count`` objects as a batch at ring ``offset``."""
        batch = Batch(next(self.ids), job, job.next, count, offset, nbytes)
        job.next += count
        job.batches[batch.id] = batch
        self.batches[batch.id] = batch
        return batch

    def _pump(self) -> None:
        """Give ring extents to jobs that want them, oldest first."""
        for job in list(self.jobs.values()):
            while job.wants_more():
                largest = self.alloc.largest_free()
                count = min(job.n - job.next, self.max_batch_bytes // job.stride, largest // job.stride)
                if count <= 0:
                    return  # the ring is busy: wait for a release, keep the order
                nbytes = count * job.stride
                batch = self._open_batch(job, count, self.alloc.alloc(nbytes), nbytes)
                if job.op == "GET":
                    self._read_batch(batch)
                else:
                    self._offer_batch(batch)
            if job.finished():
                self._finish(job)

    def _batch_msg(self, batch: Batch, participant: Participant, with_hits: bool) -> P.Batch:
        return P.Batch(id=participant.req_id, batch=batch.id, first=batch.first, count=batch.count,
                       offset=batch.offset, stride=batch.job.stride, obj=batch.job.object_bytes,
                       hits=bytes(batch.flags) if with_hits else None)

    # ---------------------------------------------------------------- GET
    def _read_batch(self, batch: Batch) -> None:
        """Find the batch's objects on the pool, then read them (``_plan_reads``)."""
        job = batch.job
        batch.io_left += 1        # the lookup: nothing retires the batch meanwhile
        self._offload(lambda: self.store.holders(job.keys[batch.first:batch.first + batch.count],
                                                 job.marks[batch.first:batch.first + batch.count]
                                                 if job.marks else None, job.object_bytes),
                      lambda holders: self._plan_reads(batch, holders))

    def _plan_reads(self, batch: Batch, holders: list) -> None:
        job = batch.job
        batch.io_left -= 1
        reads = []
        for j, card in enumerate(holders):
            if card is None:
                continue
            frags = self.store.read_plan(card, job.keys[batch.first + j], job.object_bytes)
            batch.flags[j] = 1
            reads.extend((j, frag, self._slot(batch, j, frag.offset, frag.length)) for frag in frags)
        if self.procs:
            reads = self._read_in_processes(batch, reads)
        self._submit_io(batch, "read", self.store.read_many, reads)
        if batch.io_left == 0:
            self._read_done(batch)

    def _slot(self, batch: Batch, j: int, offset: int, length: int) -> memoryview:
        """Where bytes ``offset..offset+length`` of object ``j`` of a batch live in the ring."""
        return self.ring.slot(batch.object_offset(j) + offset, length)

    def _read_in_processes(self, batch: Batch, reads: list) -> list:
        """Hand the fs card reads of a batch to the I/O processes; return the other reads."""
        rest, items = [], []
        for j, frag, view in reads:
            card = self.store.cards[frag.card]
            if not isinstance(card, FsCard):
                rest.append((j, frag, view))
                continue
            path = card.locate(frag.fkey)
            if path is None:
                batch.flags[j] = 0
                continue
            offset = batch.object_offset(j) + frag.offset
            items.append((j, path, frag.fkey, offset, frag.length, card.o_direct, frag.card))
        for group in self._io_groups(items):
            batch.io_left += 1
            fut = self.procs.submit(io_procs.read_files, [g[:6] for g in group])
            fut.add_done_callback(lambda f, b=batch, g=group: self._complete(("pread", b, (f, g))))
        return rest

    def _submit_io(self, batch: Batch, kind: str, run, items: list) -> None:
        """Run ``run(group)`` on the thread pool for each group of a batch's I/O items."""
        for group in self._io_groups(items):
            batch.io_left += 1
            fut = self.pool.submit(run, group)
            fut.add_done_callback(lambda f, b=batch: self._complete((kind, b, f)))

    def _io_groups(self, items: list) -> list[list]:
        """Split a batch's I/O into one task per thread (at most IO_TASK_ITEMS items each):
        few tasks keep the loop and the GIL out of the way of the I/O itself."""
        if not items:
            return []
        per = min(IO_TASK_ITEMS, -(-len(items) // self.config.thread_pool_size))
        return [items[k:k + per] for k in range(0, len(items), per)]

    def _read_done(self, batch: Batch) -> None:
        job = batch.job
        hits = sum(batch.flags)
        self.store.counters["hits"] += hits
        self.store.counters["misses"] += batch.count - hits
        if job.region is not None:
            # the gateway copies the hits from the ring into the engine's region itself
            items = [(j, self._slot(batch, j, 0, job.object_bytes), job.places[batch.first + j])
                     for j in range(batch.count) if batch.flags[j]]
            self._submit_io(batch, "to_region", lambda group: _region_io(job.region, group, False), items)
            if batch.io_left == 0:
                self._region_copied(batch)
            return
        job.results[batch.first:batch.first + batch.count] = batch.flags
        batch.waiting = {p.identity for p in job.participants if p.identity in self.engines.peers}
        for p in job.participants:
            if p.identity in batch.waiting:
                self._send(p.identity, self._batch_msg(batch, p, with_hits=True))
        if not batch.waiting:
            self._retire(batch)

    # ---------------------------------------------------------------- PUT
    def _region_copied(self, batch: Batch) -> None:
        """A GET batch is in the engine's region (``flags``: the objects that got there)."""
        batch.job.results[batch.first:batch.first + batch.count] = batch.flags
        self._retire(batch)

    def _offer_batch(self, batch: Batch) -> None:
        job = batch.job
        if job.region is not None:
            # the gateway copies the objects from the engine's region into the ring itself
            items = [(j, self._slot(batch, j, 0, job.object_bytes), job.places[batch.first + j])
                     for j in range(batch.count)]
            self._submit_io(batch, "from_region", lambda group: _region_io(job.region, group, True), items)
            return
        batch.waiting = {p.identity for p in job.participants if p.identity in self.engines.peers}
        for p in job.participants:
            if p.identity in batch.waiting:
                self._send(p.identity, self._batch_msg(batch, p, with_hits=False))
        if not batch.waiting:
            batch.fill_ok = False
            self._write_batch(batch)

    def _write_batch(self, batch: Batch) -> None:
        job = batch.job
        if not batch.fill_ok:
            batch.flags[:] = bytes(batch.count)
            self._write_done(batch)
            return
        batch.io_left += 1        # the lookup: nothing retires the batch meanwhile
        self._offload(lambda: self.store.exists(job.keys[batch.first:batch.first + batch.count],
                                                job.marks[batch.first:batch.first + batch.count]
                                                if job.marks else None, job.object_bytes),
                      lambda existing: self._plan_writes(batch, existing))

    def _plan_writes(self, batch: Batch, existing: list) -> None:
        job = batch.job
        batch.io_left -= 1
        writes = []
        # from_region: only the objects the gateway copied in from the region are in the ring
        filled = bytes(batch.flags) if job.region is not None else b"\x01" * batch.count
        batch.flags[:] = bytes(batch.count)
        for j in range(batch.count):
            i = batch.first + j
            if not filled[j]:
                continue
            if existing[j]:
                # keys name content: an object stored under this key already holds these bytes
                batch.flags[j] = 1
                job.existed[i] = 1
                continue
            plans = self.store.write_plans(job.keys[i], job.mark(i), job.object_bytes)
            if plans:         # else no card in service for this key: not stored
                writes.append((j, plans, self._slot(batch, j, 0, job.object_bytes)))
        self._submit_io(batch, "write", self.store.write_many, writes)
        if batch.io_left == 0:
            self._write_done(batch)

    def _write_done(self, batch: Batch) -> None:
        stored = sum(batch.flags)
        self.store.counters["stored"] += stored
        self.store.counters["store_failed"] += batch.count - stored
        batch.job.results[batch.first:batch.first + batch.count] = batch.flags
        self._retire(batch)

    # ---------------------------------------------------------------- RELEASE / FILLED
    def _on_ack(self, identity, peer, msg: Union[P.Release, P.Filled]):
        batch = self.batches.get(msg.batch)
        if batch is None or identity not in batch.waiting:
            raise P.ProtocolError(P.UNKNOWN_BATCH, f"batch {msg.batch} is not waiting for this rank")
        want = P.Release if batch.job.op == "GET" else P.Filled
        if not isinstance(msg, want):
            raise P.ProtocolError(P.BAD_MESSAGE, f"batch {msg.batch} of a {batch.job.op} wants "
                                  f"{want.__struct_config__.tag}")
        self._rank_done(batch, identity, isinstance(msg, P.Release) or msg.ok)

    def _rank_done(self, batch: Batch, identity: bytes, filled_ok: bool) -> None:
        """A rank is done with a batch (released it, filled it, or left); once none is left
        waiting, a GET batch frees its ring extent and a PUT batch goes to the cards."""
        batch.waiting.discard(identity)
        if not filled_ok:
            batch.fill_ok = False
        if not batch.waiting:
            if batch.job.op == "GET":
                self._retire(batch)
            else:
                self._write_batch(batch)

    def _retire(self, batch: Batch) -> None:
        """The batch is done with the ring: free its extent and move its job on."""
        job = batch.job
        if batch.nbytes:
            self.alloc.free(batch.offset, batch.nbytes)
        del job.batches[batch.id]
        del self.batches[batch.id]
        self._pump()
        if job.finished() and id(job) in self.jobs:
            self._finish(job)

    def _finish(self, job: DataJob) -> None:
        if self.jobs.pop(id(job), None) is None:
            return  # finished already
        for p in job.participants:
            if p.identity in self.engines.peers:
                if job.op == "GET" and job.unlock:
                    self._release_pins(self.engines.peers[p.identity], job.keys)
                if job.op == "GET":
                    self._send(p.identity, P.Done(id=p.req_id, hits=bytes(job.results)))
                else:
                    self._send(p.identity, P.Done(id=p.req_id, stored=bytes(job.results),
                                                  existed=bytes(job.existed)))

    # ---------------------------------------------------------------- completions
    def _complete(self, item) -> None:
        self.done_q.put(item)
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _drain_completions(self) -> None:
        try:
            while os.read(self.wake_r, 65536):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                kind, batch, fut = self.done_q.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                self._call_done(*batch, fut)
                continue
            if kind == "pread":
                kind, fut = "read", self._process_read_results(*fut)
            batch.io_left -= 1
            if fut.exception() is not None:
                logger.error("card I/O task failed: %r", fut.exception())
                results = []
            else:
                results = fut.result()
            if kind in ("read", "to_region"):
                # a failed task clears all its batch's flags: nothing it touched counts
                for j, ok in results:
                    if not ok:
                        batch.flags[j] = 0
                if fut.exception() is not None:
                    batch.flags[:] = bytes(batch.count)
                if batch.io_left == 0:
                    (self._read_done if kind == "read" else self._region_copied)(batch)
            else:     # write, from_region: the flags say which objects made it
                for j, ok in results:
                    batch.flags[j] = 1 if ok else 0
                if batch.io_left == 0:
                    (self._write_done if kind == "write" else self._write_batch)(batch)

    def _process_read_results(self, fut, group) -> Future:
        """Turn an I/O process's ``(j, problem, seconds)`` list into ``(j, ok)``, with the
        statistics and health strikes of each read, as the thread path keeps them."""
        done: Future = Future()
        if fut.exception() is not None:
            logger.error("I/O process failed: %r", fut.exception())
            done.set_result([(g[0], False) for g in group])
            return done
        results = []
        for (j, path, fkey, _, length, _, card), (_, problem, seconds) in zip(group, fut.result()):
            ok = self.store.cards[card].read_result(fkey, path, problem)
            self.store.stats[card].record(False, ok, length, seconds)
            self.store.on_io(card, problem is None or not problem.startswith("I/O error"), seconds)
            results.append((j, ok))
        done.set_result(results)
        return done

    # ---------------------------------------------------------------- detach
    def _detach(self, identity: bytes, why: str) -> None:
        peer = self.engines.detach(identity, why)
        if peer is None:
            return
        session = self.sessions_by_peer.pop(identity, None)
        if session is not None:
            session.identities.discard(identity)
        if peer.rank is None:
            self.store.unpin(list(peer.pins.elements()))
            return
        self.store.unpin(list(peer.pins.elements()))
        # a collective needs every rank: none that is still waiting can complete now
        for tag, parts in list(self.collectives.items()):
            del self.collectives[tag]
            self._fail_collective({r: v for r, v in parts.items() if v[0] != identity},
                                  f"rank {peer.rank} left before the collective {tag!r} was complete")
        for batch in list(self.batches.values()):
            if identity in batch.waiting:
                self._rank_done(batch, identity, filled_ok=batch.job.op == "GET")

    # ---------------------------------------------------------------- stats
    def _collect_stats(self, then, identity: Optional[bytes] = None, msg: Optional[dict] = None) -> None:
        """``then(stats)`` on the loop: the loop's own state now, the cards' usage from the pool."""
        snapshot = self._loop_stats()
        self._offload(self._card_usages, lambda usages: then(self._merge_stats(snapshot, usages)),
                      identity, msg)

    def _card_usages(self) -> list[CardUsage]:
        return [card.usage() if active else CardUsage(0, 0, 0)
                for card, active in zip(self.store.cards, self.store.active)]

    def _merge_stats(self, stats: dict, usages: list[CardUsage]) -> dict:
        for c, u in zip(stats["cards"], usages):
            c.update(used_bytes=u.used_bytes, capacity_bytes=u.capacity_bytes, objects=u.objects)
        return stats

    def _loop_stats(self) -> dict:
        """Everything STATS shows but the cards' usage (see ``_collect_stats``)."""
        cards = []
        for card, st, active in zip(self.store.cards, self.store.stats, self.store.active):
            cards.append({"serial": card.serial or card.device, "device": card.device, "kind": card.kind,
                          "active": bool(active), "oldest_io_age_s": st.oldest_io_age(),
                          "reads": st.reads, "writes": st.writes, "bytes_read": st.bytes_read,
                          "bytes_written": st.bytes_written, "read_errors": st.read_errors,
                          "write_errors": st.write_errors, "io_seconds": st.io_seconds,
                          "io_count": st.io_count, "io_max_seconds": st.io_max_s,
                          "evicted": getattr(card, "evicted", 0)})
        engine = self.engines.engine
        return {
            "port": self.config.port, "uptime_s": time.time() - self.started,
            "fingerprint": self.store.fingerprint, "placement": self.config.key_placement,
            "storage_slots": self.config.storage_slots, "num_dbs": self.config.num_dbs,
            "shared_storage": bool(self.config.shared_storage), "replicas": self.store.replicas,
            "ring_size": self.ring.size, "ring_in_use": self.alloc.in_use,
            "requests_in_flight": len(self.jobs), "pinned": self.store.pinned_count(),
            "regions": sum(len(s.regions) for s in self.door.sessions.values()),
            "sessions": len(self.door.sessions),
            "engine": None if engine is None else {"id": engine.engine_id, "world": engine.world,
                                                   "ranks": sorted(engine.ranks), "namespace": engine.namespace},
            "counters": dict(self.counters), "objects": dict(self.store.counters), "cards": cards,
        }

    _handlers = {
        P.Hello: _on_hello, P.Bye: _on_bye, P.Ping: _on_ping, P.Exist: _on_exist, P.Unlock: _on_unlock,
        P.Delete: _on_delete, P.Clean: _on_clean, P.Stats: _on_stats, P.Get: _on_data, P.Put: _on_data,
        P.Release: _on_ack, P.Filled: _on_ack,
    }


def _region_io(region, items: list, into_ring: bool) -> list[tuple[int, bool]]:
    """Copy ``(j, ring view, file offset)`` items between the ring and a client's region with
    ``preadv``/``pwritev`` on its descriptor (runs on the pool). The gateway never maps a
    region: a region the client shrank fails these calls, it cannot fault the gateway. A
    region shorter now than registered takes nothing (a write would grow the client's file)."""
    try:
        size_now = os.fstat(region.fd).st_size
    except OSError:
        return [(j, False) for j, _, _ in items]
    out = []
    for j, view, place in items:
        ok = False
        if place + len(view) <= size_now:
            try:
                moved = os.preadv(region.fd, [view], place) if into_ring else os.pwritev(region.fd, [view], place)
                ok = moved == len(view)
            except OSError:
                pass
        out.append((j, ok))
    return out


def _remove_legacy_ring(port: int) -> None:
    """Remove the ring file an adpkv gateway before the door left on this port (rings are
    memfds now). Called only while this gateway holds the port's door lock."""
    path = os.path.join(SHM_DIR, f"{MEMFD_NAME_PREFIX}{port}")
    try:
        os.unlink(path)
        logger.info("Removed %s, the ring of an older gateway", path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s, the ring of an older gateway: %s", path, exc)
