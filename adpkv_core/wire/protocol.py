"""The control protocol between engine ranks and the gateway: one typed message per exchange.

Every message is one msgpack map with ``v`` (protocol version), ``op`` (the message
type) and, for requests, ``id`` (chosen by the client, echoed in every reply). Data
never travels here: it moves through the ring, and messages only name ring offsets.
Both ends use the types below (``msgspec`` structs): a frame is decoded and checked —
field types and bounds included, and every list that holds one entry per key (``marks``,
``at``) against the keys — in one place, ``decode_request``, and a bad frame fails there
with one code (BAD_MESSAGE), before the gateway acts on it.

Requests (client → gateway, ZeroMQ)::

    HELLO  session, engine, world, rank | role=lookup, namespace, layout  -> OK proof
    BYE | PING                                         -> OK
    EXIST  keys, marks?, lock?                         -> OK hits
    UNLOCK keys                                        -> OK
    GET    keys, marks?, obj, tag?, unlock?            -> BATCH* (hits), then DONE hits
    PUT    keys, marks?, obj, tag?                     -> BATCH*, then DONE stored existed
    GET/PUT ... region, at  (no tag)                   -> DONE only: the gateway moves each object
           between the card and ``at[i]`` of a region the session handed over at the door
           (``adpkv_core.wire.door``), the engine copies nothing
    GET/PUT ... pieces, at  (no region, no tag)        -> DONE only: as above, each object scattered
           over a few (region, length) pieces (e.g. a page's K and V halves in a host pool)
    RELEASE batch        (after copying a GET batch out of the ring)
    FILLED  batch, ok    (after copying a PUT batch into the ring)
    DELETE keys, marks?                                -> OK deleted
    CLEAN  session                                     -> OK deleted | ERROR CLEAN_REFUSED / FORBIDDEN
    DRAIN  session, card                               -> OK serial fingerprint | ERROR DRAIN_REFUSED / FORBIDDEN
    STATS  session                                     -> OK stats

Door requests (client → gateway, Unix socket, ``adpkv_core.wire.door``)::

    SESSION                                            -> OK token proof
    RING    (after HELLO as a rank of the engine)       -> OK size  + the engine's ring fd | ERROR FORBIDDEN
    REGION  offset, size   + one fd                    -> OK region
    MAP     keys, obj, marks? (after HELLO as a rank)   -> OK hits offset + one read-only fd per hit
                                                          | ERROR FORBIDDEN (``adpkv_core.direct_map``)

``session`` is the token a process got at the gateway's door: nothing but PING is
served without one. HELLO binds the connection to it; an engine belongs to the uid
of the session that attached it first, a key namespace to the uid that first named it
(EXIST, GET, PUT, DELETE; or the owners the gateway's configuration names): a request naming
keys of another user's namespace is FORBIDDEN whole. HELLO's reply carries the session's
``proof`` (a second random the door handed out with the token, never sent by the client): only
the gateway behind the door knows it, so a process that took the control port cannot pass for
the gateway. ``hits``/``stored``/``existed`` are bytes with
one 0/1 byte per key. A ``BATCH`` names objects ``first .. first+count-1`` of the
request at ring ``offset`` with ``stride`` bytes between them.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Optional, Union, get_args

import msgspec
from msgspec import Meta, Struct

from adpkv_core.keys import KEY_BYTES

PROTOCOL_VERSION = 1

MAX_KEYS = 1 << 20             # keys in one request
MAX_PIECES = 256               # pieces of one object in a scattered region request
MAX_WORLD = 1024               # ranks of one engine
MAX_NAME = 256                 # characters of an engine id, a namespace or a tag
MAX_LAYOUT_BYTES = 16 << 10    # an engine's layout map, encoded

# Error codes of an ERROR reply.
BAD_MESSAGE = "BAD_MESSAGE"          # not a msgpack map, or a field of the wrong type or out of bounds
BAD_VERSION = "BAD_VERSION"          # another protocol version
UNKNOWN_OP = "UNKNOWN_OP"
NOT_ATTACHED = "NOT_ATTACHED"        # a request before HELLO
ENGINE_BUSY = "ENGINE_BUSY"          # another engine is attached to this gateway
RANK_TAKEN = "RANK_TAKEN"            # this rank of the engine is attached already
TOO_LARGE = "TOO_LARGE"              # one object does not fit the ring
UNKNOWN_BATCH = "UNKNOWN_BATCH"      # RELEASE/FILLED of a batch the gateway never handed out
COLLECTIVE_MISMATCH = "COLLECTIVE_MISMATCH"  # ranks sent different parts for one tag
CLEAN_REFUSED = "CLEAN_REFUSED"      # shared_storage: nothing was deleted
DRAIN_REFUSED = "DRAIN_REFUSED"      # the card cannot be drained now (see the message); nothing changed
BAD_REGION = "BAD_REGION"            # a region that cannot be used, or a range outside it
FORBIDDEN = "FORBIDDEN"              # no session, another user's engine or key namespace, or not an operator
CARD_ERROR = "CARD_ERROR"            # the cards did not answer a metadata request
NO_RESOURCES = "NO_RESOURCES"        # the gateway is out of descriptors or memory for this now; try later
INTERNAL = "INTERNAL"                # a bug in the gateway; never an answer to bad input


class ProtocolError(Exception):
    """A message that breaks the protocol; ``code`` is sent back in the ERROR reply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---------------------------------------------------------------- field types (with their bounds)
Key = Annotated[bytes, Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS)]
Marks = Optional[Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_KEYS)]]   # uint64 (msgpack holds no more)
Name = Annotated[str, Meta(max_length=MAX_NAME)]
ObjectBytes = Annotated[int, Meta(gt=0, lt=1 << 48)]
Offset = Annotated[int, Meta(ge=0, lt=1 << 62)]
Flags = bytes            # one 0/1 byte per key


class Message(Struct, tag_field="op", kw_only=True):
    """Base of every message: the version and the request id it belongs to. Fields without a
    default are required; unknown fields are ignored (a newer peer may add some)."""

    v: int = PROTOCOL_VERSION
    id: Any = None

    @property
    def op(self) -> str:
        return str(self.__struct_config__.tag)


class Op(str, enum.Enum):
    """The data requests' ops: what a request moves, and which way (a ``str``: it compares equal
    to the op on the wire)."""
    GET = "GET"
    PUT = "PUT"


def _op(name: str) -> dict:
    """The struct options of message type ``name`` (its ``op`` on the wire)."""
    return {"tag": name, "kw_only": True}


# ---------------------------------------------------------------- requests (client → gateway)
class Hello(Message, **_op("HELLO")):
    """Attach a rank (``rank``) or a lookup-only peer (``role="lookup"``, no rank) of an engine."""

    engine: Name
    world: Annotated[int, Meta(ge=1, le=MAX_WORLD)]
    rank: Optional[Annotated[int, Meta(ge=0, lt=MAX_WORLD)]] = None
    role: str = "rank"
    namespace: Name = ""
    layout: dict = {}
    session: Optional[bytes] = None

    def __post_init__(self):
        if not self.engine or not self.engine.isprintable() or not self.namespace.isprintable():
            raise ValueError(f"engine (1 to {MAX_NAME}) and namespace (at most {MAX_NAME}) must be printable "
                             "characters")
        if self.role not in ("rank", "lookup"):
            raise ValueError("role must be rank or lookup")
        if (self.role == "rank") != (self.rank is not None):
            raise ValueError("a rank has a rank number, a lookup peer none")
        if self.rank is not None and self.rank >= self.world:
            raise ValueError(f"need 0 <= rank < world <= {MAX_WORLD}")
        if len(msgspec.msgpack.encode(self.layout)) > MAX_LAYOUT_BYTES:
            raise ValueError(f"layout is larger than {MAX_LAYOUT_BYTES} bytes")


class Bye(Message, **_op("BYE")):
    """Detach this connection."""


class Ping(Message, **_op("PING")):
    """Liveness; served without a session."""


class _Keyed(Message, kw_only=True):
    """A request about objects: ``keys``, and optionally one dialog mark per key."""

    keys: Keys
    marks: Marks = None

    def __post_init__(self):
        _same_length("marks", self.marks, len(self.keys))


def _same_length(name: str, values: Optional[list], n: int, what: str = "keys") -> None:
    """A list that must hold one entry per key (``n`` of them), when it is given."""
    if values is not None and len(values) != n:
        raise ValueError(f"{name} and {what} differ in length ({len(values)} for {n})")


class Exist(_Keyed, **_op("EXIST")):
    """Which keys are stored; ``lock`` pins the hits against eviction."""

    lock: bool = False


class Unlock(Message, **_op("UNLOCK")):
    keys: Keys


class Piece(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One piece of every object of a scattered region request: ``length`` bytes of the object,
    in region ``region`` (the object's pieces follow each other in the object's byte order)."""

    region: Annotated[int, Meta(ge=0)]
    length: Annotated[int, Meta(ge=1)]


class _Data(_Keyed, kw_only=True):
    obj: ObjectBytes
    tag: Optional[Name] = None
    region: Optional[Annotated[int, Meta(ge=0)]] = None
    at: Optional[Annotated[list[Offset], Meta(max_length=MAX_KEYS * MAX_PIECES)]] = None
    # a scattered region request: object i is ``len(pieces)`` pieces, piece k at
    # ``at[i * len(pieces) + k]`` of region ``pieces[k].region`` (no ``region`` then)
    pieces: Optional[Annotated[list[Piece], Meta(min_length=1, max_length=MAX_PIECES)]] = None

    def __post_init__(self):
        super().__post_init__()
        if self.pieces is not None:
            if self.region is not None or self.tag is not None:
                raise ValueError("a scattered request names its regions in its pieces (no region, no tag)")
            if sum(p.length for p in self.pieces) != self.obj:
                raise ValueError("the pieces' lengths do not add up to the object size")
            if self.at is None:
                raise ValueError("a scattered request needs at: one offset per piece of every key")
            _same_length("at", self.at, len(self.keys) * len(self.pieces), "pieces of every key")
        elif self.region is not None:
            if self.tag is not None:
                raise ValueError("a request into a region is one rank's own (no tag)")
            if self.at is None:
                raise ValueError("a request into a region needs at: one offset per key")
            _same_length("at", self.at, len(self.keys))
        elif self.at is not None:
            raise ValueError("at names places in a region: it needs region or pieces")


class Get(_Data, **_op("GET")):
    """Read objects into the ring (BATCH per ring extent, then DONE) or into a region (DONE).

    ``write_by`` (into a region): the time, on the host's monotonic clock (``CLOCK_MONOTONIC``,
    one for every process of the host), after which the client has given up on the request
    and its engine may reuse the buffer: the gateway writes nothing into the region after it."""

    unlock: bool = False
    write_by: Optional[float] = None


class Put(_Data, **_op("PUT")):
    """Store objects from the ring (BATCH to fill per ring extent, then DONE) or from a region.

    ``read_by`` (from a region): the time, on the host's monotonic clock, after which the
    client has given up on the request and its engine may put other bytes in the buffer: the
    gateway stores nothing it read from the region after it."""

    read_by: Optional[float] = None


class Release(Message, **_op("RELEASE")):
    """A GET batch is copied out of the ring."""

    batch: int
    ok: bool = True


class Filled(Message, **_op("FILLED")):
    """A PUT batch is in the ring (``ok`` False: it is not, store none of it)."""

    batch: int
    ok: bool = True


class Delete(_Keyed, **_op("DELETE")):
    """Remove objects (every fragment of each)."""


class Clean(Message, **_op("CLEAN")):
    """Delete every object (operators only; refused on shared storage)."""

    session: Optional[bytes] = None


class Drain(Message, **_op("DRAIN")):
    """Move every object of ``card`` (its serial or its device as configured) to the other
    cards: a card-set change without it (operators only; progress in STATS ``layout_change``)."""

    session: Optional[bytes] = None
    card: str = ""


class Stats(Message, **_op("STATS")):
    session: Optional[bytes] = None


Request = Union[Hello, Bye, Ping, Exist, Unlock, Get, Put, Release, Filled, Delete, Clean, Drain, Stats]
REQUEST_OPS = frozenset(t.__struct_config__.tag for t in get_args(Request))

# ---------------------------------------------------------------- replies (gateway → client)


class Ok(Message, **_op("OK")):
    """Done, nothing to say (BYE, PING, UNLOCK)."""


class HelloOk(Message, **_op("OK")):
    """HELLO accepted: ``proof`` is the one the door handed this session (``SessionOk.proof``)."""

    proof: bytes = b""


class ExistOk(Message, **_op("OK")):
    hits: Flags = b""


class DeleteOk(Message, **_op("OK")):
    deleted: int = 0


class DrainOk(Message, **_op("OK")):
    """DRAIN began: ``serial`` leaves the layout, which is ``fingerprint`` once the move is done."""

    serial: str = ""
    fingerprint: str = ""


class ClusterNode(Struct, kw_only=True):
    """One node of a cluster card as the gateway sees it (``CardFigures.cluster_nodes``)."""

    node: str               # host:port
    role: str               # primary, replica or unknown
    slots: int
    failed: bool            # the cluster flags it failed
    answers: bool           # it answers the gateway now


class CardFigures(Struct, kw_only=True, omit_defaults=True):
    """One card in STATS: identity, health, I/O counts, usage, and the facts of its kind
    (``Card.details``: ``path`` of an fs card; ``cluster_*`` of a cluster card: absent from
    the wire for the other kinds)."""

    serial: str
    device: str
    kind: str               # fs, resp, resp_cluster
    active: bool
    strikes: int
    oldest_io_age_s: float
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    read_errors: int
    write_errors: int
    io_seconds: float
    io_count: int
    io_max_seconds: float
    evicted: int
    used_bytes: int
    capacity_bytes: int
    objects: int            # objects (fragments) on the card
    path: Optional[str] = None
    cluster_state: Optional[str] = None
    cluster_nodes: Optional[list[ClusterNode]] = None
    cluster_counters: Optional[dict[str, int]] = None


class EngineFigures(Struct, kw_only=True):
    """The attached engine: its id, world size, the ranks attached now, its namespace."""

    id: str
    world: int
    ranks: list[int]
    namespace: str


class TenantFigures(Struct, kw_only=True):
    """One namespace summed over the cards (``quota_bytes`` is per card; 0: no quota)."""

    id: str                 # the namespace id, hex
    namespace: str          # its name where the gateway knows it, else ""
    used_bytes: int
    objects: int
    quota_bytes: int
    evicted: int            # evicted because the namespace was over its quota
    capacity_evicted: int   # evicted by the cards' own LRU


class WorkFigures(Struct, kw_only=True):
    """One piece of long work the gateway is doing (``gateway/observe/progress.py``)."""

    what: str
    done: int
    total: int
    unit: str
    elapsed_s: float


class LayoutChangeFigures(Struct, kw_only=True):
    """The key layout change since this gateway started (``gateway/layout/mover.py``)."""

    previous_fingerprint: str
    complete: bool
    moved_objects: int
    moved_bytes: int
    left_objects: int
    copied_objects: int = 0         # objects without a recorded slot tag, copied to each card that may own them
    unplaceable_objects: int = 0    # such objects the last sweep pass left in place (cluster cards)
    failed: int
    rate_bytes_per_s: float
    rate_limit_bytes_per_s: float


class GatewayStats(Struct, kw_only=True):
    """What STATS answers and the status file shows (``gateway/loop/stats.py`` builds it).
    ``counters``: requests by kind; ``objects``: hits, misses, stored... summed over the
    namespaces, ``objects_by_namespace``: the same by namespace id (hex);
    ``request_latency``: per op (get, put), the latency bucket counts and the seconds summed."""

    port: int
    uptime_s: float
    fingerprint: str
    placement: str
    storage_slots: int
    num_dbs: int
    shared_storage: bool
    replicas: int
    ring_size: int
    ring_in_use: int
    requests_in_flight: int
    pinned: int
    regions: int
    sessions: int
    engine: Optional[EngineFigures]
    counters: dict[str, int]
    objects: dict[str, int]
    objects_by_namespace: dict[str, dict[str, int]]
    cards: list[CardFigures]
    namespace_names: dict[str, str]
    version: str
    work: list[WorkFigures]
    layout_change: Optional[LayoutChangeFigures]
    request_latency: dict[str, tuple[list[int], float]]
    tenants: list[TenantFigures] = []


class StatsOk(Message, **_op("OK")):
    stats: GatewayStats


def gateway_stats(raw: Any) -> GatewayStats:
    """The ``stats`` of a STATS reply read as a plain map (``gateway/ops/control.py``) as a
    ``GatewayStats``; ``ProtocolError`` (BAD_MESSAGE) when it is not one."""
    try:
        return msgspec.convert(raw, GatewayStats)
    except msgspec.ValidationError as exc:
        raise ProtocolError(BAD_MESSAGE, f"a STATS reply that is not one: {exc}") from None


class Batch(Message, **_op("BATCH")):
    """Objects ``first .. first+count-1`` of a request at ring ``offset`` (``stride`` apart).
    A GET batch carries ``hits``; the rank answers RELEASE (GET) or FILLED (PUT)."""

    batch: int = 0
    first: int = 0
    count: int = 0
    offset: int = 0
    stride: int = 0
    obj: int = 0
    hits: Optional[Flags] = None


class Done(Message, **_op("DONE")):
    """A data request is complete: ``hits`` (GET) or ``stored`` and ``existed`` (PUT)."""

    hits: Optional[Flags] = None
    stored: Optional[Flags] = None
    existed: Optional[Flags] = None


class Error(Message, **_op("ERROR")):
    code: str = INTERNAL
    msg: str = ""


# ---------------------------------------------------------------- door messages
class SessionRequest(Message, **_op("SESSION")):
    """Open a session (door): its token. No ring: that is RING's, after HELLO."""


class RingRequest(Message, **_op("RING")):
    """The ring of the session's engine (door), once a connection of the session is attached
    to it as a rank (HELLO) and the session's user owns it; the reply carries its descriptor.
    FORBIDDEN otherwise."""


class RegionRequest(Message, **_op("REGION")):
    """Hand over one open descriptor of a shared-memory buffer (door)."""

    offset: Annotated[int, Meta(ge=0, lt=1 << 62)] = 0
    size: Annotated[int, Meta(gt=0, lt=1 << 62)] = 1


class SessionOk(Message, **_op("OK")):
    token: bytes = b""
    proof: bytes = b""      # what this gateway answers HELLO with (the client checks it)


class RingOk(Message, **_op("OK")):
    size: int = 0


class RegionOk(Message, **_op("OK")):
    region: int = 0


MAX_MAP_KEYS = 128       # keys of one MAP: its reply's descriptors fit one packet (SCM_MAX_FD is 253)


class MapRequest(Message, **_op("MAP")):
    """Open read-only descriptors of objects' files (door; ``adpkv_core.direct_map``): for each
    key whose object the gateway can hand whole (one fragment, one file of an fs card) and has
    checked in place (header and checksum, read from the page cache), the file's descriptor.
    Served only to an attached rank of an engine its session's user owns, for keys of
    namespaces that user owns (FORBIDDEN whole otherwise, as GET)."""

    keys: Annotated[list[Key], Meta(min_length=1, max_length=MAX_MAP_KEYS)]
    obj: ObjectBytes
    marks: Marks = None

    def __post_init__(self):
        _same_length("marks", self.marks, len(self.keys))


class MapOk(Message, **_op("OK")):
    """``hits``: one 0/1 byte per key; one descriptor per hit, in key order, each opened
    ``O_RDONLY``, its object's payload (``obj`` bytes) at ``offset`` of the file."""

    hits: Flags = b""
    offset: int = 0


DoorRequest = Union[SessionRequest, RingRequest, RegionRequest, MapRequest]
DOOR_OPS = frozenset(t.__struct_config__.tag for t in (SessionRequest, RingRequest, RegionRequest, MapRequest))

# ---------------------------------------------------------------- encoding and decoding
_encoder = msgspec.msgpack.Encoder()
# What decoding a hostile frame can raise: bad msgpack, a wrong type, nesting deep enough to
# exhaust the decoder's recursion (found by the control fuzzer: it was an INTERNAL answer).
_BAD_FRAME = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)
_raw = msgspec.msgpack.Decoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_door_decoder = msgspec.msgpack.Decoder(DoorRequest)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def _classify(frame: bytes, ops, exc: Exception) -> ProtocolError:
    """Why a frame did not decode, as the error code a sender can act on."""
    try:
        raw = _raw.decode(frame)
    except _BAD_FRAME:
        return ProtocolError(BAD_MESSAGE, "not a msgpack message")
    if not isinstance(raw, dict):
        return ProtocolError(BAD_MESSAGE, "a message must be a map")
    if raw.get("v") != PROTOCOL_VERSION:
        return ProtocolError(BAD_VERSION, f"protocol version {str(raw.get('v'))[:20]}, "
                             f"this side speaks {PROTOCOL_VERSION}")
    op = raw.get("op")
    if not isinstance(op, str):
        return ProtocolError(BAD_MESSAGE, "missing op")
    if op not in ops:
        return ProtocolError(UNKNOWN_OP, f"unknown op {op[:40]!r}")
    return ProtocolError(BAD_MESSAGE, f"{op}: {str(exc)[:200]}")


def request_id(frame: bytes) -> Any:
    """The ``id`` of a frame that failed to decode, to echo in the ERROR reply (None if none)."""
    try:
        raw = _raw.decode(frame)
    except _BAD_FRAME:
        return None
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, (int, str)) and not isinstance(rid, bool) else None


def decode_request(frame: bytes) -> Request:
    """One request, checked; ``ProtocolError`` with the code that says what is wrong."""
    try:
        msg = _request_decoder.decode(frame)
    except _BAD_FRAME as exc:
        raise _classify(frame, REQUEST_OPS, exc) from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(BAD_VERSION, f"protocol version {msg.v}, this side speaks {PROTOCOL_VERSION}")
    return msg


def decode_door_request(frame: bytes) -> DoorRequest:
    try:
        msg = _door_decoder.decode(frame)
    except _BAD_FRAME as exc:
        raise _classify(frame, DOOR_OPS, exc) from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(BAD_VERSION, f"protocol version {msg.v}, this side speaks {PROTOCOL_VERSION}")
    return msg


class ReplyDecoder:
    """Decodes the replies to one kind of request: ``expected`` or an ``Error``."""

    def __init__(self, *expected: type):
        self._decoder = msgspec.msgpack.Decoder(Union[(*expected, Error)] if expected else Error)

    def decode(self, frame: bytes) -> Message:
        try:
            return self._decoder.decode(frame)
        except _BAD_FRAME as exc:
            raise ProtocolError(BAD_MESSAGE, f"a reply that is not what was asked for: {str(exc)[:200]}") from None


class _Envelope(Struct, forbid_unknown_fields=False):
    op: str = ""
    id: Any = None


_envelope = msgspec.msgpack.Decoder(_Envelope)


def envelope(frame: bytes) -> tuple[str, Any]:
    """``(op, id)`` of a reply, to find the request it answers before decoding it whole."""
    try:
        env = _envelope.decode(frame)
    except _BAD_FRAME as exc:
        raise ProtocolError(BAD_MESSAGE, f"not a reply: {str(exc)[:200]}") from None
    return env.op, env.id


def error(req_id: Any, code: str, message: str) -> Error:
    return Error(id=req_id, code=code, msg=message)


def pack_flags(flags) -> bytes:
    """One 0/1 byte per entry."""
    return bytes(1 if f else 0 for f in flags)


def unpack_flags(data: bytes) -> list[bool]:
    return [b != 0 for b in data]
