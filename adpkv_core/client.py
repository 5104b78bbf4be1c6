"""The client SDK every adapter uses to reach its gateway.

One ``GatewayClient`` per engine rank. Calls are non-blocking and return
``concurrent.futures.Future`` objects; a background I/O thread owns the ZeroMQ
socket, runs the copy callbacks of data requests and watches deadlines. When
the gateway stops answering, the client turns the external cache off on this
rank (logged once) and every later call resolves at once as a miss / no-op:
the engine keeps serving from its own memory.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import zmq

from . import protocol as P
from .door import DoorSession, door_path
from .ring import Ring
from .settings import ClientConfig

logger = logging.getLogger("adpkv.client")

TURNED_OFF_MESSAGE = "External KV cache turned off on this rank"
REGION_WRITE_MARGIN_S = 0.5     # a request into/out of a region: the gateway stops touching it this long before we give up
LOOKUPS_OFF_MESSAGE = "External KV cache lookups turned off for this engine"   # a lookup-only peer


class RingBatch:
    """Objects ``first .. first+count-1`` of a data request, placed in the ring.

    Object ``i`` of the batch starts at ``offset + i*stride``; this rank's part of
    it is ``slice_bytes`` at ``slice_offset`` within the object. For a GET,
    ``hits[i]`` says whether object ``first+i`` was found.
    """

    __slots__ = ("first", "count", "offset", "stride", "object_bytes", "slice_offset",
                 "slice_bytes", "hits")

    def __init__(self, first, count, offset, stride, object_bytes, slice_offset, slice_bytes, hits):
        self.first = first
        self.count = count
        self.offset = offset
        self.stride = stride
        self.object_bytes = object_bytes
        self.slice_offset = slice_offset
        self.slice_bytes = slice_bytes
        self.hits = hits

    def __repr__(self):
        return (f"RingBatch(first={self.first}, count={self.count}, offset={self.offset}, "
                f"stride={self.stride}, object_bytes={self.object_bytes})")


BatchCallback = Callable[[RingBatch], Optional[bool]]
"""``on_batch(batch) -> bool | None``: the copy of one ring batch of a ``get`` or ``put``.

- It runs on the client's I/O thread, once per batch, in request order; the gateway
  holds the batch's ring slots until it returns. It must not block (no waiting on
  other requests, locks held by request paths, or storage): every other request of
  the rank, and the heartbeats, wait behind it.
- ``get``: copy the hits (``batch.hits[i]``) among objects ``batch.first ..
  batch.first+batch.count-1`` out of the ring (object i at ``batch.offset + i*batch.stride``,
  this rank's part at ``batch.slice_offset``, ``batch.slice_bytes`` long); leave misses alone.
  ``put``: fill those slots.
- Returning ``False`` (or raising: logged) means the batch was not copied: every object
  of it counts as a miss (``get``) / not stored (``put``, the gateway drops the slots),
  whatever the gateway found or could write. ``None``/``True``: copied.
- After the request's future resolves (also when the cache turned off or the client
  closed), the callback is never called again for it.
"""


class _Pending:
    """A request in flight: how its replies decode and where its result goes."""

    __slots__ = ("future", "op", "n", "on_batch", "deadline", "ok", "slice", "replies", "region_by")

    def __init__(self, future, op, n, on_batch, deadline, slice_, replies: P.ReplyDecoder, data=False):
        self.future = future
        self.op = op
        self.n = n
        self.on_batch = on_batch
        self.deadline = deadline
        # per object: copied by this rank (a request into a region has no copies to make)
        self.ok = (bytearray(n) if on_batch is not None else b"\x01" * n) if data else None
        self.slice = slice_
        self.replies = replies
        # a request into/out of one of our regions: the gateway's last moment to write into it
        # (GET) or read from it (PUT)
        self.region_by: Optional[float] = None


# How the replies to each kind of request decode (an ERROR is always possible).
_OK = P.ReplyDecoder(P.Ok)
_EXIST_OK = P.ReplyDecoder(P.ExistOk)
_DELETE_OK = P.ReplyDecoder(P.DeleteOk)
_STATS_OK = P.ReplyDecoder(P.StatsOk)
_DATA = P.ReplyDecoder(P.Batch, P.Done)


@dataclasses.dataclass(frozen=True)
class StoreResult:
    """The result of a PUT: per key, ``stored[i]`` (the card holds it now) and ``existed[i]``
    (it held it already — a key names its content — and it was not written again)."""

    stored: list[bool]
    existed: list[bool]

    @classmethod
    def none(cls, n: int) -> "StoreResult":
        """Nothing stored: the answer when the cache is off or the request failed."""
        return cls([False] * n, [False] * n)


def door_of(config: ClientConfig) -> str:
    """The door (Unix socket) of the gateway ``config`` names."""
    return config.socket or door_path(config.port)


def gateway_answers(config: ClientConfig, timeout_s: float = 0.3) -> bool:
    """Whether a gateway is serving ``config``'s door and port right now (one cheap probe,
    no attachment): the re-attach policy asks this before building a new client."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(timeout_s)
    try:
        probe.connect(door_of(config))
    except OSError:
        return False
    finally:
        probe.close()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{config.host}:{config.port}")
        sock.send(P.encode(P.Ping(id=0)))
        return bool(sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close(0)


def _flags(data: Optional[bytes], n: int) -> list[bool]:
    """Per-key flags of a reply; all False when they do not describe ``n`` keys."""
    flags = P.unpack_flags(data or b"")
    return flags if len(flags) == n else [False] * n


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class GatewayClient:
    """A connection of one engine rank to its gateway (see docs/internals.md)."""

    def __init__(self, config: ClientConfig, engine_id: str, rank: Optional[int] = 0, world_size: int = 1,
                 layout: Optional[dict] = None):
        """``rank=None`` attaches a lookup-only peer of the engine (EXIST/UNLOCK/DELETE,
        no data), e.g. vLLM's scheduler process next to its worker ranks."""
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.ring: Optional[memoryview] = None
        self._attached = False                   # HELLO answered: heartbeats from now on
        self.attach_error: Optional[str] = None
        self._ring: Optional[Ring] = None
        self._door: Optional[DoorSession] = None
        self._door_lock = threading.Lock()       # door requests: one at a time
        self._enabled = True
        self._closed = False
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._outbox: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ctx = zmq.Context.instance()
        self._last_recv = time.monotonic()
        self._last_ping = 0.0
        self._thread = threading.Thread(target=self._run, name=f"adpkv-client-{rank}", daemon=True)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{config.host}:{config.port}")
        self._thread.start()
        self._attach(layout or {})

    # ---------------------------------------------------------------- public API
    @property
    def enabled(self) -> bool:
        """False once the external cache was turned off on this rank."""
        return self._enabled

    def exist(self, keys: Sequence[bytes], marks: Optional[Sequence[int]] = None,
              lock: bool = False) -> "Future[list[bool]]":
        """Which keys are stored (one round trip). ``lock`` pins the hits against eviction."""
        msg = P.Exist(keys=list(keys), marks=None if marks is None else list(marks), lock=bool(lock))
        return self._call(msg, _EXIST_OK, lambda r: _flags(r.hits, len(keys)), [False] * len(keys))

    def unlock(self, keys: Sequence[bytes]) -> "Future[None]":
        """Release pins taken by ``exist(lock=True)``."""
        return self._call(P.Unlock(keys=list(keys)), _OK, lambda r: None)

    def get(self, keys: Sequence[bytes], object_bytes: int, on_batch: BatchCallback,
            marks: Optional[Sequence[int]] = None, tag: Optional[str] = None,
            slice: Optional[tuple[int, int]] = None, unlock: bool = False) -> "Future[list[bool]]":
        """Read objects into the ring; ``on_batch`` copies each batch out. Resolves with hits.

        ``unlock`` releases this rank's pins (from ``exist(lock=True)``) on the keys when done.
        """
        return self._data("GET", keys, object_bytes, on_batch, marks, tag, slice, unlock)

    def put(self, keys: Sequence[bytes], object_bytes: int, on_batch: BatchCallback,
            marks: Optional[Sequence[int]] = None, tag: Optional[str] = None,
            slice: Optional[tuple[int, int]] = None) -> "Future[list[bool]]":
        """``on_batch`` fills ring slots, the gateway stores them. Resolves with a ``StoreResult``."""
        return self._data("PUT", keys, object_bytes, on_batch, marks, tag, slice)

    def register_region(self, path: str, offset: int, size: int) -> "Future[Optional[int]]":
        """Hand the gateway ``size`` bytes at ``offset`` of a shared-memory file of ours, so
        that ``get_into``/``put_from`` move objects between the cards and it with no copy
        here. This process opens the file itself (read-write, with its own rights) and passes
        the descriptor through the door: a region is only ever memory we can reach. Resolves
        with the region id, or None when refused (the reason is logged)."""
        if not self._enabled or self.rank is None or self._door is None:
            return _done(None)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:      # ValueError: a path with a NUL byte
            logger.warning("Cannot open %s as a region: %s", path, exc)
            return _done(None)
        try:
            with self._door_lock:
                reply = self._door.register_region(fd, offset, size)
        except (OSError, EOFError, P.ProtocolError) as exc:
            logger.warning("Registering region %s failed: %s", path, exc)
            return _done(None)
        finally:
            os.close(fd)
        if isinstance(reply, P.Error):
            logger.warning("The gateway refused region %s: %s %s", path, reply.code, reply.msg)
            return _done(None)
        return _done(reply.region)

    def get_into(self, region: int, at: Sequence[int], keys: Sequence[bytes], object_bytes: int,
                 marks: Optional[Sequence[int]] = None, unlock: bool = False) -> "Future[list[bool]]":
        """Read object ``i`` straight into ``at[i]`` of a registered region. Resolves with hits."""
        return self._data("GET", keys, object_bytes, None, marks, None, None, unlock, (region, list(at), None))

    def put_from(self, region: int, at: Sequence[int], keys: Sequence[bytes], object_bytes: int,
                 marks: Optional[Sequence[int]] = None) -> "Future[list[bool]]":
        """Store object ``i`` from ``at[i]`` of a registered region. Resolves with a ``StoreResult``."""
        return self._data("PUT", keys, object_bytes, None, marks, None, None, False, (region, list(at), None))

    def get_scattered(self, pieces: Sequence[tuple[int, int]], at: Sequence[int], keys: Sequence[bytes],
                      marks: Optional[Sequence[int]] = None) -> "Future[list[bool]]":
        """Read each object straight into its ``pieces`` (``(region, length)``, in the object's
        byte order): piece k of object i at ``at[i * len(pieces) + k]`` of its region. The
        gateway checks the whole object before any piece lands. Resolves with hits."""
        obj = sum(int(n) for _, n in pieces)
        return self._data("GET", keys, obj, None, marks, None, None, False, (None, list(at), list(pieces)))

    def put_scattered(self, pieces: Sequence[tuple[int, int]], at: Sequence[int], keys: Sequence[bytes],
                      marks: Optional[Sequence[int]] = None) -> "Future[list[bool]]":
        """Store each object from its ``pieces`` (as ``get_scattered``). Resolves with a ``StoreResult``."""
        obj = sum(int(n) for _, n in pieces)
        return self._data("PUT", keys, obj, None, marks, None, None, False, (None, list(at), list(pieces)))

    def delete(self, keys: Sequence[bytes], marks: Optional[Sequence[int]] = None) -> "Future[int]":
        """Remove objects; resolves with how many existed."""
        msg = P.Delete(keys=list(keys), marks=None if marks is None else list(marks))
        return self._call(msg, _DELETE_OK, lambda r: r.deleted, 0)

    def clean(self) -> "Future[Optional[int]]":
        """Ask the gateway to delete everything; resolves with how many objects it deleted, or
        None when it refused (shared storage, requests in flight, not an operator: logged)."""
        return self._call(P.Clean(), _DELETE_OK, lambda r: r.deleted, None)

    def stats(self) -> "Future[dict]":
        return self._call(P.Stats(), _STATS_OK, lambda r: r.stats, {})

    def close(self) -> None:
        """Detach from the gateway and stop the I/O thread."""
        if self._closed:
            return
        if self._enabled:
            try:
                self._call(P.Bye(), _OK, lambda r: None).result(timeout=1.0)
            except Exception:
                pass
        self._closed = True
        self._enabled = False
        self._wake()
        self._thread.join(timeout=2.0)
        while self._outbox:                     # queued after the I/O thread's last pass
            self._fail(self._outbox.popleft()[1])
        if self._ring is not None:
            self.ring = None
            self._ring.close()
        if self._door is not None:
            self._door.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---------------------------------------------------------------- internals
    def _attach(self, layout: dict) -> None:
        door = door_of(self.config)
        try:
            session = DoorSession(door, self.config.connect_timeout_s)
        except (OSError, EOFError, ValueError, P.ProtocolError) as exc:
            self._turn_off(f"no gateway let us in at {door} ({exc})")
            return
        try:
            ring = Ring.from_fd(session.ring_fd, session.ring_size) if self.rank is not None else None
        except (OSError, ValueError) as exc:
            session.close()
            self._turn_off(f"the gateway's ring is not usable: {exc}")
            return
        if self.rank is None:
            os.close(session.ring_fd)
        self._door = session
        self._wake()          # the I/O thread starts watching the door
        try:
            hello = P.Hello(session=session.token, engine=self.engine_id, world=self.world_size,
                            rank=self.rank, role="rank" if self.rank is not None else "lookup",
                            namespace=self.config.namespace, layout=layout)
        except (ValueError, TypeError) as exc:
            if ring is not None:
                ring.close()
            self._turn_off(f"this engine cannot attach: {exc}")
            return
        busy_until = time.monotonic() + self.config.busy_wait_s
        while True:
            fut = self._call(hello, _OK, lambda r: r, None, raw_errors=True)
            try:
                reply = fut.result(timeout=self.config.connect_timeout_s)
            except Exception:
                reply = None
            # The engine before us may have died a moment ago: the gateway frees it
            # once its heartbeats stop, so wait a little rather than give up.
            if not isinstance(reply, P.Error) or reply.code != P.ENGINE_BUSY or time.monotonic() > busy_until:
                break
            time.sleep(0.5)
        if not isinstance(reply, P.Ok) and ring is not None:
            ring.close()
        if reply is None:
            self._turn_off(f"no gateway answered on {self.config.host}:{self.config.port}")
            return
        if isinstance(reply, P.Error):
            self.attach_error = f"{reply.code}: {reply.msg}"
            logger.error("Gateway on port %d refused this engine: %s", self.config.port, self.attach_error)
            self._turn_off(self.attach_error)
            return
        self._attached = True
        if self.rank is None:
            logger.info("Attached to the adpkv gateway on port %d for lookups", self.config.port)
            return
        self._ring = ring
        self.ring = ring.buf
        logger.info("Attached to the adpkv gateway on port %d as rank %d/%d (ring %d bytes)",
                    self.config.port, self.rank, self.world_size, ring.size)

    def _data(self, op, keys, object_bytes, on_batch, marks, tag, slice_, unlock=False, into=None):
        n = len(keys)
        if n == 0:
            return _done([] if op == "GET" else StoreResult.none(0))
        if not self._enabled or self.rank is None:
            return _done([False] * n if op == "GET" else StoreResult.none(n))
        region, at, pieces = into if into is not None else (None, None, None)
        fields = dict(keys=list(keys), obj=int(object_bytes), marks=None if marks is None else list(marks),
                      tag=None if tag is None else str(tag), region=region, at=at,
                      pieces=None if pieces is None else [P.Piece(int(r), int(n)) for r, n in pieces])
        msg = P.Get(unlock=bool(unlock), **fields) if op == "GET" else P.Put(**fields)
        pending = _Pending(Future(), op, n, on_batch, 0.0, slice_ or (0, int(object_bytes)), _DATA, data=True)
        if into is not None:
            # The gateway writes into (GET) or reads from (PUT) our buffer only until we give up
            # on the request: after that the engine may reuse it. A stalled gateway must neither
            # write into it later nor store what the engine put there since under these keys.
            pending.region_by = time.monotonic() + self.config.timeout_s - REGION_WRITE_MARGIN_S
            if op == "GET":
                msg.write_by = pending.region_by
            else:
                msg.read_by = pending.region_by
        return self._submit(msg, pending)

    def _call(self, msg: P.Message, replies: P.ReplyDecoder, convert, miss: Any = None, raw_errors: bool = False):
        """One control request. Resolves with ``convert(reply)``, or with ``miss`` when the
        cache is off, the gateway does not answer, refuses (unless ``raw_errors``: then the
        ``Error`` reply itself) or answers something malformed."""
        if not self._enabled:
            return _done(miss)
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
        return self._submit(msg, _Pending(fut, msg.op, 0, None, 0.0, None, replies), outer)

    def _submit(self, msg, pending: _Pending, returned: Optional[Future] = None) -> Future:
        if self._closed:                        # a call racing close(): answer it as a miss
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

    def _wake(self):
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _send(self, msg: P.Message) -> None:
        self._sock.send(P.encode(msg), zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        door_fd = None
        try:
            while not self._closed:
                events = poller.poll(100)
                if door_fd is None and self._door is not None and self._enabled:
                    # the door stays open while the gateway lives: a hang-up means it is gone
                    door_fd = self._door.fileno()
                    poller.register(door_fd, zmq.POLLERR)
                if door_fd is not None and any(what == door_fd for what, _ in events):
                    poller.unregister(door_fd)
                    self._turn_off("the gateway went away (its door closed)")
                self._drain_wake()
                while self._outbox:
                    req_id, pending, msg = self._outbox.popleft()
                    if not self._enabled:
                        self._fail(pending)
                        continue
                    self._pending[req_id] = pending
                    try:
                        self._send(msg)
                    except zmq.ZMQError as exc:
                        self._turn_off(f"send failed: {exc}")
                while self._enabled:
                    try:
                        frame = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._last_recv = time.monotonic()
                    self._handle(frame)
                if self._enabled:
                    self._check_time()
        finally:
            self._sock.close(0)
            for pending in list(self._pending.values()):
                self._fail(pending)
            self._pending.clear()

    def _drain_wake(self):
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _check_time(self):
        now = time.monotonic()
        for pending in self._pending.values():
            if now > pending.deadline:
                self._turn_off(f"{pending.op} got no answer within {self.config.timeout_s:.1f} s")
                return
        if self._attached and now - self._last_recv > self.config.heartbeat_s \
                and now - self._last_ping > self.config.heartbeat_s:
            self._last_ping = now
            ping_id = next(self._ids)
            self._pending[ping_id] = _Pending(Future(), "PING", 0, None, now + self.config.timeout_s, None, _OK)
            try:
                self._send(P.Ping(id=ping_id))
            except zmq.ZMQError as exc:
                self._turn_off(f"send failed: {exc}")

    def _handle(self, frame: bytes) -> None:
        try:
            op, req_id = P.envelope(frame)
            pending = self._pending.get(req_id)
            msg = (pending.replies if pending is not None else _OK).decode(frame)
        except P.ProtocolError as exc:
            logger.warning("Ignoring a bad message from the gateway: %s", exc)
            return
        if isinstance(msg, P.Error) and msg.code == P.NOT_ATTACHED:
            # a restarted gateway: it has never heard of this rank (its ring is a new one too)
            self._turn_off("the gateway does not know this rank any more (it restarted)")
            return
        if pending is None:
            return
        pending.deadline = time.monotonic() + self.config.timeout_s
        if isinstance(msg, P.Batch):
            if pending.on_batch is not None:
                self._run_batch(msg, pending)
            return
        del self._pending[req_id]
        if pending.ok is None:          # a control call
            pending.future.set_result(msg)
            return
        if isinstance(msg, P.Done):
            flags = _flags(msg.hits if pending.op == "GET" else msg.stored, pending.n)
            flags = [f and bool(c) for f, c in zip(flags, pending.ok)]
            if pending.op == "PUT":
                flags = StoreResult(flags, _flags(msg.existed, pending.n))
            pending.future.set_result(flags)
        else:
            logger.warning("Gateway refused %s: %s %s", pending.op, msg.code, msg.msg)
            pending.future.set_result([False] * pending.n if pending.op == "GET" else StoreResult.none(pending.n))

    def _run_batch(self, msg: P.Batch, pending: _Pending) -> None:
        first, count = msg.first, msg.count
        if first < 0 or count < 0 or first + count > pending.n:
            logger.warning("Ignoring a batch outside the request (%d + %d of %d objects)", first, count, pending.n)
            return
        hits = _flags(msg.hits, count) if msg.hits is not None else None
        batch = RingBatch(first, count, msg.offset, msg.stride, msg.obj,
                          pending.slice[0], pending.slice[1], hits)
        ok = True
        if pending.op == "GET" and hits is not None and not any(hits):
            pass  # nothing to copy
        else:
            try:
                ok = pending.on_batch(batch) is not False
            except Exception:
                logger.exception("adpkv %s copy of %r failed", pending.op, batch)
                ok = False
        if ok:
            pending.ok[first:first + count] = b"\x01" * count
        reply = (P.Release if pending.op == "GET" else P.Filled)(id=msg.id, batch=msg.batch, ok=ok)
        try:
            self._send(reply)
        except zmq.ZMQError as exc:
            self._turn_off(f"send failed: {exc}")

    def _fail(self, pending: _Pending) -> None:
        """Resolve a request that will get no answer as a miss / not stored. A request into or
        out of one of our regions resolves only once the gateway may no longer touch it
        (``region_by``): until then the engine must not reuse the buffer."""
        if pending.future.done():
            return
        wait = pending.region_by - time.monotonic() if pending.region_by is not None else 0.0
        if wait > 0:
            pending.region_by = None
            timer = threading.Timer(wait, lambda: self._fail(pending))
            timer.daemon = True
            timer.start()
            return
        if pending.ok is None:
            pending.future.set_result(None)
        elif pending.op == "PUT":
            pending.future.set_result(StoreResult.none(pending.n))
        else:
            pending.future.set_result([False] * pending.n)

    def _turn_off(self, reason: str) -> None:
        if not self._enabled:
            return
        message = LOOKUPS_OFF_MESSAGE if self.rank is None else TURNED_OFF_MESSAGE
        logger.warning("%s (%s); the engine goes on without it", message, reason)
        self._enabled = False     # after the line: whoever sees the cache off finds it logged
        for pending in list(self._pending.values()):
            self._fail(pending)
        self._pending.clear()
        while self._outbox:
            self._fail(self._outbox.popleft()[1])
