"""The control protocol between engine ranks and the gateway (ZeroMQ, msgpack).

Every message is one msgpack map with ``v`` (protocol version), ``op`` and,
for requests, ``id`` (chosen by the client, echoed in every reply). Data never
travels here: it moves through the ring, and messages only name ring offsets.

Requests (client → gateway)::

    HELLO  session, engine, rank, world, namespace, layout  -> OK ring_size max_batch_bytes
           (role="lookup" and no rank: a lookup-only peer of the engine, e.g. vLLM's scheduler)
    BYE                                                -> OK
    PING                                               -> OK
    EXIST  keys, marks?, lock?                         -> OK hits
    UNLOCK keys                                        -> OK
    GET    keys, marks?, obj, tag?, unlock?            -> BATCH* (hits), then DONE hits
    PUT    keys, marks?, obj, tag?                     -> BATCH*, then DONE stored existed
    GET/PUT ... region, at  (no tag)                   -> DONE only: the gateway moves each object
           between the card and ``at[i]`` of a region the session handed over at the door
           (``adpkv_core.door``), the engine copies nothing
    RELEASE id, batch    (after copying a GET batch out of the ring)
    FILLED  id, batch, ok (after copying a PUT batch into the ring)
    DELETE keys                                        -> OK deleted
    CLEAN  session                                     -> OK deleted | ERROR CLEAN_REFUSED / FORBIDDEN
    STATS  session                                     -> OK stats

``session`` is the token a process got at the gateway's door (``adpkv_core.door``):
nothing but PING is served without one. HELLO binds the connection to it; an
engine belongs to the uid of the session that attached it first.


``hits``/``stored`` are bytes with one 0/1 byte per key. A ``BATCH`` names
objects ``first .. first+count-1`` of the request at ring ``offset`` with
``stride`` bytes between them.
"""

from __future__ import annotations

from typing import Any

import msgpack

PROTOCOL_VERSION = 1

REQUEST_OPS = frozenset({"HELLO", "BYE", "PING", "EXIST", "UNLOCK", "GET", "PUT",
                         "RELEASE", "FILLED", "DELETE", "CLEAN", "STATS"})

# Error codes of an ERROR reply.
BAD_MESSAGE = "BAD_MESSAGE"          # not a msgpack map, or a field of the wrong type
BAD_VERSION = "BAD_VERSION"          # another protocol version
UNKNOWN_OP = "UNKNOWN_OP"
NOT_ATTACHED = "NOT_ATTACHED"        # a request before HELLO
ENGINE_BUSY = "ENGINE_BUSY"          # another engine is attached to this gateway
RANK_TAKEN = "RANK_TAKEN"            # this rank of the engine is attached already
TOO_LARGE = "TOO_LARGE"              # one object does not fit the ring
UNKNOWN_BATCH = "UNKNOWN_BATCH"      # RELEASE/FILLED of a batch the gateway never handed out
COLLECTIVE_MISMATCH = "COLLECTIVE_MISMATCH"  # ranks sent different parts for one tag
CLEAN_REFUSED = "CLEAN_REFUSED"      # shared_storage: nothing was deleted
BAD_REGION = "BAD_REGION"            # a region that cannot be used, or a range outside it
FORBIDDEN = "FORBIDDEN"              # no session, another user's engine, or not an operator
CARD_ERROR = "CARD_ERROR"            # the cards did not answer a metadata request
INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A message that breaks the protocol; ``code`` is sent back in the ERROR reply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def encode(msg: dict) -> bytes:
    """Serialise one message (adds the protocol version)."""
    msg.setdefault("v", PROTOCOL_VERSION)
    return msgpack.packb(msg, use_bin_type=True)


def decode(frame: bytes) -> dict:
    """Parse and check one message; raises ProtocolError with a clear code."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(BAD_MESSAGE, f"not a msgpack message ({type(exc).__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_MESSAGE, "a message must be a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(BAD_VERSION, f"protocol version {msg.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError(BAD_MESSAGE, "missing op")
    return msg


def field(msg: dict, name: str, kind: type | tuple, default: Any = ...) -> Any:
    """A typed field of a message; raises BAD_MESSAGE when missing or mistyped."""
    if name not in msg or msg[name] is None:
        if default is ...:
            raise ProtocolError(BAD_MESSAGE, f"{msg.get('op')}: missing field {name!r}")
        return default
    value = msg[name]
    if isinstance(value, bool) and kind in (int, (int,)):
        raise ProtocolError(BAD_MESSAGE, f"{msg.get('op')}: field {name!r} must be int")
    if not isinstance(value, kind):
        raise ProtocolError(BAD_MESSAGE, f"{msg.get('op')}: field {name!r} has the wrong type")
    return value


def error(req_id: Any, code: str, message: str) -> dict:
    return {"op": "ERROR", "id": req_id, "code": code, "msg": message}


def pack_flags(flags) -> bytes:
    """One 0/1 byte per entry."""
    return bytes(1 if f else 0 for f in flags)


def unpack_flags(data: bytes) -> list[bool]:
    return [b != 0 for b in data]
