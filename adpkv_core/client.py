"""The client SDK every adapter uses to reach its gateway.

One ``GatewayClient`` per engine rank. Calls are non-blocking and return
``concurrent.futures.Future`` objects; a background I/O thread owns the ZeroMQ
socket, runs the copy callbacks of data requests and watches deadlines. When
the gateway stops answering, the client turns the external cache off on this
rank (logged once) and every later call resolves at once as a miss / no-op:
the engine keeps serving from its own memory.

This module is the public API and the attachment (the door, HELLO, then the engine's
ring: the gateway hands it only to an attached rank of its owner); the
rest is in ``request`` (what a request sends and resolves with: ``RingBatch``, the
``BatchCallback`` contract, ``LoadResult`` and ``StoreResult``, the ``Destination`` of a
data request: the ring, a region, scattered pieces) and ``link``
(the control connection and its I/O thread: replies, copies, heartbeats, deadlines,
turning off). Their public names stay importable from here.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from typing import Optional, Sequence

import zmq

from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import DoorNotFound, DoorSession, UntrustedGateway, check_gateway, find_door
from adpkv_core.link import LOOKUPS_OFF_MESSAGE, TURNED_OFF_MESSAGE, Link
from adpkv_core.request import (DELETE_OK, EXIST_OK, HELLO_OK, OK, STATS_OK, BatchCallback, DataResult, Destination,
                                InRegion, LoadResult, RingBatch, Scattered, StoreResult, ViaRing, data_request, nothing,
                                regions_of, reply_flags, resolved)
from adpkv_core.memory.ring import Ring
from adpkv_core.settings import ClientConfig

# what callers import from here (some of it defined in request, link, settings)
__all__ = ["GatewayClient", "RingBatch", "BatchCallback", "DataResult", "LoadResult", "StoreResult", "ClientConfig",
           "door_of", "gateway_answers", "TURNED_OFF_MESSAGE", "LOOKUPS_OFF_MESSAGE"]

logger = logging.getLogger("adpkv.client")


def door_of(config: ClientConfig) -> str:
    """The door (Unix socket) of the gateway ``config`` names: its ``socket``, else the door for
    its port in the door directory of a user whose gateway it trusts (``door.find_door``;
    ``DoorNotFound`` when there is none)."""
    return config.socket or find_door(config.port, config.trusted_gateway_uids())


def gateway_answers(config: ClientConfig, timeout_s: float = 0.3) -> bool:
    """Whether a gateway we trust is serving ``config``'s door and port right now (one cheap
    probe, no attachment): the re-attach policy asks this before building a new client. A
    door served by a user we do not trust (``gateway_users``) is no gateway: False."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(timeout_s)
    try:
        door = door_of(config)
        probe.connect(door)
        check_gateway(probe, door, config.trusted_gateway_uids())
    except OSError:
        return False
    finally:
        probe.close()
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{config.host}:{config.port}")
        sock.send(P.encode(P.Ping(id=0)))
        return bool(sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close(0)


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
        self.attach_error: Optional[str] = None
        self._ring: Optional[Ring] = None
        self._door: Optional[DoorSession] = None
        self._door_lock = threading.Lock()       # door requests: one at a time
        self._region_locks: dict[int, int] = {}   # region id -> our own descriptor of it (region_lock)
        self._link = Link(config, rank)
        self._attach(layout or {})

    # ---------------------------------------------------------------- public API
    @property
    def enabled(self) -> bool:
        """False once the external cache was turned off on this rank."""
        return self._link.enabled

    def restores_in_flight(self) -> int:
        """This client's GETs not answered yet."""
        return self._link.restores_in_flight()

    def exist(self, keys: Sequence[bytes], marks: Optional[Sequence[int]] = None,
              lock: bool = False) -> "Future[list[bool]]":
        """Which keys are stored (one round trip). ``lock`` pins the hits against eviction."""
        msg = P.Exist(keys=list(keys), marks=None if marks is None else list(marks), lock=bool(lock))
        return self._link.call(msg, EXIST_OK, lambda r: reply_flags(r.hits, len(keys)), [False] * len(keys))

    def unlock(self, keys: Sequence[bytes]) -> "Future[None]":
        """Release pins taken by ``exist(lock=True)``."""
        return self._link.call(P.Unlock(keys=list(keys)), OK, lambda r: None)

    def get(self, keys: Sequence[bytes], object_bytes: int, on_batch: BatchCallback,
            marks: Optional[Sequence[int]] = None, tag: Optional[str] = None,
            slice: Optional[tuple[int, int]] = None, unlock: bool = False) -> "Future[LoadResult]":
        """Read objects into the ring; ``on_batch`` copies each batch out. Resolves with a
        ``LoadResult`` (the hits).

        ``unlock`` releases this rank's pins (from ``exist(lock=True)``) on the keys when done.
        """
        return self._data(P.Op.GET, keys, object_bytes, ViaRing(on_batch, slice), marks, tag, unlock)

    def put(self, keys: Sequence[bytes], object_bytes: int, on_batch: BatchCallback,
            marks: Optional[Sequence[int]] = None, tag: Optional[str] = None,
            slice: Optional[tuple[int, int]] = None) -> "Future[StoreResult]":
        """``on_batch`` fills ring slots, the gateway stores them. Resolves with a ``StoreResult``."""
        return self._data(P.Op.PUT, keys, object_bytes, ViaRing(on_batch, slice), marks, tag)

    def register_region(self, path: str, offset: int, size: int) -> "Future[Optional[int]]":
        """Hand the gateway ``size`` bytes at ``offset`` of a shared-memory file of ours, so
        that ``get_into``/``put_from`` move objects between the cards and it with no copy
        here. This process opens the file itself (read-write, with its own rights) and passes
        the descriptor through the door: a region is only ever memory we can reach. Resolves
        with the region id, or None when refused (the reason is logged)."""
        if not self._link.enabled or self.rank is None or self._door is None:
            return resolved(None)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:      # ValueError: a path with a NUL byte
            logger.warning("Cannot open %s as a region: %s", path, exc)
            return resolved(None)
        try:
            # our own open file description of the buffer, for taking it back from the gateway
            # (``region_lock.take_back``): the gateway's locks are on the one we pass it
            lock_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            logger.warning("Cannot open %s again for its lock: %s", path, exc)
            return resolved(None)
        try:
            with self._door_lock:
                reply = self._door.register_region(fd, offset, size, timeout_s=self.config.timeout_s)
        except (OSError, EOFError, P.ProtocolError) as exc:
            logger.warning("Registering region %s failed: %s", path, exc)
            reply = None
        finally:
            os.close(fd)
        if isinstance(reply, P.Error):
            logger.warning("The gateway refused region %s: %s %s", path, reply.code, reply.msg)
        if not isinstance(reply, P.RegionOk):
            os.close(lock_fd)
            return resolved(None)
        self._region_locks[reply.region] = lock_fd
        return resolved(reply.region)

    def map_objects(self, keys: Sequence[bytes], object_bytes: int,
                    marks: Optional[Sequence[int]] = None) -> tuple[P.Message, list[int]]:
        """MAP through the door (``adpkv_core.direct_map`` uses it): ``(reply, descriptors)``,
        one read-only descriptor per hit (the caller's to close). Synchronous; at most
        ``protocol.MAX_MAP_KEYS`` keys. ``ConnectionError`` when this client has no door
        (off, or a lookup peer); ``OSError``/``EOFError``/``ProtocolError`` from the door."""
        if not self._link.enabled or self.rank is None or self._door is None:
            raise ConnectionError("no gateway attachment to map objects through")
        with self._door_lock:       # as long as a data request may take (the gateway checks each object)
            return self._door.map_objects(keys, object_bytes, marks, timeout_s=self.config.timeout_s)

    def get_into(self, region: int, at: Sequence[int], keys: Sequence[bytes], object_bytes: int,
                 marks: Optional[Sequence[int]] = None, unlock: bool = False) -> "Future[LoadResult]":
        """Read object ``i`` straight into ``at[i]`` of a registered region. Resolves with a
        ``LoadResult``."""
        return self._data(P.Op.GET, keys, object_bytes, InRegion(region, list(at)), marks, None, unlock)

    def put_from(self, region: int, at: Sequence[int], keys: Sequence[bytes], object_bytes: int,
                 marks: Optional[Sequence[int]] = None) -> "Future[StoreResult]":
        """Store object ``i`` from ``at[i]`` of a registered region. Resolves with a ``StoreResult``."""
        return self._data(P.Op.PUT, keys, object_bytes, InRegion(region, list(at)), marks, None)

    def get_scattered(self, pieces: Sequence[tuple[int, int]], at: Sequence[int], keys: Sequence[bytes],
                      marks: Optional[Sequence[int]] = None) -> "Future[LoadResult]":
        """Read each object straight into its ``pieces`` (``(region, length)``, in the object's
        byte order): piece k of object i at ``at[i * len(pieces) + k]`` of its region. The
        gateway checks the whole object before any piece lands. Resolves with a ``LoadResult``."""
        dest = Scattered(list(pieces), list(at))
        return self._data(P.Op.GET, keys, dest.object_bytes, dest, marks, None)

    def put_scattered(self, pieces: Sequence[tuple[int, int]], at: Sequence[int], keys: Sequence[bytes],
                      marks: Optional[Sequence[int]] = None) -> "Future[StoreResult]":
        """Store each object from its ``pieces`` (as ``get_scattered``). Resolves with a ``StoreResult``."""
        dest = Scattered(list(pieces), list(at))
        return self._data(P.Op.PUT, keys, dest.object_bytes, dest, marks, None)

    def delete(self, keys: Sequence[bytes], marks: Optional[Sequence[int]] = None) -> "Future[int]":
        """Remove objects; resolves with how many existed."""
        msg = P.Delete(keys=list(keys), marks=None if marks is None else list(marks))
        return self._link.call(msg, DELETE_OK, lambda r: r.deleted, 0)

    def clean(self) -> "Future[Optional[int]]":
        """Ask the gateway to delete everything; resolves with how many objects it deleted, or
        None when it refused (shared storage, requests in flight, not an operator: logged)."""
        return self._link.call(P.Clean(), DELETE_OK, lambda r: r.deleted, None)

    def stats(self) -> "Future[Optional[P.GatewayStats]]":
        """The gateway's figures (what ``adpkv status`` shows); None when the cache is off or
        the gateway refused (logged)."""
        return self._link.call(P.Stats(), STATS_OK, lambda r: r.stats, None)

    def close(self) -> None:
        """Detach from the gateway and stop the I/O thread."""
        link = self._link
        if link.closed:
            return
        if link.enabled:
            try:
                link.call(P.Bye(), OK, lambda r: None).result(timeout=1.0)
            except Exception:
                pass
        link.stop()
        if self._ring is not None:
            self.ring = None
            self._ring.close()
        if self._door is not None:
            self._door.close()
        for fd in self._region_locks.values():
            os.close(fd)
        self._region_locks.clear()

    # ---------------------------------------------------------------- internals
    def _attach(self, layout: dict) -> None:
        try:
            door = door_of(self.config)
            session = DoorSession(door, self.config.connect_timeout_s, self.config.trusted_gateway_uids())
        except (UntrustedGateway, DoorNotFound) as exc:
            self._link.turn_off(str(exc))
            return
        except (OSError, EOFError, ValueError, P.ProtocolError) as exc:
            self._link.turn_off(f"no gateway let us in at {door} ({exc})")
            return
        self._door = session
        self._link.watch_door(session)
        try:
            hello = P.Hello(session=session.token, engine=self.engine_id, world=self.world_size,
                            rank=self.rank, role="rank" if self.rank is not None else "lookup",
                            namespace=self.config.namespace, layout=layout)
        except (ValueError, TypeError) as exc:
            self._link.turn_off(f"this engine cannot attach: {exc}")
            return
        busy_until = time.monotonic() + self.config.busy_wait_s
        while True:
            fut = self._link.call(hello, HELLO_OK, lambda r: r, None, raw_errors=True)
            try:
                reply = fut.result(timeout=self.config.connect_timeout_s)
            except Exception:
                reply = None
            # The engine before us may have died a moment ago: the gateway frees it
            # once its heartbeats stop, so wait a little rather than give up.
            if not isinstance(reply, P.Error) or reply.code != P.ENGINE_BUSY or time.monotonic() > busy_until:
                break
            time.sleep(0.5)
        # only the gateway behind the door knows the session's proof: anything else that
        # answers on the control port (a process that took the port) is not our gateway
        if isinstance(reply, P.HelloOk) and not hmac.compare_digest(reply.proof, session.proof):
            self._link.turn_off(f"what answers on {self.config.host}:{self.config.port} is not the gateway of "
                                f"the door {door} (its HELLO reply lacks the session's proof): another process "
                                "holds the control port; not attaching to it")
            return
        if reply is None:
            self._link.turn_off(f"no gateway answered on {self.config.host}:{self.config.port}")
            return
        if isinstance(reply, P.Error):
            self.attach_error = f"{reply.code}: {reply.msg}"
            logger.error("Gateway on port %d refused this engine: %s", self.config.port, self.attach_error)
            self._link.turn_off(self.attach_error)
            return
        self._link.attached = True
        if self.rank is None:
            logger.info("Attached to the adpkv gateway on port %d for lookups", self.config.port)
            return
        # the ring of our engine, only now: it is handed to an attached rank of its owner only
        try:
            with self._door_lock:
                ring = session.ring()
        except (OSError, EOFError, ValueError, P.ProtocolError) as exc:
            self._link.turn_off(f"the gateway's ring is not usable: {exc}")
            return
        self._ring = ring
        self.ring = ring.buf
        logger.info("Attached to the adpkv gateway on port %d as rank %d/%d (ring %d bytes)",
                    self.config.port, self.rank, self.world_size, ring.size)

    def _data(self, op: P.Op, keys: Sequence[bytes], object_bytes: int, dest: Destination,
              marks: Optional[Sequence[int]], tag: Optional[str], unlock: bool = False) -> Future:
        """A GET (resolves with a ``LoadResult``) or PUT (a ``StoreResult``) to or from ``dest``."""
        n = len(keys)
        if n == 0 or not self._link.enabled or self.rank is None:
            return resolved(nothing(op, n))
        locks: tuple[int, ...] = ()
        if op is P.Op.GET:
            # the request's own duplicates (closed when it resolves): close() may close ours meanwhile
            locks = tuple(os.dup(self._region_locks[r]) for r in regions_of(dest) if r in self._region_locks)
        msg, pending = data_request(op, keys, object_bytes, dest, marks, tag, unlock, self.config.timeout_s, locks)
        return self._link.submit(msg, pending)
