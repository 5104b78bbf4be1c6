"""The control connection of a ``GatewayClient`` and the I/O thread that owns it.

A ``Link`` is one ZeroMQ DEALER socket to the gateway's control port and one thread
(``adpkv-client-<rank>``, an ``adpkv_core.threads`` thread) that alone touches it: it sends what callers queued
(``submit``, ``call``), decodes every reply with the decoder of its request, runs the
copy callbacks of ring batches (``request.BatchCallback``) and answers each batch,
sends heartbeats, watches every request's deadline and the door (its hang-up means the
gateway is gone).

A data request's deadline is ``timeout_s`` after the gateway last showed progress on it: a reply
of its own (a batch, the end), or of a data request sent before it (the gateway serves a rank's
requests in order, so a layer's GET queued behind a cold card's long reads waits while those
move, however long the whole restore takes; a request the gateway no longer works on still
times out once the ones before it are answered).

When the gateway stops answering (a deadline passed, the door closed, it no longer
knows this rank, a send failed) the link turns off (``turn_off``: logged once, before
``enabled`` reads False): every request in flight or queued resolves at once as a miss
/ not stored, and every later one too. A request into or out of one of our regions
resolves only once the gateway may no longer touch it (``Pending.region_by``).

Threads: callers queue requests (``submit``, ``call``) from any thread through
``_outbox``; the rest of a request's life (``_pending``, replies, copies, deadlines) runs on
the I/O thread. ``turn_off`` also runs on the caller's thread while the client attaches,
``stop`` once, from the client's ``close``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import zmq

from adpkv_core import threads
from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import DoorSession
from adpkv_core.memory.region_lock import take_back
from adpkv_core.request import (OK, REGION_WRITE_MARGIN_S, LoadResult, Pending, RingBatch, StoreResult, nothing, reply_flags,
                                resolved)
from adpkv_core.settings import ClientConfig

logger = logging.getLogger("adpkv.client")

TURNED_OFF_MESSAGE = "External KV cache turned off on this rank"
LOOKUPS_OFF_MESSAGE = "External KV cache lookups turned off for this engine"   # a lookup-only peer


class Link:
    """One client's control connection and I/O thread (see the module docstring)."""

    def __init__(self, config: ClientConfig, rank: Optional[int]):
        """``rank``: the engine rank of the client (None: a lookup-only peer), for the thread's
        name and the turn-off line."""
        self.config = config
        self.rank = rank
        self.enabled = True                      # False once turned off or stopped
        self.closed = False
        self.attached = False                    # HELLO answered: heartbeats from now on
        self._door: Optional[DoorSession] = None
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._outbox: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._last_send = time.monotonic()       # the gateway detaches a rank it has not heard from
        # the oldest data request the gateway answered (a batch or the end) since the last
        # deadline check: every later request's deadline moves on (see the module)
        self._progress_from: Optional[int] = None
        self._thread = threading.Thread(target=self._run, name=f"adpkv-client-{rank}", daemon=True)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{config.host}:{config.port}")
        self._thread.start()

    # ---------------------------------------------------------------- callers' side
    def watch_door(self, door: DoorSession) -> None:
        """Turn off when ``door`` hangs up (it stays open while the gateway lives)."""
        self._door = door
        self._wake()          # the I/O thread starts watching the door

    def call(self, msg: P.Message, replies: P.ReplyDecoder, convert, miss: Any = None, raw_errors: bool = False):
        """One control request. Resolves with ``convert(reply)``, or with ``miss`` when the
        cache is off, the gateway does not answer, refuses (unless ``raw_errors``: then the
        ``Error`` reply itself) or answers something malformed."""
        if not self.enabled:
            return resolved(miss)
        fut: Future = Future()
        outer: Future = Future()

        def finish(f: Future):
            reply = f.result()
            if reply is None:
                outer.set_result(miss)
            elif isinstance(reply, P.Error) and not raw_errors:
                logger.warning("Gateway error on %s: %s %s", msg.op, reply.code, reply.msg)
                outer.set_result(miss)
            else:
                try:
                    outer.set_result(convert(reply))
                except Exception as exc:  # a malformed reply is a miss, never a crash
                    logger.warning("Bad gateway reply to %s: %s", msg.op, exc)
                    outer.set_result(miss)

        fut.add_done_callback(finish)
        return self.submit(msg, Pending(fut, msg.op, 0, None, 0.0, None, replies), outer)

    def submit(self, msg, pending: Pending, returned: Optional[Future] = None) -> Future:
        """Queue ``msg`` for the I/O thread; ``returned`` (default ``pending.future``)."""
        if self.closed:                         # a call racing close(): answer it as a miss
            self._fail(pending)
            return returned if returned is not None else pending.future
        req_id = next(self._ids)
        msg.id = req_id
        pending.deadline = time.monotonic() + self.config.timeout_s
        if pending.region_by is not None:
            pending.deadline = max(pending.deadline, pending.region_by + REGION_WRITE_MARGIN_S)
        self._outbox.append((req_id, pending, msg))
        self._wake()
        return returned if returned is not None else pending.future

    def restores_in_flight(self) -> int:
        """GET requests queued or sent and not answered yet (any thread may ask)."""
        return sum(1 for _, p, _ in list(self._outbox) if p.op is P.Op.GET) + \
            sum(1 for p in list(self._pending.values()) if p.op is P.Op.GET)

    def stop(self) -> None:
        """Stop the I/O thread (without a turn-off line): what is in flight or queued resolves
        as a miss / not stored."""
        self.closed = True
        self.enabled = False
        self._wake()
        self._thread.join(timeout=2.0)
        self._fail_queued()                     # queued after the I/O thread's last pass
        os.close(self._wake_r)
        os.close(self._wake_w)

    def turn_off(self, reason: str) -> None:
        if not self.enabled:
            return
        message = LOOKUPS_OFF_MESSAGE if self.rank is None else TURNED_OFF_MESSAGE
        logger.warning("%s (%s); the engine goes on without it", message, reason)
        self.enabled = False     # after the line: whoever sees the cache off finds it logged
        self._fail_in_flight()
        self._fail_queued()

    # ---------------------------------------------------------------- the I/O thread
    def _wake(self):
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _send(self, msg: P.Message) -> None:
        self._sock.send(P.encode(msg), zmq.NOBLOCK)
        self._last_send = time.monotonic()

    def _run(self) -> None:
        threads.set_up()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        door_fd = None
        try:
            while not self.closed:
                events = poller.poll(100)
                if door_fd is None and self._door is not None and self.enabled:
                    # the door stays open while the gateway lives: a hang-up means it is gone
                    door_fd = self._door.fileno()
                    poller.register(door_fd, zmq.POLLERR)
                if door_fd is not None and any(what == door_fd for what, _ in events):
                    poller.unregister(door_fd)
                    self.turn_off("the gateway went away (its door closed)")
                self._drain_wake()
                while self._outbox:
                    req_id, pending, msg = self._outbox.popleft()
                    if not self.enabled:
                        self._fail(pending)
                        continue
                    self._pending[req_id] = pending
                    try:
                        self._send(msg)
                    except zmq.ZMQError as exc:
                        self.turn_off(f"send failed: {exc}")
                while self.enabled:
                    try:
                        frame = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frame)
                if self.enabled:
                    self._check_time()
        finally:
            self._sock.close(0)
            self._fail_in_flight()

    def _drain_wake(self):
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _check_time(self):
        now = time.monotonic()
        if self._progress_from is not None:
            later = now + self.config.timeout_s
            for req_id, pending in self._pending.items():
                if req_id > self._progress_from and pending.ok is not None:
                    pending.deadline = max(pending.deadline, later)
            self._progress_from = None
        for pending in self._pending.values():
            if now > pending.deadline:
                self.turn_off(f"{pending.op} got no answer within {self.config.timeout_s:.1f} s")
                return
        # The heartbeat is what the gateway hears: a rank that only receives (the Done of PUTs
        # whose batches came earlier, a stream of GET hits) still pings once a second.
        if self.attached and now - self._last_send > self.config.heartbeat_s:
            ping_id = next(self._ids)
            self._pending[ping_id] = Pending(Future(), "PING", 0, None, now + self.config.timeout_s, None, OK)
            try:
                self._send(P.Ping(id=ping_id))
            except zmq.ZMQError as exc:
                self.turn_off(f"send failed: {exc}")

    def _handle(self, frame: bytes) -> None:
        try:
            op, req_id = P.envelope(frame)
            pending = self._pending.get(req_id)
            msg = (pending.replies if pending is not None else OK).decode(frame)
        except P.ProtocolError as exc:
            logger.warning("Ignoring a bad message from the gateway: %s", exc)
            return
        if isinstance(msg, P.Error) and msg.code == P.NOT_ATTACHED:
            # a restarted gateway: it has never heard of this rank (its ring is a new one too)
            self.turn_off("the gateway does not know this rank any more (it restarted)")
            return
        if pending is None:
            return
        pending.deadline = time.monotonic() + self.config.timeout_s
        if pending.ok is not None and (self._progress_from is None or req_id < self._progress_from):
            self._progress_from = req_id          # a data request moved: those after it wait on
        if isinstance(msg, P.Batch):
            if pending.on_batch is not None:
                self._run_batch(msg, pending)
            return
        del self._pending[req_id]
        _close_locks(pending)           # answered: the gateway's writes into our regions are done
        if pending.ok is None:          # a control call
            pending.future.set_result(msg)
            return
        if isinstance(msg, P.Done):
            flags = reply_flags(msg.hits if pending.op is P.Op.GET else msg.stored, pending.n)
            flags = [f and bool(c) for f, c in zip(flags, pending.ok)]
            if pending.op is P.Op.PUT:
                pending.future.set_result(StoreResult(flags, reply_flags(msg.existed, pending.n)))
            else:
                pending.future.set_result(LoadResult(flags))
        else:
            why = f"{msg.code} {msg.msg}" if isinstance(msg, P.Error) else f"an unexpected {type(msg).__name__}"
            logger.warning("Gateway refused %s: %s", pending.op, why)
            pending.future.set_result(nothing(pending.op, pending.n))

    def _run_batch(self, msg: P.Batch, pending: Pending) -> None:
        first, count = msg.first, msg.count
        if first < 0 or count < 0 or first + count > pending.n:
            logger.warning("Ignoring a batch outside the request (%d + %d of %d objects)", first, count, pending.n)
            return
        hits = reply_flags(msg.hits, count) if msg.hits is not None else None
        batch = RingBatch(first, count, msg.offset, msg.stride, msg.obj,
                          pending.slice[0], pending.slice[1], hits)
        ok = True
        if pending.op is P.Op.GET and hits is not None and not any(hits):
            pass  # nothing to copy
        else:
            try:
                ok = pending.on_batch(batch) is not False
            except Exception:
                logger.exception("adpkv %s copy of %r failed", pending.op, batch)
                ok = False
        if ok and isinstance(pending.ok, bytearray):      # a ring request: its copies are counted
            pending.ok[first:first + count] = b"\x01" * count
        reply = (P.Release if pending.op is P.Op.GET else P.Filled)(id=msg.id, batch=msg.batch, ok=ok)
        try:
            self._send(reply)
        except zmq.ZMQError as exc:
            self.turn_off(f"send failed: {exc}")

    def _fail(self, pending: Pending) -> None:
        """Resolve a request that will get no answer as a miss / not stored. A request into or
        out of one of our regions resolves only once the gateway may no longer touch it
        (``region_by`` passed, and for a GET no gateway write into its regions is still in
        progress: ``region_lock.take_back``, on a thread of its own, as long as that takes):
        until then the engine must not reuse the buffer."""
        if pending.future.done():
            return
        wait = pending.region_by - time.monotonic() if pending.region_by is not None else 0.0
        if wait > 0 or pending.region_locks:
            pending.region_by = None
            timer = threading.Timer(max(0.0, wait), self._hand_back, (pending,))
            timer.daemon = True
            timer.start()
            return
        pending.future.set_result(None if pending.ok is None else nothing(pending.op, pending.n))

    def _hand_back(self, pending: Pending) -> None:
        take_back(pending.region_locks, f"a {pending.op} of {pending.n} objects")
        _close_locks(pending)
        self._fail(pending)

    def _fail_in_flight(self) -> None:
        for pending in list(self._pending.values()):
            self._fail(pending)
        self._pending.clear()

    def _fail_queued(self) -> None:
        while self._outbox:
            self._fail(self._outbox.popleft()[1])


def _close_locks(pending: Pending) -> None:
    """Close a request's own descriptors of its regions (``region_lock``), once."""
    locks, pending.region_locks = pending.region_locks, ()
    for fd in locks:
        os.close(fd)
