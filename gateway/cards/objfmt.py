"""The self-describing object header every card stores in front of a fragment.

96 bytes: magic, format, key length, payload length, xxh3-64 of the payload,
the fragment's full key, and an xxh3-64 of the header itself. A reader that
checks it never returns a truncated, corrupt or foreign object.
"""

from __future__ import annotations

import struct

import xxhash

from adpkv_core.checksum import xxh3_64

MAGIC = b"ADPKVOBJ"
FORMAT = 1
HEADER_CORE = 96
MAX_KEY = 64
_HEAD = struct.Struct(">8sHHQQ")           # 28 bytes
_SUM_AT = HEADER_CORE - 8


def fill_header(header, fkey: bytes, payload) -> None:
    """Write the header of ``payload`` stored under ``fkey`` into ``header[:HEADER_CORE]``."""
    if len(fkey) > MAX_KEY:
        raise ValueError("fragment key too long")
    header[:HEADER_CORE] = bytes(HEADER_CORE)
    _HEAD.pack_into(header, 0, MAGIC, FORMAT, len(fkey), len(payload), xxh3_64(payload))
    header[_HEAD.size:_HEAD.size + len(fkey)] = fkey
    struct.pack_into(">Q", header, _SUM_AT, xxhash.xxh3_64_intdigest(memoryview(header)[:_SUM_AT]))


def check_header(header, fkey: bytes, payload_len: int) -> bool:
    """Whether ``header`` describes ``payload_len`` bytes stored under ``fkey``."""
    if len(header) < HEADER_CORE:
        return False
    magic, fmt, klen, plen, _ = _HEAD.unpack_from(header)
    if magic != MAGIC or fmt != FORMAT or klen != len(fkey) or plen != payload_len:
        return False
    if struct.unpack_from(">Q", header, _SUM_AT)[0] != xxhash.xxh3_64_intdigest(memoryview(header)[:_SUM_AT]):
        return False
    return bytes(header[_HEAD.size:_HEAD.size + klen]) == fkey


def payload_ok(header, payload) -> bool:
    """Whether ``payload`` has the checksum recorded in ``header``."""
    return xxh3_64(payload) == payload_checksum(header)


def payload_checksum(header) -> int:
    """The xxh3-64 of the payload recorded in ``header``."""
    return _HEAD.unpack_from(header)[4]


def payload_length(header) -> int:
    return _HEAD.unpack_from(header)[3]
