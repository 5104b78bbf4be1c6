"""One request of a ``GatewayClient``: what it sends, how its replies decode, what it resolves with.

- ``RingBatch`` and the ``BatchCallback`` contract: the copies of a data request's ring batches.
- ``DataResult``: what a data request resolves with, read one way for GET and PUT (``ok``,
  ``all_ok``): ``LoadResult`` (a GET's hits), ``StoreResult`` (a PUT's stored and existed);
  ``nothing``: what a data request resolves with when it gets no usable answer.
- ``Destination``: where a data request's objects go (GET) or come from (PUT): ``ViaRing``
  (the ring, ``on_batch`` copies), ``InRegion`` (one registered region) or ``Scattered``
  (pieces of several regions).
- ``Pending``: a request in flight (its future, deadline, reply decoder, the objects this
  rank copied, and for a request into or out of a region the moment the gateway must stop
  touching it).
- ``data_request``: the GET/PUT message of a data request to its ``Destination``, with its
  ``Pending``.

Nothing here does I/O: ``link.Link`` sends the messages and resolves the futures.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence, Union

from adpkv_core.wire import protocol as P

REGION_WRITE_MARGIN_S = 0.5     # a request into/out of a region: the gateway stops touching it this long before we give up


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


class DataResult(abc.ABC):
    """What a data request (GET or PUT) resolves with, read the same way for both: ``ok[i]``,
    object ``i`` moved (read into its destination, or held by the card now); ``all_ok``,
    every object moved (True for no objects)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def ok(self) -> list[bool]:
        """Per object: moved."""

    @property
    def all_ok(self) -> bool:
        return all(self.ok)


@dataclasses.dataclass(frozen=True)
class LoadResult(DataResult):
    """The result of a GET: per key, ``hits[i]`` (object ``i`` was found and read into its
    destination: copied out of the ring by ``on_batch``, or written into the region)."""

    hits: list[bool]

    @property
    def ok(self) -> list[bool]:
        return self.hits

    @classmethod
    def none(cls, n: int) -> "LoadResult":
        """Nothing read: the answer when the cache is off or the request failed."""
        return cls([False] * n)


@dataclasses.dataclass(frozen=True)
class StoreResult(DataResult):
    """The result of a PUT: per key, ``stored[i]`` (the card holds it now) and ``existed[i]``
    (it held it already — a key names its content — and it was not written again)."""

    stored: list[bool]
    existed: list[bool]

    @property
    def ok(self) -> list[bool]:
        return self.stored

    @classmethod
    def none(cls, n: int) -> "StoreResult":
        """Nothing stored: the answer when the cache is off or the request failed."""
        return cls([False] * n, [False] * n)


def nothing(op: P.Op, n: int) -> DataResult:
    """What a data request of ``n`` objects resolves with when it gets no usable answer (the
    cache is off, the gateway refused or went away): ``n`` misses (GET) or nothing stored (PUT)."""
    return LoadResult.none(n) if op is P.Op.GET else StoreResult.none(n)


@dataclasses.dataclass(frozen=True)
class ViaRing:
    """Through the engine's ring: ``on_batch`` copies each batch out of (GET) or into (PUT)
    its slots (``BatchCallback``); ``slice``: this rank's ``(offset, bytes)`` of each object
    (None: all of it)."""

    on_batch: BatchCallback
    slice: Optional[tuple[int, int]] = None


@dataclasses.dataclass(frozen=True)
class InRegion:
    """Straight into (GET) or out of (PUT) one registered region: object ``i`` at ``at[i]``;
    no copy on the engine's side."""

    region: int
    at: list[int]


@dataclasses.dataclass(frozen=True)
class Scattered:
    """Each object over ``pieces`` (``(region, length)``, in the object's byte order) of
    registered regions: piece ``k`` of object ``i`` at ``at[i * len(pieces) + k]`` of its
    region; no copy on the engine's side."""

    pieces: list[tuple[int, int]]
    at: list[int]

    @property
    def object_bytes(self) -> int:
        return sum(int(n) for _, n in self.pieces)


Destination = Union[ViaRing, InRegion, Scattered]
"""Where a data request's objects go (GET) or come from (PUT)."""


def regions_of(dest: Destination) -> set[int]:
    """The registered regions ``dest`` names (none for the ring)."""
    match dest:
        case InRegion():
            return {dest.region}
        case Scattered():
            return {int(r) for r, _ in dest.pieces}
        case ViaRing():
            return set()


class Pending:
    """A request in flight: how its replies decode and where its result goes."""

    __slots__ = ("future", "op", "n", "on_batch", "deadline", "ok", "slice", "replies", "region_by",
                 "region_locks")

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
        # and our own descriptors of those regions, to take them back (``region_lock.take_back``)
        self.region_locks: tuple[int, ...] = ()


# How the replies to each kind of request decode (an ERROR is always possible).
OK = P.ReplyDecoder(P.Ok)
HELLO_OK = P.ReplyDecoder(P.HelloOk)
EXIST_OK = P.ReplyDecoder(P.ExistOk)
DELETE_OK = P.ReplyDecoder(P.DeleteOk)
STATS_OK = P.ReplyDecoder(P.StatsOk)
DATA = P.ReplyDecoder(P.Batch, P.Done)


def reply_flags(data: Optional[bytes], n: int) -> list[bool]:
    """Per-key flags of a reply; all False when they do not describe ``n`` keys."""
    flags = P.unpack_flags(data or b"")
    return flags if len(flags) == n else [False] * n


def resolved(value) -> Future:
    """A future that already holds ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def data_request(op: P.Op, keys: Sequence[bytes], object_bytes: int, dest: Destination,
                 marks: Optional[Sequence[int]], tag: Optional[str], unlock: bool, timeout_s: float,
                 region_locks: tuple[int, ...] = ()) -> tuple[P.Message, Pending]:
    """The GET or PUT message of ``keys`` to or from ``dest`` and its ``Pending``. ``timeout_s``:
    how long the client waits for the gateway; ``region_locks``: a GET's own descriptors of
    the regions ``dest`` names (the ``Pending`` owns them: ``link.Link`` closes them when the
    request resolves)."""
    region: Optional[int] = None
    at: Optional[list[int]] = None
    pieces: Optional[list[P.Piece]] = None
    on_batch: Optional[BatchCallback] = None
    slice_ = (0, int(object_bytes))
    match dest:
        case ViaRing():
            on_batch = dest.on_batch
            slice_ = dest.slice or slice_
        case InRegion():
            region, at = dest.region, list(dest.at)
        case Scattered():
            at, pieces = list(dest.at), [P.Piece(int(r), int(n)) for r, n in dest.pieces]
    fields: dict[str, Any] = dict(keys=list(keys), obj=int(object_bytes), marks=None if marks is None else list(marks),
                  tag=None if tag is None else str(tag), region=region, at=at, pieces=pieces)
    msg = P.Get(unlock=bool(unlock), **fields) if op is P.Op.GET else P.Put(**fields)
    pending = Pending(Future(), op, len(keys), on_batch, 0.0, slice_, DATA, data=True)
    if not isinstance(dest, ViaRing):
        # The gateway writes into (GET) or reads from (PUT) our buffer only until we give up
        # on the request: after that the engine may reuse it. A stalled gateway must neither
        # write into it later nor store what the engine put there since under these keys.
        pending.region_by = time.monotonic() + timeout_s - REGION_WRITE_MARGIN_S
        if isinstance(msg, P.Get):
            msg.write_by = pending.region_by
            pending.region_locks = region_locks      # a GET given up waits for the gateway's writes
        else:
            msg.read_by = pending.region_by
    return msg, pending
