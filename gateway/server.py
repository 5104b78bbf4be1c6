"""The gateway process: one loop for control, a thread pool for card I/O.

All request state lives in the loop's thread. Everything that touches a card
(data, but also EXIST, DELETE, CLEAN and the usage behind STATS and the status
file) runs on the pool and reports back through a completion queue that wakes
the loop: one slow card never stalls another engine's control messages. GET and
PUT become jobs in ``data_requests.py`` and run batch by batch in ``transfers.py``.

Who may do what: a control-port request is served only on a session from the
door (``gateway/door.py``); an engine belongs to the uid that attached it first,
and only an operator cleans.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

import zmq

from adpkv_core import protocol as P
from adpkv_core.door import SHM_DIR, door_path
from adpkv_core.keys import namespace_id
from adpkv_core.ring import MEMFD_NAME_PREFIX, Ring

from . import io_procs
from .cards import open_cards
from .config import GatewayConfig, socket_mode
from .data_requests import DataRequests
from .door import DoorServer, Session, claim_door
from .engines import EngineRegistry, Peer
from .health import HealthMonitor
from . import stats
from .metrics import GatewayMetrics
from .store import ObjectStore
from .transfers import Transfers

logger = logging.getLogger("adpkv.gateway")

MAX_FRAME_BYTES = 128 << 20   # a request of protocol.MAX_KEYS keys with marks fits


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
        # a card's scan at start may evict before the store exists: nothing is pinned yet then
        cards = open_cards(config, is_pinned=lambda key: "store" in holder and holder["store"].is_pinned(key))
        self.store = holder["store"] = ObjectStore(cards, config.storage_slots, config.num_dbs,
                                                   config.key_placement, config.fragment_size,
                                                   config.fragment_spread_across_dbs, config.replicas)
        self.health = HealthMonitor(self.store, config.io_timeout_ms, config.io_timeout_strikes)
        self.metrics = GatewayMetrics(self.store.cards, self.store.stats)
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
        logger.info("Ring %s: %d bytes (a sealed memfd, handed out at the door)", self.ring.name, self.ring.size)
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
        self.transfers = Transfers(self.ring, self.store, self.pool, self.procs, config.thread_pool_size,
                                   run=self._run, send=self._send, attached=lambda ident: ident in self.engines.peers,
                                   unpin=lambda ident, keys: self._release_pins(self.engines.peers[ident], keys))
        self.counters = collections.Counter()
        self.data_requests = DataRequests(self.engines, self.sessions_by_peer, self.transfers, self.counters, self._send)
        self.stopping = False
        if config.metrics_port:
            self.metrics.serve(config.metrics_address, config.metrics_port)
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
        if (self.config.status_file or self.config.metrics_port) and not self.status_writing:
            self.status_writing = True
            self._collect_stats(self._write_status)

    def _write_status(self, figures: dict) -> None:
        """Hand the figures to the metrics (/metrics serves them) and write the status file on
        the pool (a slow disk never stalls the loop)."""
        self.metrics.update(figures)

        def write():
            if not self.config.status_file:
                return
            try:
                self.metrics.write_textfile(self.config.status_file)
            except OSError as exc:
                logger.warning("cannot write the status file %s: %s", self.config.status_file, exc)

        def done(_):
            self.status_writing = False
        self._run(self.pool, write, done, done)

    def _shutdown(self) -> None:
        logger.info("Gateway stopping: finishing card I/O in flight")
        self.pool.shutdown(wait=True)
        if self.procs:
            self.procs.shutdown(wait=True)
        self.health.stop()
        self._drain_completions()
        self.metrics.close()
        if self.config.status_file:
            self.metrics.update(stats.merge(stats.loop_snapshot(self), stats.card_usages(self.store)))
            try:
                self.metrics.write_textfile(self.config.status_file)
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
        self._send(identity, P.Ok(id=msg.id))

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
        if self.transfers.jobs:
            raise P.ProtocolError(P.CLEAN_REFUSED, "requests are in flight; nothing was deleted")

        def cleaned(deleted):
            logger.info("CLEAN by uid %d: %d objects deleted", session.uid, deleted)
            self._send(identity, P.DeleteOk(id=msg.id, deleted=deleted))

        self._offload(self.store.clean, cleaned, identity, msg)

    def _on_stats(self, identity, peer, msg: P.Stats):
        session = self._session(identity, msg)
        engine = self.engines.engine
        shows_engine = session.operator or (engine is not None and engine.uid == session.uid)

        def answer(figures):
            if not shows_engine:     # namespaces are the engine owner's (or an operator's) to see
                figures["objects_by_namespace"] = {}
            if not session.operator:     # a user sees the usage of its own engine's namespace only
                own = namespace_id(engine.namespace).hex() if shows_engine and engine is not None else None
                figures["tenants"] = [t for t in figures["tenants"] if t["id"] == own]
                figures["namespace_names"] = {k: v for k, v in figures["namespace_names"].items() if k == own}
            if not shows_engine and figures["engine"] is not None:
                figures["engine"] = {"id": "(another user's)", "world": figures["engine"]["world"],
                                     "ranks": figures["engine"]["ranks"], "namespace": "(another user's)"}
            self._send(identity, P.StatsOk(id=msg.id, stats=figures))

        self._collect_stats(answer, identity, msg)

    def _offload(self, work, then, identity: bytes, msg: P.Message) -> None:
        """Card metadata for a request: ``work()`` on the pool, ``then(result)`` back on the
        loop; the request gets CARD_ERROR when the cards fail it."""
        self._run(self.pool, work, then,
                  lambda exc: self._send(identity, P.error(msg.id, P.CARD_ERROR, f"the cards did not answer: {exc}")))

    # ================================================================ data requests
    def _on_data(self, identity, peer: Peer, msg: Union[P.Get, P.Put]):
        self.data_requests.on_data(identity, peer, msg)

    def _on_ack(self, identity, peer, msg: Union[P.Release, P.Filled]):
        self.transfers.ack(identity, msg)

    # ---------------------------------------------------------------- the pool
    def _run(self, executor, work, then, fail) -> None:
        """Run ``work()`` on ``executor``; ``then(result)`` — or ``fail(exc)`` — back on the loop."""
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
        self.data_requests.rank_left(identity, peer.rank)
        self.transfers.rank_left(identity)

    # ---------------------------------------------------------------- stats
    def _collect_stats(self, then, identity: Optional[bytes] = None, msg: Optional[P.Message] = None) -> None:
        """``then(stats)`` on the loop: the loop's own state now, the cards' usage from the pool
        (for the status file, no request: a failure leaves the file as it was)."""
        snapshot = stats.loop_snapshot(self)
        merged = lambda usages: then(stats.merge(snapshot, usages))   # noqa: E731
        usages = functools.partial(stats.card_usages, self.store)
        if identity is not None:
            self._offload(usages, merged, identity, msg)
        else:
            self._run(self.pool, usages, merged, lambda exc: setattr(self, "status_writing", False))

    _handlers = {
        P.Hello: _on_hello, P.Bye: _on_bye, P.Ping: _on_ping, P.Exist: _on_exist, P.Unlock: _on_unlock,
        P.Delete: _on_delete, P.Clean: _on_clean, P.Stats: _on_stats, P.Get: _on_data, P.Put: _on_data,
        P.Release: _on_ack, P.Filled: _on_ack,
    }


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
