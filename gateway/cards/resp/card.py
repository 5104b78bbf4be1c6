"""The resp card: one Redis-protocol server (Redis, Valkey, Kvrocks) as a card.

Keys are ``adpkv:<db>:<fragment key>`` (``num_dbs`` map to key prefixes); each
value is the 96-byte object header followed by the payload. The card's serial
is stored in the server itself (``adpkv:card:serial``) at first use, so a card
keeps its identity when its address changes. Capacity and key eviction are the
server's own (``maxmemory`` with ``maxmemory-policy allkeys-lru``; Kvrocks keeps
the data on disk). Every I/O thread has its own connection to every card.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from typing import Iterator, Optional

from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.base import (
    Card, CardIOError, CardUnavailable, CardUsage, Head, KeyedLayoutRecord, Listed, Read, claim_record,
    parse_claim
)
from adpkv_gateway.cards.fragments import is_head, object_key
from adpkv_gateway.cards.resp.conn import RespConnection, RespError, ThreadConnections

logger = logging.getLogger("adpkv.gateway.resp")

SERIAL_KEY = b"adpkv:card:serial"
LAYOUT_KEY = b"adpkv:card:layout"          # the key layout recorded on the card (gateway/layout/record.py)
OWNERS_KEY = b"adpkv:card:owners"      # hash: namespace id (16 hex) -> owner's uid (claim_namespace)
RESERVED_KEYS = (SERIAL_KEY, LAYOUT_KEY, OWNERS_KEY)   # the card's own keys: not objects (usage leaves them out)
KEY_PREFIX = b"adpkv:"
_TRANSPORT = (OSError, ConnectionError, socket.timeout)
_STRLEN = ((b"STRLEN",),)                                   # commands of RespConnection.keyed_pipeline
_GETRANGE_HEADER = ((b"GETRANGE", *objfmt.HEADER_RANGE),)
_DEL = ((b"DEL",),)


def _heads_holding(heads, replies: list, payload_len) -> list[Optional[Head]]:
    """``Card.heads_holding``'s answer from the replies of GETRANGE (the header) and STRLEN of
    each head in turn (shared with the cluster card)."""
    out: list[Optional[Head]] = []
    for (_, fkey), header, strlen in zip(heads, replies[0::2], replies[1::2]):
        head = objfmt.recorded_head(header, fkey)
        out.append(head if head is not None and objfmt.value_holds(strlen, payload_len(head)) else None)
    return out


class RespCard(Card, KeyedLayoutRecord):
    """A card on a Redis-protocol server at ``redis://host:port[/db]``."""

    kind = "resp"

    def __init__(self, device: str, io_timeout_s: Optional[float] = None):
        super().__init__(device)
        self.timeout_s = io_timeout_s or 30.0
        self._local = threading.local()          # per-thread header buffer
        self._conns = ThreadConnections()

    # ------------------------------------------------------------------ connections
    def _conn(self) -> RespConnection:
        try:
            return self._conns.get(None, lambda: RespConnection(self.device, self.timeout_s))
        except _TRANSPORT as exc:
            raise CardIOError(f"resp card {self.device}: cannot connect: {exc}") from None

    def _io(self, fn):
        """Run ``fn(conn)``; a transport failure drops the connection and raises CardIOError."""
        try:
            return fn(self._conn())
        except _TRANSPORT as exc:
            self._conns.drop(None)
            raise CardIOError(f"resp card {self.device}: {exc}") from None

    @staticmethod
    def _key(db: int, fkey: bytes) -> bytes:
        return KEY_PREFIX + b"%03d:" % db + fkey

    # ------------------------------------------------------------------ setup & health
    def open(self) -> None:
        try:
            conn = RespConnection(self.device, min(self.timeout_s, 2.0))
            try:
                serial = conn.command(b"GET", SERIAL_KEY)
                if serial is None:
                    conn.command(b"SET", SERIAL_KEY, ("RS" + uuid.uuid4().hex[:14].upper()).encode(), b"NX")
                    serial = conn.command(b"GET", SERIAL_KEY)
            finally:
                conn.close()
        except (_TRANSPORT + (RespError,)) as exc:
            raise CardUnavailable(f"resp card {self.device} does not answer: {exc}") from None
        self.serial = serial.decode()

    def probe_serial(self) -> Optional[str]:
        """The serial the server holds now: None if it does not answer, "" if it has none."""
        try:
            conn = RespConnection(self.device, 1.0)
            try:
                serial = conn.command(b"GET", SERIAL_KEY)
            finally:
                conn.close()
        except (_TRANSPORT + (RespError,)):
            return None
        return serial.decode() if serial else ""

    def check(self) -> bool:
        return bool(self.serial) and self.probe_serial() == self.serial

    def reset_connections(self) -> None:
        """Forget every connection (after the card was out of service)."""
        self._conns.reset()

    # ------------------------------------------------------------------ data
    def read(self, db: int, fkey: bytes, buf: memoryview, tag: bytes = b"",
             write_id: Optional[int] = None) -> Read:
        """The GET's verdict; a transport failure raises ``CardIOError``, an error reply of the
        server (busy, loading, out of memory) is ``TRANSIENT``: neither says anything about
        the object."""
        header = self._header_buf()
        try:
            n = self._io(lambda c: c.get_into(self._key(db, fkey), header, buf))
        except RespError as exc:
            logger.warning("resp card %s: GET %s: %s; a miss, nothing removed", self.device, fkey.hex(), exc)
            return Read.TRANSIENT
        verdict = objfmt.value_verdict(n, header, fkey, buf, write_id)
        if verdict.drops and verdict is not Read.ABSENT:
            logger.warning("resp card %s: %s is %s; a miss", self.device, fkey.hex(), verdict.value)
        return verdict

    def write(self, db: int, fkey: bytes, buf: memoryview, object_bytes: int = 0, tag: Optional[bytes] = b"",
              write_id: int = 0) -> bool:
        header = self._header_buf()
        objfmt.fill_header(header, fkey, buf, object_bytes if is_head(fkey) else 0, write_id, tag)
        try:
            self._io(lambda c: c.set_value(self._key(db, fkey), [header, buf]))
        except RespError as exc:
            logger.warning("resp card %s refused a write: %s", self.device, exc)
            return False
        return True

    def _header_buf(self) -> memoryview:
        h = getattr(self._local, "header", None)
        if h is None:
            h = self._local.header = memoryview(bytearray(objfmt.HEADER_CORE))
        return h

    def contains_many(self, items, lengths=None, tags=None):
        if not items:
            return []
        replies = self._io(lambda c: c.keyed_pipeline(self._keys(items), _STRLEN))
        return [objfmt.value_holds(r, n) for r, n in zip(replies, lengths or [None] * len(items))]

    def heads(self, heads, tags=None) -> list[Optional[Head]]:
        """What the heads record: one pipelined GETRANGE of each head's header."""
        if not heads:
            return []
        replies = self._io(lambda c: c.keyed_pipeline(self._keys(heads), _GETRANGE_HEADER))
        return [objfmt.recorded_head(r, fkey) for (_, fkey), r in zip(heads, replies)]

    def listed_heads(self) -> Iterator[Listed]:
        """A SCAN of the object keys; the heads' headers read by one pipelined GETRANGE per
        SCAN page (a head gone or rewritten since is left out: the next read judges it)."""
        cursor = b"0"
        while True:
            cursor, names = self._io(lambda c, cur=cursor: c.command(b"SCAN", cur, b"MATCH", KEY_PREFIX + b"[0-9]*",
                                                                     b"COUNT", b"1000"))
            heads = [(int(name[6:9]), name[10:]) for name in names
                     if is_head(name) and name[9:10] == b":" and name[6:9].isdigit()]
            if heads:
                replies = self._io(lambda c: c.pipeline([(b"GETRANGE", self._key(db, k), *objfmt.HEADER_RANGE)
                                                         for db, k in heads]))
                for (db, fkey), reply in zip(heads, replies):
                    parsed = objfmt.read_header(reply, fkey) if isinstance(reply, bytes) else None
                    if parsed is not None:
                        yield Listed(db, object_key(fkey), parsed.slot_tag)
            if cursor in (b"0", 0):
                return

    def heads_holding(self, heads, payload_len, tags=None) -> list[Optional[Head]]:
        """One round trip: a pipeline of GETRANGE (the header) and STRLEN of each head."""
        if not heads:
            return []
        replies = self._io(lambda c: c.keyed_pipeline(self._keys(heads), _GETRANGE_HEADER + _STRLEN))
        return _heads_holding(heads, replies, payload_len)

    def _keys(self, items) -> list[bytes]:
        return [b"%s%03d:%s" % (KEY_PREFIX, db, fkey) for db, fkey in items]

    def delete(self, db: int, fkey: bytes, tag: bytes = b"") -> bool:
        return bool(self._io(lambda c: c.command(b"DEL", self._key(db, fkey))))

    def delete_many(self, items, tags=None) -> int:
        if not items:
            return 0
        replies = self._io(lambda c: c.keyed_pipeline(self._keys(items), _DEL))
        return sum(r for r in replies if isinstance(r, int))

    def clean(self) -> int:
        def run(c: RespConnection) -> int:
            cursor, removed = b"0", 0
            while True:
                cursor, keys = c.command(b"SCAN", cursor, b"MATCH", KEY_PREFIX + b"[0-9]*", b"COUNT", b"1000")
                if keys:
                    removed += c.command(b"DEL", *keys)
                if cursor in (b"0", 0):
                    return removed
        removed = self._io(run)
        logger.info("resp card %s: cleaned, %d objects removed", self.device, removed)
        return removed

    def usage(self) -> CardUsage:
        def run(c: RespConnection):
            info = c.command(b"INFO", b"memory").decode()
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            return (int(fields.get("used_memory", 0)), int(fields.get("maxmemory", 0)),
                    max(0, int(c.command(b"DBSIZE")) - int(c.command(b"EXISTS", *RESERVED_KEYS))))
        try:
            used, cap, objects = self._io(run)
        except (CardIOError, RespError, ValueError):
            return CardUsage(0, 0, 0)
        return CardUsage(used, cap, objects)

    # ------------------------------------------------------------------ namespace claims
    def namespace_owner(self, nsid: bytes) -> Optional[int]:
        """A field of the hash ``adpkv:card:owners`` (no object key can be that: theirs are
        ``adpkv:<3 digits>:...``; CLEAN does not match it)."""
        value = self._claim_io(lambda c: c.command(b"HGET", OWNERS_KEY, nsid.hex().encode()))
        return None if value is None else self._owner(value, nsid)

    def claim_namespace(self, nsid: bytes, uid: int) -> int:
        """``HSETNX`` (the first claim wins, atomically on the server), then the field as it is."""
        field = nsid.hex().encode()

        def run(c: RespConnection):
            c.command(b"HSETNX", OWNERS_KEY, field, claim_record(uid))
            return c.command(b"HGET", OWNERS_KEY, field)
        value = self._claim_io(run)
        if value is None:
            raise CardIOError(f"resp card {self.device}: the claim of namespace {nsid.hex()} vanished")
        return self._owner(value, nsid)

    def keep_claims(self) -> None:
        """Read the hash, so that an LRU/LFU ``maxmemory-policy`` counts it as in use."""
        self._claim_io(lambda c: c.command(b"HLEN", OWNERS_KEY))

    def _claim_io(self, fn):
        try:
            return self._io(fn)
        except RespError as exc:          # a refusal (OOM, a key of another type): no answer now
            raise CardIOError(f"resp card {self.device}: {exc}") from None

    # ------------------------------------------------------------------ the layout record
    def get_layout_record(self) -> Optional[bytes]:
        return self._io(lambda c: c.command(b"GET", LAYOUT_KEY))

    def set_layout_record(self, data: bytes) -> None:
        self._io(lambda c: c.command(b"SET", LAYOUT_KEY, data))

    def _owner(self, value: bytes, nsid: bytes) -> int:
        return parse_claim(value, f"resp card {self.device}: namespace {nsid.hex()}")

    def close(self) -> None:
        self.reset_connections()
