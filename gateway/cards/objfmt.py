"""The self-describing object header every card stores in front of a fragment.

96 bytes: magic, format, key length, payload length, xxh3-64 of the payload,
the fragment's full key, the size of the whole object (recorded in an object's
head fragment, fragment 0; 0 in the other fragments and in heads written before
it was recorded) and an xxh3-64 of the header itself. A reader that checks it
never returns a truncated, corrupt or foreign object; the recorded object size
lets a card tell whether all fragments of an object are there.
"""

from __future__ import annotations

import struct

import xxhash

from typing import Optional

from ..checksum import xxh3_64

MAGIC = b"ADPKVOBJ"
FORMAT = 1
HEADER_CORE = 96
_HEAD = struct.Struct(">8sHHQQ")           # 28 bytes
_SUM_AT = HEADER_CORE - 8
_OBJECT_AT = _SUM_AT - 8                   # u64: size of the whole object (head fragment only)
MAX_KEY = _OBJECT_AT - _HEAD.size          # 52 bytes (fragment keys are 30)


def fill_header(header, fkey: bytes, payload, object_bytes: int = 0) -> None:
    """Write the header of ``payload`` stored under ``fkey`` into ``header[:HEADER_CORE]``;
    ``object_bytes`` is the size of the whole object when ``fkey`` is its head fragment."""
    fill_header_of(header, fkey, len(payload), xxh3_64(payload), object_bytes)


def fill_header_of(header, fkey: bytes, payload_len: int, payload_sum: int, object_bytes: int = 0) -> None:
    """``fill_header`` for a payload hashed on the way (``payload_sum``: its xxh3-64)."""
    if len(fkey) > MAX_KEY:
        raise ValueError("fragment key too long")
    header[:HEADER_CORE] = bytes(HEADER_CORE)
    _HEAD.pack_into(header, 0, MAGIC, FORMAT, len(fkey), payload_len, payload_sum)
    header[_HEAD.size:_HEAD.size + len(fkey)] = fkey
    struct.pack_into(">Q", header, _OBJECT_AT, object_bytes)
    struct.pack_into(">Q", header, _SUM_AT, xxhash.xxh3_64_intdigest(memoryview(header)[:_SUM_AT]))


def read_header(header, fkey: bytes) -> Optional[tuple[int, int]]:
    """``(payload length, object size)`` of a valid header of ``fkey`` (object size 0:
    not recorded), or None when ``header`` is short, corrupt or another key's."""
    if len(header) < HEADER_CORE:
        return None
    magic, fmt, klen, plen, _ = _HEAD.unpack_from(header)
    if magic != MAGIC or fmt != FORMAT or klen != len(fkey):
        return None
    if struct.unpack_from(">Q", header, _SUM_AT)[0] != xxhash.xxh3_64_intdigest(memoryview(header)[:_SUM_AT]):
        return None
    if bytes(header[_HEAD.size:_HEAD.size + klen]) != fkey:
        return None
    return plen, struct.unpack_from(">Q", header, _OBJECT_AT)[0]


def check_header(header, fkey: bytes, payload_len: int) -> bool:
    """Whether ``header`` describes ``payload_len`` bytes stored under ``fkey``."""
    parsed = read_header(header, fkey)
    return parsed is not None and parsed[0] == payload_len


# A key-value card (resp, cluster) stores a fragment as one value: the header core, then the
# payload. These read what its pipelined STRLEN / GETRANGE 0..HEADER_CORE-1 replies say.
HEADER_RANGE = (b"0", str(HEADER_CORE - 1).encode())


def value_holds(strlen_reply, payload_len: int | None) -> bool:
    """Whether a value's length (a STRLEN reply) is a fragment's: of ``payload_len`` payload
    bytes when given, of some payload otherwise."""
    if not isinstance(strlen_reply, int):
        return False
    return strlen_reply > HEADER_CORE if payload_len is None else strlen_reply == HEADER_CORE + payload_len


def recorded_size(header_reply, fkey: bytes) -> int | None:
    """The object size a head fragment's header records (a GETRANGE of ``HEADER_RANGE``), or
    None when it is not ``fkey``'s header."""
    parsed = read_header(header_reply, fkey) if isinstance(header_reply, bytes) else None
    return None if parsed is None else parsed[1]


def value_problem(got: int, header, fkey: bytes, payload) -> str | None:
    """What is wrong with a value a key-value card returned (``got`` bytes read into
    ``header[:HEADER_CORE]`` and ``payload``) as the fragment ``fkey``, or None when it is
    that fragment whole: its header's key and length, and its checksum."""
    if got != HEADER_CORE + len(payload) or not check_header(header, fkey, len(payload)):
        return "holds a foreign or resized object"
    if not payload_ok(header, payload):
        return "fails its checksum"
    return None


def payload_ok(header, payload) -> bool:
    """Whether ``payload`` has the checksum recorded in ``header``."""
    return xxh3_64(payload) == payload_checksum(header)


def payload_checksum(header) -> int:
    """The xxh3-64 of the payload recorded in ``header``."""
    return _HEAD.unpack_from(header)[4]
