"""The self-describing object header every card stores in front of a fragment.

96 bytes: magic, format, key length, payload length, xxh3-64 of the payload,
the fragment's full key, the object's slot tag (below), the write id (a random
64-bit number drawn for each write of an object, the same in all of its fragments), the size of the whole
object (recorded in an object's head fragment, fragment 0; 0 in the other
fragments) and an xxh3-64 of the header itself. A reader that checks it never
returns a truncated, corrupt or foreign object, nor a fragment of another write
of the object than the head it looked up (``cards.base``: whole objects); the
recorded object size lets a card tell whether all fragments of an object are there.

The slot tag (``cards.base``: with ``key_placement: dialog`` the dialog mark, 8 bytes; else
none) is what places the object (``gateway/store/placement.py``): the mover's sweep over a card-set
change reads it from each head to find the object's card in the new layout. One flag byte
says whether it is recorded (``0x80 | its length``) and up to 8 bytes hold it. Headers
written before it was recorded have a zero flag there (the bytes after the key were always
zero): ``Parsed.slot_tag`` is None, "not recorded" (``docs/gateway.md``, "Changing the card
set", says what the sweep does with such objects). Still format 2: a header with a tag reads
the same for a gateway that does not know it (the header checksum covers the bytes).

Format 2 added the write id. A header of format 1 (written before) is a bad header:
the fs card refuses a card written in format 1 (``fs.FORMAT``); a key-value card's
format-1 values read as misses and are replaced by the next PUT.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple, Optional

import xxhash

from adpkv_gateway.cards.checksum import xxh3_64
from adpkv_gateway.cards.base import Head, Read

MAGIC = b"ADPKVOBJ"
FORMAT = 2
HEADER_CORE = 96
_HEAD = struct.Struct(">8sHHQQ")           # 28 bytes
_SUM_AT = HEADER_CORE - 8
_OBJECT_AT = _SUM_AT - 8                   # u64: size of the whole object (head fragment only)
_WRITE_AT = _OBJECT_AT - 8                 # u64: the write id
MAX_TAG = 8
_TAG_AT = _WRITE_AT - MAX_TAG              # the slot tag, zero-padded
_TAG_FLAG_AT = _TAG_AT - 1                 # 0: no tag recorded; 0x80 | length: the tag is recorded
MAX_KEY = _TAG_FLAG_AT - _HEAD.size        # 35 bytes (fragment keys are 30)


class Parsed(NamedTuple):
    """A valid header's fields."""

    payload_len: int
    object_bytes: int      # the whole object's size (head fragment; 0 in the others)
    write_id: int
    slot_tag: Optional[bytes]   # the object's slot tag (b"": none); None: not recorded (an older header)


def new_write_id() -> int:
    """A fresh write id: random, never 0."""
    return int.from_bytes(os.urandom(8), "big") or 1


def fill_header(header, fkey: bytes, payload, object_bytes: int = 0, write_id: int = 0,
                tag: Optional[bytes] = None) -> None:
    """Write the header of ``payload`` stored under ``fkey`` into ``header[:HEADER_CORE]``;
    ``object_bytes`` is the size of the whole object when ``fkey`` is its head fragment,
    ``write_id`` the id of the write, ``tag`` the object's slot tag (None: not known, as
    a header of before; see the module)."""
    fill_header_of(header, fkey, len(payload), xxh3_64(payload), object_bytes, write_id, tag)


def fill_header_of(header, fkey: bytes, payload_len: int, payload_sum: int, object_bytes: int = 0,
                   write_id: int = 0, tag: Optional[bytes] = None) -> None:
    """``fill_header`` for a payload hashed on the way (``payload_sum``: its xxh3-64)."""
    if len(fkey) > MAX_KEY:
        raise ValueError("fragment key too long")
    if tag is not None and len(tag) > MAX_TAG:
        raise ValueError("slot tag too long")
    header[:HEADER_CORE] = bytes(HEADER_CORE)
    _HEAD.pack_into(header, 0, MAGIC, FORMAT, len(fkey), payload_len, payload_sum)
    header[_HEAD.size:_HEAD.size + len(fkey)] = fkey
    if tag is not None:
        header[_TAG_FLAG_AT] = 0x80 | len(tag)
        header[_TAG_AT:_TAG_AT + len(tag)] = tag
    struct.pack_into(">QQ", header, _WRITE_AT, write_id, object_bytes)
    struct.pack_into(">Q", header, _SUM_AT, xxhash.xxh3_64_intdigest(memoryview(header)[:_SUM_AT]))


def read_header(header, fkey: bytes) -> Optional[Parsed]:
    """The fields of a valid header of ``fkey``, or None when ``header`` is short, corrupt,
    of another format or another key's."""
    if len(header) < HEADER_CORE:
        return None
    magic, fmt, klen, plen, _ = _HEAD.unpack_from(header)
    if magic != MAGIC or fmt != FORMAT or klen != len(fkey):
        return None
    if struct.unpack_from(">Q", header, _SUM_AT)[0] != xxhash.xxh3_64_intdigest(memoryview(header)[:_SUM_AT]):
        return None
    if bytes(header[_HEAD.size:_HEAD.size + klen]) != fkey:
        return None
    flag = header[_TAG_FLAG_AT]
    tag = bytes(header[_TAG_AT:_TAG_AT + (flag & 0x7F)]) if flag & 0x80 and flag & 0x7F <= MAX_TAG else None
    write_id, object_bytes = struct.unpack_from(">QQ", header, _WRITE_AT)
    return Parsed(plen, object_bytes, write_id, tag)


def check_header(header, fkey: bytes, payload_len: int, write_id: Optional[int] = None) -> Read:
    """Whether ``header`` describes ``payload_len`` bytes stored under ``fkey`` (``HIT``),
    and with ``write_id`` by that write (else ``CHANGED``); ``BAD_HEADER`` otherwise."""
    parsed = read_header(header, fkey)
    if parsed is None or parsed.payload_len != payload_len:
        return Read.BAD_HEADER
    if write_id is not None and parsed.write_id != write_id:
        return Read.CHANGED
    return Read.HIT


# A key-value card (resp, cluster) stores a fragment as one value: the header core, then the
# payload. These read what its pipelined STRLEN / GETRANGE 0..HEADER_CORE-1 replies say.
HEADER_RANGE = (b"0", str(HEADER_CORE - 1).encode())


def value_holds(strlen_reply, payload_len: int | None) -> bool:
    """Whether a value's length (a STRLEN reply) is a fragment's: of ``payload_len`` payload
    bytes when given, of some payload otherwise."""
    if not isinstance(strlen_reply, int):
        return False
    return strlen_reply > HEADER_CORE if payload_len is None else strlen_reply == HEADER_CORE + payload_len


def recorded_head(header_reply, fkey: bytes) -> Head | None:
    """What a head fragment's header records (a GETRANGE of ``HEADER_RANGE``), or None when
    it is not ``fkey``'s header."""
    parsed = read_header(header_reply, fkey) if isinstance(header_reply, bytes) else None
    return None if parsed is None else Head(parsed.object_bytes, parsed.write_id)


def value_verdict(got: Optional[int], header, fkey: bytes, payload, write_id: Optional[int]) -> Read:
    """The verdict on a value a key-value card returned (``got`` bytes read into
    ``header[:HEADER_CORE]`` and ``payload``; None: no such key) as the fragment ``fkey`` of
    the write ``write_id`` (None: any): ``HIT`` when it is that fragment whole (its
    header's key, length and write id, and its checksum)."""
    if got is None:
        return Read.ABSENT
    if got != HEADER_CORE + len(payload):
        return Read.BAD_HEADER
    verdict = check_header(header, fkey, len(payload), write_id)
    if verdict is not Read.HIT:
        return verdict
    return Read.HIT if payload_ok(header, payload) else Read.BAD_CHECKSUM


def payload_ok(header, payload) -> bool:
    """Whether ``payload`` has the checksum recorded in ``header``."""
    return xxh3_64(payload) == payload_checksum(header)


def payload_checksum(header) -> int:
    """The xxh3-64 of the payload recorded in ``header``."""
    return _HEAD.unpack_from(header)[4]
