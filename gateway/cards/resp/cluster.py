"""The cluster card: a whole Redis Cluster protocol deployment (Redis 7, Valkey, Kvrocks
cluster) as one card, ``redis+cluster://host:port[,host:port...]`` (seed nodes).

The cluster owns its 16384 slots, moves them live and promotes a replica when a
primary dies; the card stands on that:

- It learns the slot map (``CLUSTER SLOTS``) from any node that answers and sends
  each command to the primary of the key's slot. ``MOVED`` updates that slot and
  refreshes the map; ``ASK`` is followed by one ``ASKING`` and the command again
  on the node named (a slot being migrated).
- Keys are ``adpkv:{<tag>}:<db>:<fragment key>``: the hash tag is 16 hex digits
  of an xxh3 of the slot tag the store gives (``cards.base``: with
  ``key_placement: dialog`` the dialog mark) or, without one (``stripe``), of
  the object key. So every fragment of one object, and with dialog placement
  every object of one dialog, is in one slot: it lives on one node, is read
  from one node and is replicated in order by one replication stream; different
  dialogs (objects, with stripe) spread over all slots.
- Batched reads (``read_many``) send each node its GETs as one pipeline, every
  node's before any reply is read, and check each value as ``read`` does; a
  GET redirected (``MOVED``/``ASK``) or refused by a busy node is read again
  alone through ``read``.
- Health is per node, not per card: a node that does not answer (refused,
  reset, timed out, ``CLUSTERDOWN``, ``LOADING``) makes the commands for its
  slots fail with ``NodeIOError`` — a miss that removes nothing and no strike
  against the card — and the map is refreshed (at most every 0.2 s, and every
  second by the health check) until the cluster has failed over; every other
  slot keeps working. The card leaves service only when no node answers or the
  cluster holds another card's serial.
- The mover's sweep over a card-set change lists the objects node by node
  (``listed_heads``: a SCAN of each primary and its heads' headers, which record
  the slot tag; the key's hash tag tells an object stored without one).
- Values are those of the resp card (96-byte object header + payload), so a
  fragment lost, half-written or replicated partly before a failover is a miss
  (the header's key and checksums are checked on every read, wherever a
  redirection sent it), never wrong data.
- ``wait_ms`` (``resp_wait_ms``): after an object's head (its last fragment,
  written on the same connection as the others) ``WAIT 1 <ms>``; an object no
  replica acknowledged in time is reported not stored.

The client is adpkv's own ``RespConnection`` (reads ``recv_into`` the ring slot,
writes one ``sendmsg`` from it), one connection per I/O thread per node; see
docs/gateway.md for why not redis-py's ``RedisCluster``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import xxhash

from adpkv_gateway.cards import objfmt
from adpkv_gateway.cards.base import (
    BatchedReads, Card, CardIOError, CardUnavailable, CardUsage, Head, KeyedLayoutRecord, KeysByTag, Listed,
    NodeIOError, Read, ReadItem, claim_record, parse_claim
)
from adpkv_gateway.cards.fragments import is_head, object_key
from adpkv_gateway.cards.resp.cluster_map import (
    TRANSPORT_ERRORS, Addr, SlotMap, is_retryable, key_slot, parse_cluster_url
)
from adpkv_gateway.cards.resp.cluster_route import ClusterRouting
from adpkv_gateway.cards.resp.card import (
    _DEL, _GETRANGE_HEADER, _STRLEN, LAYOUT_KEY, OWNERS_KEY, RESERVED_KEYS, SERIAL_KEY, _heads_holding
)
from adpkv_gateway.cards.resp.conn import RespConnection, RespError, ThreadConnections

logger = logging.getLogger("adpkv.gateway.resp_cluster")

SCHEMES = ("redis+cluster://", "rediss+cluster://")
KEY_PREFIX = b"adpkv:{"
READ_WINDOW_BYTES = 1 << 20   # values in flight per node in a batched read (2 GETs at least)
_TRANSPORT = TRANSPORT_ERRORS
_EXISTS = ((b"EXISTS",),)


@dataclass
class _NodeReads:
    """One node's part of a ``read_many``: its connection, its items (indexes into the
    batch), how many of their GETs were sent and how many replies were read."""
    addr: Addr
    conn: RespConnection
    idx: list[int]
    sent: int = 0
    read: int = 0


class ClusterCard(ClusterRouting, Card, BatchedReads, KeysByTag, KeyedLayoutRecord):
    """A card that is a whole Redis Cluster."""

    kind = "resp-cluster"

    def __init__(self, device: str, io_timeout_s: Optional[float] = None, wait_ms: int = 0):
        super().__init__(device)
        self.seeds, self.password = parse_cluster_url(device)
        self.timeout_s = io_timeout_s or 5.0
        self.wait_ms = int(wait_ms)
        self._local = threading.local()          # per-thread header buffer
        self._conns = ThreadConnections()
        self.map = SlotMap(device, self.seeds, self._connect, probe_timeout_s=min(self.timeout_s, 1.0))
        self.counters = {"moved": 0, "ask": 0, "node_errors": 0, "wait_short": 0}
        self._status: dict = {"cluster_state": "unknown", "cluster_nodes": []}

    # ------------------------------------------------------------------ keys
    @staticmethod
    def _key(db: int, fkey: bytes, tag: Optional[bytes] = b"") -> bytes:
        """The cluster key of a fragment: its hash tag from the store's slot tag (a dialog
        mark: a dialog in one slot) or, with none, from its object's key (an object in one
        slot). Every command about a fragment must be given the tag it was written with."""
        tag = b"%016x" % xxhash.xxh3_64_intdigest(tag or object_key(fkey))
        return KEY_PREFIX + tag + b"}:%03d:" % db + fkey

    # ------------------------------------------------------------------ setup & health
    def open(self) -> None:
        if not self.map.refresh(force=True):
            raise CardUnavailable(f"cluster card {self.device}: no seed node answers CLUSTER SLOTS")
        try:
            serial = self._run(SERIAL_KEY, lambda c: c.command(b"GET", SERIAL_KEY))
            if serial is None:
                new = ("RC" + uuid.uuid4().hex[:14].upper()).encode()
                self._run(SERIAL_KEY, lambda c: c.command(b"SET", SERIAL_KEY, new, b"NX"))
                serial = self._run(SERIAL_KEY, lambda c: c.command(b"GET", SERIAL_KEY))
        except (CardIOError, RespError) as exc:
            raise CardUnavailable(f"cluster card {self.device} does not answer: {exc}") from None
        if serial is None:
            raise CardUnavailable(f"cluster card {self.device}: the serial could not be stored")
        self.serial = serial.decode()
        self._update_status()
        logger.info("cluster card %s: serial %s, %d primaries", self.device, self.serial, len(self.map.primaries()))

    def probe_serial(self) -> Optional[str]:
        """The serial the cluster holds now: None if it cannot be read (the node of its slot
        and its replicas do not answer), "" if it holds none."""
        try:
            serial = self._run(SERIAL_KEY, lambda c: c.command(b"GET", SERIAL_KEY))
            return serial.decode() if serial else ""
        except (CardIOError, RespError, OSError):
            pass
        try:
            replicas = self.map.replicas_of(self.map.primary(key_slot(SERIAL_KEY)))
        except NodeIOError:
            return None
        for rep in replicas:
            try:
                conn = self._connect(rep, 1.0)
                try:
                    conn.command(b"READONLY")
                    serial = conn.command(b"GET", SERIAL_KEY)
                finally:
                    conn.close()
                return serial.decode() if serial else ""
            except (_TRANSPORT + (RespError,)):
                continue
        return None

    def check(self) -> bool:
        """In service while the cluster answers and does not hold another serial: a node down
        costs its slots only (its commands are misses), not the card."""
        if not self.serial:
            return False
        self.map.refresh(force=True)
        self._update_status()
        serial = self.probe_serial()
        if serial is None:
            return any(n.get("answers") for n in self._status["cluster_nodes"])
        return serial == self.serial

    def _update_status(self) -> None:
        self._status = self.map.topology()

    def details(self) -> dict:
        return {**self._status, "cluster_counters": {**self.counters, "map_refreshes": self.map.refreshes}}

    # ------------------------------------------------------------------ data
    def _header_buf(self) -> memoryview:
        h = getattr(self._local, "header", None)
        if h is None:
            h = self._local.header = memoryview(bytearray(objfmt.HEADER_CORE))
        return h

    def read(self, db: int, fkey: bytes, buf: memoryview, tag: bytes = b"",
             write_id: Optional[int] = None) -> Read:
        """The GET's verdict; a node that does not answer raises ``NodeIOError``; an error reply
        (``_run`` follows redirections) is ``TRANSIENT``: says nothing about the object."""
        header = self._header_buf()
        key = self._key(db, fkey, tag)
        try:
            n = self._run(key, lambda c: c.get_into(key, header, buf))
        except RespError as exc:
            logger.warning("cluster card %s: GET %s: %s; a miss, nothing removed", self.device, fkey.hex(), exc)
            return Read.TRANSIENT
        return self._checked(n, header, fkey, buf, write_id)

    def _checked(self, n: Optional[int], header: memoryview, fkey: bytes, buf: memoryview,
                 write_id: Optional[int]) -> Read:
        """The verdict on a GET's value (``n`` bytes, or None) read into ``header`` and ``buf``
        as the fragment ``fkey`` of the write ``write_id`` (``objfmt.value_verdict``)."""
        verdict = objfmt.value_verdict(n, header, fkey, buf, write_id)
        if verdict.drops and verdict is not Read.ABSENT:
            logger.warning("cluster card %s: %s is %s; a miss", self.device, fkey.hex(), verdict.value)
        return verdict

    def read_many(self, items: list[ReadItem]) -> list[Union[Read, CardIOError]]:
        """``read`` of many fragments, pipelined per node and in parallel across nodes: each
        node gets its GETs on one connection, up to ``READ_WINDOW_BYTES`` of values (two
        at least) in flight, every node's first GETs sent before any reply is read; the
        replies are then read a value from each node in turn, each straight into its buffer
        and checked as ``read`` does, and each node sent its next GET as one is read. A GET
        answered by a redirection or a busy node is read again alone through ``read``
        (which follows it); a node that does not answer fails its fragments with
        ``NodeIOError``."""
        out: list = [Read.TRANSIENT] * len(items)
        by_node: dict[Addr, list[int]] = {}
        keys: list[bytes] = []
        for i, (db, fkey, _, tag, _) in enumerate(items):
            keys.append(self._key(db, fkey, tag))
            try:
                by_node.setdefault(self.map.primary(key_slot(keys[i])), []).append(i)
            except NodeIOError as exc:
                out[i] = exc
        header = self._header_buf()
        again: list[int] = []
        nodes: list[_NodeReads] = []

        def send(node: _NodeReads) -> None:
            idx = node.idx
            inflight = sum(len(items[i][2]) for i in idx[node.read:node.sent])
            end = node.sent
            while end < len(idx) and (end - node.read < 2 or inflight + len(items[idx[end]][2]) <= READ_WINDOW_BYTES):
                inflight += len(items[idx[end]][2])
                end += 1
            if end > node.sent:
                node.conn.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(keys[i]), keys[i])
                                                for i in idx[node.sent:end]))
                node.sent = end

        def failed(addr: Addr, rest: list[int], exc: BaseException) -> None:
            err = self._node_failed(addr, exc) if isinstance(exc, _TRANSPORT) else exc
            for i in rest:
                out[i] = err

        for addr, idx in by_node.items():
            try:
                node = _NodeReads(addr, self._conn(addr), idx)
                send(node)
            except (_TRANSPORT + (NodeIOError,)) as exc:
                failed(addr, idx, exc)
                continue
            nodes.append(node)
        try:
            while nodes:
                for node in list(nodes):
                    i = node.idx[node.read]
                    _, fkey, buf, _, write_id = items[i]
                    try:
                        try:
                            out[i] = self._checked(node.conn.read_value_into(header, buf), header, fkey, buf, write_id)
                        except RespError as exc:
                            if is_retryable(exc):
                                again.append(i)
                            else:
                                logger.warning("cluster card %s: GET %s: %s; a miss, nothing removed",
                                               self.device, fkey.hex(), exc)
                        node.read += 1
                        send(node)
                    except _TRANSPORT as exc:
                        failed(node.addr, node.idx[node.read:], exc)
                        node.read = len(node.idx)
                    if node.read == len(node.idx):
                        nodes.remove(node)
                        if not isinstance(out[node.idx[-1]], NodeIOError):
                            self.map.node_ok(node.addr)
        except BaseException:
            for node in nodes:          # replies left unread: these connections are out of step
                self._drop(node.addr)
            raise
        for i in again:
            db, fkey, buf, tag, write_id = items[i]
            try:
                out[i] = self.read(db, fkey, buf, tag, write_id)
            except CardIOError as exc:
                out[i] = exc
        return out

    def write(self, db: int, fkey: bytes, buf: memoryview, object_bytes: int = 0, tag: Optional[bytes] = b"",
              write_id: int = 0) -> bool:
        header = self._header_buf()
        head = is_head(fkey)
        objfmt.fill_header(header, fkey, buf, object_bytes if head else 0, write_id, tag)
        key = self._key(db, fkey, tag)
        wait = self.wait_ms > 0 and head

        def run(c: RespConnection):
            c.set_value(key, [header, buf])
            if wait:        # same connection as the object's other fragments: WAIT covers them all
                return c.command(b"WAIT", b"1", str(self.wait_ms).encode())
            return 1
        try:
            acked = self._run(key, run)
        except RespError as exc:
            logger.warning("cluster card %s refused a write: %s", self.device, exc)
            return False
        if wait and not (isinstance(acked, int) and acked >= 1):
            self.counters["wait_short"] += 1
            return False
        return True

    def contains_many(self, items, lengths=None, tags=None):
        if not items:
            return []
        replies = self._keyed_pipeline(self._keys(items, tags), _STRLEN)
        self._raise_if_all_failed(replies)
        return [objfmt.value_holds(r, n) for r, n in zip(replies, lengths or [None] * len(items))]

    def heads(self, heads, tags=None) -> list[Optional[Head]]:
        if not heads:
            return []
        replies = self._keyed_pipeline(self._keys(heads, tags), _GETRANGE_HEADER)
        self._raise_if_all_failed(replies)
        return [objfmt.recorded_head(r, fkey) for (_, fkey), r in zip(heads, replies)]

    def listed_heads(self) -> Iterator[Listed]:
        """A SCAN of every primary (its own keys), each SCAN page's heads' headers read by one
        pipelined GETRANGE on that node. A head's key names the hash of its slot tag: one whose
        header records no tag is listed with ``b""`` when that hash is of the object key (its
        tag was none), else with None (a dialog mark not recorded). A key the header's tag does
        not make, a head gone or moved to another node since, is left out (the next pass, or
        read, finds it). A node that does not answer raises ``NodeIOError``."""
        start = len(KEY_PREFIX) + 16
        for addr in self.map.primaries():
            cursor = b"0"
            while True:
                try:
                    conn = self._conn(addr)
                    cursor, names = conn.command(b"SCAN", cursor, b"MATCH", KEY_PREFIX + b"*", b"COUNT", b"1000")
                    heads = [n for n in names if is_head(n) and n[start:start + 2] == b"}:"
                             and n[start + 2:start + 5].isdigit() and n[start + 5:start + 6] == b":"]
                    replies = conn.pipeline([(b"GETRANGE", n, *objfmt.HEADER_RANGE) for n in heads]) if heads else []
                except _TRANSPORT as exc:
                    raise self._node_failed(addr, exc) from None
                except RespError as exc:           # a busy or loading node: no listing now
                    raise NodeIOError(f"cluster card {self.device}: SCAN: {exc}") from None
                for name, reply in zip(heads, replies):
                    db, fkey = int(name[start + 2:start + 5]), name[start + 6:]
                    parsed = objfmt.read_header(reply, fkey) if isinstance(reply, bytes) else None
                    if parsed is None:
                        continue
                    tag = parsed.slot_tag
                    if tag is None and self._key(db, fkey, b"") == name:
                        tag = b""
                    if tag is None or self._key(db, fkey, tag) == name:
                        yield Listed(db, object_key(fkey), tag)
                if cursor in (b"0", 0):
                    break

    def heads_holding(self, heads, payload_len, tags=None) -> list[Optional[Head]]:
        """One round trip per node: a pipeline of GETRANGE (the header) and STRLEN of each of
        its heads; a node that does not answer: None for its heads (the others' stand)."""
        if not heads:
            return []
        replies = self._keyed_pipeline(self._keys(heads, tags), _GETRANGE_HEADER + _STRLEN)
        self._raise_if_all_failed(replies)
        return _heads_holding(heads, replies, payload_len)

    def _keys(self, items, tags) -> list[bytes]:
        return [self._key(db, k, t) for (db, k), t in zip(items, tags or [b""] * len(items))]

    @staticmethod
    def _raise_if_all_failed(replies: list) -> None:
        errors = [r for r in replies if isinstance(r, NodeIOError)]
        if errors and len(errors) == len(replies):
            raise errors[0]

    def delete(self, db: int, fkey: bytes, tag: bytes = b"") -> bool:
        key = self._key(db, fkey, tag)
        return bool(self._run(key, lambda c: c.command(b"DEL", key)))

    def delete_many(self, items, tags=None) -> int:
        if not items:
            return 0
        replies = self._keyed_pipeline(self._keys(items, tags), _DEL)
        return sum(r for r in replies if isinstance(r, int))

    def clean(self) -> int:
        removed = 0
        for addr in self.map.primaries():
            try:
                conn = self._connect(addr, self.timeout_s)
            except _TRANSPORT as exc:
                raise self._node_failed(addr, exc) from None
            try:
                cursor = b"0"
                while True:
                    cursor, keys = conn.command(b"SCAN", cursor, b"MATCH", KEY_PREFIX + b"*", b"COUNT", b"1000")
                    if keys:
                        for r in conn.pipeline([(b"DEL", k) for k in keys]):
                            removed += r if isinstance(r, int) else 0
                    if cursor in (b"0", 0):
                        break
            except _TRANSPORT as exc:
                raise self._node_failed(addr, exc) from None
            finally:
                conn.close()
        logger.info("cluster card %s: cleaned, %d fragments removed", self.device, removed)
        return removed

    def usage(self) -> CardUsage:
        """Memory and capacity of the primaries, and their keys less the card's own
        (``resp.RESERVED_KEYS``: serial, layout record, namespace claims; each on the node of
        its slot). A node that does not answer counts nothing."""
        used = cap = objects = 0
        for addr in self.map.primaries():
            try:
                conn = self._conn(addr)
                info = conn.command(b"INFO", b"memory").decode()
                size = int(conn.command(b"DBSIZE"))
            except (_TRANSPORT + (RespError, NodeIOError, ValueError)):
                self._drop(addr)
                continue
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            used += int(fields.get("used_memory", 0))
            cap += int(fields.get("maxmemory", 0))
            objects += size
        reserved = sum(r for r in self._keyed_pipeline(list(RESERVED_KEYS), _EXISTS) if isinstance(r, int))
        return CardUsage(used, cap, max(0, objects - reserved))

    # ------------------------------------------------------------------ namespace claims
    def namespace_owner(self, nsid: bytes) -> Optional[int]:
        """A field of the hash ``adpkv:card:owners``, on the primary of its slot (no object
        key can be that: theirs start ``adpkv:{``, which CLEAN matches and it does not)."""
        value = self._claim_io(lambda c: c.command(b"HGET", OWNERS_KEY, nsid.hex().encode()))
        return None if value is None else parse_claim(value, f"cluster card {self.device}: namespace {nsid.hex()}")

    def claim_namespace(self, nsid: bytes, uid: int) -> int:
        """``HSETNX`` (the first claim wins, atomically on the primary), then the field as it
        is. Replication is asynchronous: a claim the primary took just before it died may be
        lost with it (as any write), then the next request naming the namespace claims again;
        with ``wait_ms`` a new claim waits (``WAIT 1``) for a replica, as objects do."""
        field = nsid.hex().encode()

        def run(c: RespConnection):
            if c.command(b"HSETNX", OWNERS_KEY, field, claim_record(uid)) == 1 and self.wait_ms > 0:
                c.command(b"WAIT", b"1", str(self.wait_ms).encode())
            return c.command(b"HGET", OWNERS_KEY, field)
        value = self._claim_io(run)
        if value is None:
            raise CardIOError(f"cluster card {self.device}: the claim of namespace {nsid.hex()} vanished")
        return parse_claim(value, f"cluster card {self.device}: namespace {nsid.hex()}")

    def keep_claims(self) -> None:
        """Read the hash, so that an LRU/LFU ``maxmemory-policy`` counts it as in use."""
        self._claim_io(lambda c: c.command(b"HLEN", OWNERS_KEY))

    # ------------------------------------------------------------------ the layout record
    def get_layout_record(self) -> Optional[bytes]:
        return self._run(LAYOUT_KEY, lambda c: c.command(b"GET", LAYOUT_KEY))

    def set_layout_record(self, data: bytes) -> None:
        self._run(LAYOUT_KEY, lambda c: c.command(b"SET", LAYOUT_KEY, data))

    def _claim_io(self, fn):
        try:
            return self._run(OWNERS_KEY, fn)
        except RespError as exc:          # a refusal (OOM, a key of another type): no answer now
            raise CardIOError(f"cluster card {self.device}: {exc}") from None

    def close(self) -> None:
        self.reset_connections()
