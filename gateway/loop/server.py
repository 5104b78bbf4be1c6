"""The gateway process: one loop for control, a thread pool for card I/O.

All request state lives in the loop's thread. Everything that touches a card
(data, but also EXIST, DELETE, CLEAN and the usage behind STATS and the status
file) runs on the pool and reports back through a completion queue that wakes
the loop: one slow card never stalls another engine's control messages. EXIST
and a GET's lookup stage run on threads of their own (``LOOKUP_THREADS``): an
engine's scheduler waits for the one, a restore for the other, so neither queues
behind the card writes of the prompts stored before. GET and
PUT become jobs in ``data_requests.py`` and run batch by batch in ``transfers.py``.

Who may do what: a control-port request is served only on a session from the
door (``gateway/door/entry.py``); an engine belongs to the uid that attached it first,
a key namespace to the uid that first named it (``gateway/store/namespaces.py``: every
request that names keys is checked against it before any card is asked), and only
an operator cleans.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import signal
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Callable, Optional, TypeVar, Union

import zmq

from adpkv_core import __version__
from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import door_dir, door_path
from adpkv_core.keys import namespace_id
from adpkv_core.memory.ring import Ring

from adpkv_gateway.datapath import io_procs
from adpkv_gateway.cards import close_cards, open_cards
from adpkv_gateway.config import GatewayConfig, socket_mode
from adpkv_gateway.datapath.data_requests import DataRequests
from adpkv_gateway.datapath.direct_reads import DirectReads
from adpkv_gateway.datapath.replies import Replies
from adpkv_gateway.door.entry import DoorServer, Session, raise_open_files_limit
from adpkv_gateway.door.claim import claim_door, make_door_dir
from adpkv_gateway.door.engines import EngineRegistry, EngineSession, Peer
from adpkv_gateway.store.health import CardHealth, HealthMonitor
from adpkv_gateway.layout.change import LayoutChange
from adpkv_gateway.loop import stats
from adpkv_gateway.observe.metrics import GatewayMetrics, status_file_problem
from adpkv_gateway.store.namespaces import KEEP_CLAIMS_S, Found, NamespaceOwners
from adpkv_gateway.store.object_store import ObjectStore
from adpkv_gateway.store.pins import Pins
from adpkv_gateway.datapath.transfers import Transfers

logger = logging.getLogger("adpkv.gateway")

T = TypeVar("T")

MAX_FRAME_BYTES = 128 << 20   # a request of protocol.MAX_KEYS keys with marks fits
# the threads of EXIST and of a GET's lookup stage (the cards' indexes, or a RESP card's
# round trips): on an H200 a prompt's lookup queued behind earlier prompts' writes on the
# I/O pool waited 0.3-0.9 s
LOOKUP_THREADS = 4


class Gateway:
    """Serves one engine's ranks on ``bind_address:port`` from the configured cards."""

    def __init__(self, config: GatewayConfig):
        """Start in the order that makes every answer mean something: the door's directory
        (``make_door_dir``, for the default door) and lock first (before any card or shared
        memory is touched: a second gateway on a busy port changes nothing), then the cards, the
        ring and the pool, then the door, and the control port last. Whoever gets an answer on
        the port finds the door up: an engine that attaches as soon as the port answers gets the
        cache. A start that fails at any step undoes the steps before it (the door is removed,
        the cards are closed and their locks given up, and a card this start made is removed:
        ``cards.fs_lock``). A ``status_file`` this gateway could not write is refused before all
        that."""
        self.config = config
        self.started = time.time()
        self.door_file = config.control_socket or door_path(config.port, os.geteuid())
        problem = status_file_problem(config.status_file) if config.status_file else ""
        if problem:
            raise SystemExit(f"{problem}; refusing to start")
        if not config.control_socket:
            make_door_dir(door_dir(os.geteuid()))
        with contextlib.ExitStack() as undo:
            self._door_lock = claim_door(self.door_file)
            undo.callback(os.close, self._door_lock)
            raise_open_files_limit()
            self._open_store(config, undo)
            self.pool = ThreadPoolExecutor(config.thread_pool_size, thread_name_prefix="adpkv-io")
            undo.callback(self.pool.shutdown, wait=True)
            self.lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="adpkv-lookup")
            undo.callback(self.lookups.shutdown, wait=True)
            self.procs = io_procs.start(config.io_processes) if config.io_processes else None
            if self.procs:
                undo.callback(self.procs.shutdown, wait=True)
                logger.info("fs card reads run in %d I/O processes", config.io_processes)
            self.health.start()
            undo.callback(self.health.stop)
            self.engines = EngineRegistry(config.engine_timeout_s)
            self.done_q: "queue.SimpleQueue" = queue.SimpleQueue()
            self.wake_r, self.wake_w = os.pipe()
            undo.callback(os.close, self.wake_r)
            undo.callback(os.close, self.wake_w)
            os.set_blocking(self.wake_r, False)
            os.set_blocking(self.wake_w, False)
            self.ctx = zmq.Context()
            undo.callback(self.ctx.term)
            self.sock = self.ctx.socket(zmq.ROUTER)
            undo.callback(self.sock.close, 0)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self.replies = Replies(self.sock, self.engines)     # every reply on the port: the loop's, the data path's
            self.poller = zmq.Poller()
            self.poller.register(self.sock, zmq.POLLIN)
            self.poller.register(self.wake_r, zmq.POLLIN)
            self.sessions_by_peer: dict[bytes, Session] = {}
            self.door = DoorServer(self.door_file, socket_mode(config), config.control_socket_group,
                                   config.operator_group, ring_for=self._ring_for,
                                   register=lambda fd: self.poller.register(fd, zmq.POLLIN),
                                   unregister=self.poller.unregister, on_session_closed=self._on_session_closed,
                                   engine_uid=lambda: self.engines.engine.uid if self.engines.engine else None,
                                   per_user=config.door_connections_per_user,
                                   handshake_s=config.door_handshake_s,
                                   map_for=lambda session, msg: self.direct_reads.serve(session, msg))
            undo.callback(self.door.close)
            self.status_writing = False
            self.status_failing = False              # the last write of the status file failed (logged once)
            self.transfers = Transfers(config.shared_memory_size,     # a ring per engine, made as it attaches
                                       lambda: Ring.create(config.port, config.shared_memory_size), self.store,
                                       self.pool, self.lookups, self.procs, config.thread_pool_size,
                                       run=self._run, replies=self.replies,
                                       unpin=lambda ident, keys: self._release_pins(self.engines.peers[ident], keys))
            self.counters: collections.Counter[str] = collections.Counter()
            self.namespaces = NamespaceOwners(config.namespace_owners, self.store.cards, self.store.service)
            self.data_requests = DataRequests(self.engines, self.sessions_by_peer, self.namespaces, self.transfers,
                                              self.counters, self.replies)
            self.direct_reads = DirectReads(self)         # MAP at the door (gateway/datapath/direct_reads.py)
            # requests that name keys, in the order they came: (identity, peer, request); the
            # first waits while its namespaces' owners are looked up
            self.keyed_waiting: "collections.deque[tuple[bytes, Peer, Keyed]]" = collections.deque()
            self.next_keep_claims = 0.0
            self.stopping = False
            self.layout_change.start(engine_busy=lambda: bool(self.transfers.jobs))
            undo.callback(self.layout_change.stop)
            try:
                self.sock.bind(f"tcp://{config.bind_address}:{config.port}")
            except zmq.ZMQError as exc:
                raise SystemExit(f"cannot listen on {config.bind_address}:{config.port}: {exc}") from None
            undo.pop_all()
        if config.metrics_port:
            self.metrics.serve(config.metrics_address, config.metrics_port)
        # the version in the line that says the start succeeded (a refused start stays one line)
        logger.info("Gateway listening on %s:%d (adpkv-gateway %s, pid %d)", config.bind_address, config.port,
                    __version__, os.getpid())

    def _open_store(self, config: GatewayConfig, undo: contextlib.ExitStack) -> None:
        """Open the cards (closed by ``undo`` when the start fails later), check the key
        layout, and build the store, its health monitor (not started) and its metrics."""
        # made before the cards: a card's scan at start passes pinned objects over (none yet then)
        pins = Pins()
        cards, self.card_locks = open_cards(config, is_pinned=pins.holds)
        undo.callback(close_cards, cards, self.card_locks, undo_new=True)     # a failed start: the cards it made go
        self.card_health = card_health = CardHealth(cards, config.io_timeout_ms, config.io_timeout_strikes)
        self.store = ObjectStore(cards, config.storage_slots, config.num_dbs, config.key_placement,
                                 config.fragment_size, config.fragment_spread_across_dbs, config.replicas,
                                 observer=card_health, pins=pins)
        self.health = HealthMonitor(self.store, card_health)
        self.metrics = GatewayMetrics(self.store.cards, self.store.stats)
        # with every card: the layout recorded on them and the fingerprint (gateway/layout/record.py)
        self.layout_change = LayoutChange.open(self.store, config)
        logger.info("Key layout fingerprint %s", self.store.placement.fingerprint)
        if config.key_layout_fingerprint and config.key_layout_fingerprint != self.store.placement.fingerprint:
            logger.warning("Not every card answered: the key layout fingerprint is checked when they join")
            self.health.expected_fingerprint = config.key_layout_fingerprint
        for card in cards:
            if card.serial:
                logger.info("Card %s (%s %s) Group Health: active", card.serial, card.kind, card.device)
        logger.info("Key placement %s over %d slots, %d database(s) per card, %d replica(s)",
                    config.key_placement, config.storage_slots, config.num_dbs, config.replicas)
        if int(config.start_clean):
            logger.info("start_clean: removed %d objects", self.store.clean())

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
                self.door.tick(time.monotonic())
                self._drain_completions()
                self._read_queued(1000)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + 1.0
                    self._tick()
        finally:
            self._shutdown()

    def _read_queued(self, limit: Optional[int]) -> None:
        """Handle the control messages queued now, at most ``limit`` (None: all of them)."""
        handled = 0
        while limit is None or handled < limit:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)
            self._drain_completions()
            handled += 1

    def stop(self) -> None:
        self.stopping = True
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _tick(self) -> None:
        if self.engines.expired():
            # A loop that fell behind (a loaded host) has not read what the rank sent: read
            # everything queued before calling anyone silent.
            self._read_queued(None)
        for ident in self.engines.expired():
            self._detach(ident, f"no message for {self.config.engine_timeout_s:.0f} s")
        if time.monotonic() >= self.next_keep_claims:
            self.next_keep_claims = time.monotonic() + KEEP_CLAIMS_S
            self._run(self.pool, self.namespaces.keep_claims, lambda _: None, lambda exc: None)
        if (self.config.status_file or self.config.metrics_port) and not self.status_writing:
            self.status_writing = True
            self._collect_stats(self._write_status)

    def _write_status(self, figures: P.GatewayStats) -> None:
        """Hand the figures to the metrics (/metrics serves them) and write the status file on
        the pool (a slow disk never stalls the loop)."""
        self.metrics.update(figures)

        def write():
            if not self.config.status_file:
                return
            try:
                self.metrics.write_textfile(self.config.status_file)
            except OSError as exc:
                if not self.status_failing:
                    logger.warning("cannot write the status file %s: %s (said once, until it is written again)",
                                   self.config.status_file, exc)
                self.status_failing = True
                return
            if self.status_failing:
                logger.info("the status file %s is written again", self.config.status_file)
            self.status_failing = False

        def done(_):
            self.status_writing = False
        self._run(self.pool, write, done, done)

    def _shutdown(self) -> None:
        logger.info("Gateway stopping: finishing card I/O in flight")
        self.layout_change.stop()
        self.pool.shutdown(wait=True)
        self.lookups.shutdown(wait=True)
        if self.procs:
            self.procs.shutdown(wait=True)
        self.health.stop()
        self._drain_completions()
        self.metrics.close()
        if self.config.status_file:      # the last word: up 0
            self.metrics.stopped()
            self.metrics.update(stats.merge(stats.loop_snapshot(self), stats.card_usages(self.store)))
            try:
                self.metrics.write_textfile(self.config.status_file)
            except OSError as exc:
                logger.warning("cannot write the status file %s at stop (it still says up): %s",
                               self.config.status_file, exc)
        self.door.close()
        self.sock.close(0)
        self.ctx.term()
        close_cards(self.store.cards, self.card_locks)
        for ring in self.transfers.rings.values():
            ring.ring.close()
        logger.info("Gateway stopped")

    # ================================================================ messages
    def _on_frames(self, frames: list) -> None:
        if len(frames) != 2:
            if frames:
                self.replies.send(frames[0], P.error(None, P.BAD_MESSAGE, f"expected one frame, got {len(frames) - 1}"))
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
            if peer is None and not isinstance(msg, (P.Hello, P.Ping, P.Stats, P.Clean, P.Drain)):
                raise P.ProtocolError(P.NOT_ATTACHED, f"{msg.op} before HELLO")
            if isinstance(msg, KEYED):
                assert peer is not None     # checked above: only HELLO, PING, STATS, CLEAN, DRAIN come before HELLO
                self._on_keyed(identity, peer, msg)
            else:
                self._handlers[type(msg)](self, identity, peer, msg)
        except zmq.ZMQError:
            raise
        except Exception as exc:
            self._refuse(identity, req_id, exc)

    def _refuse(self, identity: bytes, req_id, exc: Exception) -> None:
        """The ERROR reply to a request that raised ``exc``: its code for a ProtocolError,
        INTERNAL for anything else (a bug must not take the gateway down for everyone)."""
        if isinstance(exc, P.ProtocolError):
            self.counters["bad_requests"] += 1
            logger.warning("Refused a request from %s: %s", identity.hex(), exc)
            self.replies.send(identity, P.error(req_id, exc.code, exc.message))
        else:
            logger.error("Internal error on a request", exc_info=exc)
            self.replies.send(identity, P.error(req_id, P.INTERNAL, str(exc)))

    def _session(self, identity: bytes, msg: Union[P.Hello, P.Stats, P.Clean, P.Drain]) -> Session:
        """The door session behind a request: the one its connection attached with, or the
        one its ``session`` token names. FORBIDDEN without one."""
        session = self.sessions_by_peer.get(identity)
        if session is not None:
            return session
        session = self.door.by_token.get(msg.session) if msg.session is not None else None
        if session is None:
            raise P.ProtocolError(P.FORBIDDEN, f"{msg.op} needs a session: connect through the door "
                                  f"{self.door_file} first (its permissions say who may)")
        self.door.used(session)
        return session

    def _on_hello(self, identity, peer, msg: P.Hello):
        session = self._session(identity, msg)
        self.engines.attach(identity, msg, session.uid)
        self.sessions_by_peer[identity] = session
        session.identities.add(identity)
        self.replies.send(identity, P.HelloOk(id=msg.id, proof=session.proof))

    def rank_session_engine(self, session: Session, what: str) -> EngineSession:
        """The engine of a door session that may be handed ``what`` (the ring, object files):
        one of its connections is attached as a rank of that engine and the session's user
        owns the engine. FORBIDDEN otherwise (before HELLO, a lookup peer, another user's engine)."""
        engine = self.engines.engine
        ranks = [self.engines.peers.get(identity) for identity in session.identities]
        if engine is None or engine.uid != session.uid or not any(p is not None and p.rank is not None
                                                                  for p in ranks):
            raise P.ProtocolError(P.FORBIDDEN, f"{what} handed only to an attached rank of an engine of this "
                                  "user (HELLO first, as a rank)")
        return engine

    def _ring_for(self, session: Session) -> Ring:
        """The ring a door session may map (its RING request): its engine's (``rank_session_engine``)."""
        return self.transfers.engine_ring(self.rank_session_engine(session, "the ring is")).ring

    def _on_session_closed(self, session: Session) -> None:
        """A client's door closed (it exited, or closed its client): what it attached goes now."""
        for identity in list(session.identities):
            self._detach(identity, "its process closed its session")

    def _on_bye(self, identity, peer, msg: P.Bye):
        self.replies.send(identity, P.Ok(id=msg.id))
        self._detach(identity, "closed")

    def _on_ping(self, identity, peer, msg: P.Ping):
        self.replies.send(identity, P.Ok(id=msg.id))

    def _on_exist(self, identity, peer: Peer, msg: P.Exist):
        keys = msg.keys
        self.counters["exist_requests"] += 1

        def answer(hits):
            if msg.lock and self.engines.peers.get(identity) is peer:
                locked = [k for k, h in zip(keys, hits) if h]
                self.store.pins.pin(locked)
                peer.pins.update(locked)
            self.replies.send(identity, P.ExistOk(id=msg.id, hits=P.pack_flags(hits)))

        # on the lookups' own threads, never queued behind the card writes on the I/O pool, and
        # never waiting for writes in flight: the engine's scheduler waits for this answer (an
        # object still being written is a miss here; a GET of it waits: datapath/writing.py)
        self._offload(lambda: self.store.lookup.exists(keys, msg.marks), answer, identity, msg, self.lookups)

    def _on_unlock(self, identity, peer: Peer, msg: P.Unlock):
        self._release_pins(peer, msg.keys)
        self.replies.send(identity, P.Ok(id=msg.id))

    def _release_pins(self, peer: Peer, keys) -> None:
        mine = [k for k in keys if peer.pins.get(k)]
        for k in mine:
            peer.pins[k] -= 1
            if peer.pins[k] <= 0:
                del peer.pins[k]
        self.store.pins.unpin(mine)

    def _on_delete(self, identity, peer, msg: P.Delete):
        self._offload(lambda: self.store.delete(msg.keys, msg.marks),
                      lambda deleted: self.replies.send(identity, P.DeleteOk(id=msg.id, deleted=deleted)),
                      identity, msg)

    def _on_clean(self, identity, peer, msg: P.Clean):
        session = self._session(identity, msg)
        if not session.operator:
            raise P.ProtocolError(P.FORBIDDEN, "only an operator cleans (root, the gateway's user, or "
                                  "operator_group); nothing was deleted")
        if self.config.shared_storage:
            logger.warning("CLEAN refused: shared_storage is set; nothing was deleted")
            raise P.ProtocolError(P.CLEAN_REFUSED, "shared_storage: the cards are shared, nothing was deleted")
        if self.transfers.jobs:
            raise P.ProtocolError(P.CLEAN_REFUSED, "requests are in flight; nothing was deleted")

        def cleaned(deleted):
            logger.info("CLEAN by uid %d: %d objects deleted", session.uid, deleted)
            self.replies.send(identity, P.DeleteOk(id=msg.id, deleted=deleted))

        self._offload(self.store.clean, cleaned, identity, msg)

    def _on_drain(self, identity, peer, msg: P.Drain):
        """Move a card's objects to the others (gateway/layout/change.py); operators only."""
        session = self._session(identity, msg)
        if not session.operator:
            raise P.ProtocolError(P.FORBIDDEN, "only an operator drains a card (root, the gateway's user, or "
                                  "operator_group); nothing changed")
        card = next((c for c in self.store.cards if c.serial and msg.card in (c.serial, c.device)), None)
        if card is None:
            raise P.ProtocolError(P.DRAIN_REFUSED, f"no card {msg.card!r} in service; nothing changed")
        why = self.layout_change.drain_refusal(card.serial)
        if why:
            raise P.ProtocolError(P.DRAIN_REFUSED, f"{why}; nothing changed")
        layout = self.layout_change.drain(card.serial)
        logger.info("DRAIN of card %s by uid %d", card.serial, session.uid)
        self._offload(self.layout_change.record_drain,
                      lambda _: self.replies.send(identity, P.DrainOk(id=msg.id, serial=card.serial,
                                                               fingerprint=layout.fingerprint)), identity, msg)

    def _on_stats(self, identity, peer, msg: P.Stats):
        session = self._session(identity, msg)
        engine = self.engines.engine
        shows_engine = session.operator or (engine is not None and engine.uid == session.uid)

        def answer(figures: P.GatewayStats) -> None:
            if not shows_engine:     # namespaces are the engine owner's (or an operator's) to see
                figures.objects_by_namespace = {}
            if not session.operator:     # a user sees the usage of its own engine's namespace only
                own = namespace_id(engine.namespace).hex() if shows_engine and engine is not None else None
                figures.tenants = [t for t in figures.tenants if t.id == own]
                figures.namespace_names = {k: v for k, v in figures.namespace_names.items() if k == own}
            if not shows_engine and figures.engine is not None:
                figures.engine = P.EngineFigures(id="(another user's)", world=figures.engine.world,
                                                 ranks=figures.engine.ranks, namespace="(another user's)")
            self.replies.send(identity, P.StatsOk(id=msg.id, stats=figures))

        self._collect_stats(answer, (identity, msg))

    def _offload(self, work, then, identity: bytes, msg: P.Message, executor: Optional[Executor] = None) -> None:
        """Card metadata for a request: ``work()`` on ``executor`` (the I/O pool unless given),
        ``then(result)`` back on the loop; the request gets CARD_ERROR when the cards fail it."""
        self._run(executor or self.pool, work, then,
                  lambda exc: self.replies.send(identity, P.error(msg.id, P.CARD_ERROR,
                                                                  f"the cards did not answer: {exc}")))

    # ================================================================ requests that name keys
    def _on_keyed(self, identity: bytes, peer: Peer, msg: Keyed) -> None:
        """EXIST, UNLOCK, DELETE, GET, PUT: served in the order they came, each once its
        session's uid may use every namespace its keys name (``NamespaceOwners.verdict``), else
        refused whole with FORBIDDEN before any card is asked about an object. A GET or PUT is
        checked and run by ``DataRequests.serve`` in one call (a bad one is refused before its
        namespaces are looked at, so nothing is claimed for it)."""
        self.keyed_waiting.append((identity, peer, msg))
        if len(self.keyed_waiting) == 1:
            self._serve_keyed()

    def _serve_keyed(self, settled: Optional[Found] = None) -> None:
        """Serve the waiting requests that name keys, in order, up to one whose namespaces'
        owners the cards must be asked first (``_owners_found`` goes on from there).
        ``settled``: what the cards just said for the first one."""
        while self.keyed_waiting:
            waiting = self.keyed_waiting.popleft()
            identity, peer, msg = waiting
            found, settled = settled, None          # for the first one only
            if self.engines.peers.get(identity) is not peer:
                continue                            # it detached meanwhile: no answer is owed
            try:
                if isinstance(msg, (P.Get, P.Put)):
                    unresolved = self.data_requests.serve(identity, peer, msg, found)
                else:
                    unresolved = self.namespaces.verdict(self.sessions_by_peer[identity].uid, msg, found)
                    if unresolved is None:
                        self._handlers[type(msg)](self, identity, peer, msg)
                if unresolved is not None:
                    self._run(self.pool, functools.partial(self.namespaces.resolve, unresolved),
                              self._owners_found, self._owners_unknown)
                    self.keyed_waiting.appendleft(waiting)     # first again, until its owners are known
                    return
            except zmq.ZMQError:
                raise
            except Exception as exc:
                self._refuse(identity, msg.id, exc)

    def _owners_found(self, found: Found) -> None:
        self.namespaces.learn(found)
        self._serve_keyed(found)

    def _owners_unknown(self, exc: BaseException) -> None:
        identity, peer, msg = self.keyed_waiting.popleft()
        if self.engines.peers.get(identity) is peer:
            self.replies.send(identity, P.error(msg.id, P.CARD_ERROR, f"the cards did not answer who owns the key "
                                         f"namespaces of this {msg.op}: {exc}"))
        self._serve_keyed()

    # ================================================================ data requests
    def _on_ack(self, identity, peer, msg: Union[P.Release, P.Filled]):
        self.transfers.ack(identity, msg)

    # ---------------------------------------------------------------- the pool
    def _run(self, executor: Executor, work: Callable[[], T], then: Callable[[T], None],
             fail: Callable[[BaseException], None]) -> None:
        """Run ``work()`` on ``executor``; ``then(result)`` — or ``fail(exc)`` — back on the loop
        (``datapath.handoff.RunOnPool``)."""
        executor.submit(work).add_done_callback(lambda fut: self._complete((then, fail, fut)))

    def _complete(self, item) -> None:
        """From any thread: hand a finished task to the loop and wake it."""
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
                then, fail, fut = self.done_q.get_nowait()
            except queue.Empty:
                return
            exc = fut.exception()
            if exc is not None:
                logger.error("a task on the I/O pool failed: %r", exc)
                fail(exc)
            else:
                then(fut.result())

    # ---------------------------------------------------------------- detach
    def _detach(self, identity: bytes, why: str) -> None:
        engine = self.engines.engine
        peer = self.engines.detach(identity, why)
        if peer is None:
            return
        session = self.sessions_by_peer.pop(identity, None)
        if session is not None:
            session.identities.discard(identity)
        self.store.pins.unpin(list(peer.pins.elements()))
        if peer.rank is not None:
            self.data_requests.rank_left(identity, peer.rank)
            self.transfers.rank_left(identity)
        if engine is not None and self.engines.engine is not engine and engine.ring is not None:
            self.transfers.retire_ring(engine.ring)      # the engine is gone: so is its ring

    # ---------------------------------------------------------------- stats
    def _collect_stats(self, then, request: Optional[tuple[bytes, P.Message]] = None) -> None:
        """``then(stats)`` on the loop: the loop's own state now, the cards' usage from the pool
        (``request``: the STATS request's (identity, message); None: for the status file, and a
        failure leaves the file as it was)."""
        snapshot = stats.loop_snapshot(self)
        merged = lambda usages: then(stats.merge(snapshot, usages))   # noqa: E731
        usages = functools.partial(stats.card_usages, self.store)
        if request is not None:
            self._offload(usages, merged, *request)
        else:
            self._run(self.pool, usages, merged, lambda exc: setattr(self, "status_writing", False))

    _handlers: dict[type, Callable[..., None]] = {
        P.Hello: _on_hello, P.Bye: _on_bye, P.Ping: _on_ping, P.Exist: _on_exist, P.Unlock: _on_unlock,
        P.Delete: _on_delete, P.Clean: _on_clean, P.Drain: _on_drain, P.Stats: _on_stats,
        P.Release: _on_ack, P.Filled: _on_ack,
    }    # EXIST, UNLOCK and DELETE through _on_keyed; GET and PUT through it to DataRequests


Keyed = Union[P.Exist, P.Unlock, P.Delete, P.Get, P.Put]
KEYED = (P.Exist, P.Unlock, P.Delete, P.Get, P.Put)     # the requests that name keys: _on_keyed
