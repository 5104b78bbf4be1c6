"""Where a key lives in a Redis Cluster, and which nodes answer us: the cluster card's
map (``cards.resp_cluster`` runs the commands; this module decides where they go).

- ``key_slot``: the slot of a key (CRC16/XMODEM of its hash tag, or of the whole key).
- ``parse_cluster_url``: seed nodes and password of a ``redis+cluster://`` card.
- ``redirect_of``: a ``MOVED``/``ASK`` error reply as a ``Redirect``.
- ``SlotMap``: the slot → primary map learnt with ``CLUSTER SLOTS`` from the first
  node that answers (refreshed at most every ``REFRESH_MIN_INTERVAL_S`` unless
  forced), each primary's replicas, and node health: a node that failed rests for
  ``NODE_RETRY_S`` (commands for its slots fail fast) and is logged once until it
  answers again.

Thread contract: any I/O thread may call every method. The map's lists are replaced
whole by ``refresh`` (one refresh at a time; a thread that finds one running does not
wait for it), so a reader sees one map or the next, never a half-built one; a
``MOVED`` updates its one slot in place.
"""

from __future__ import annotations

import binascii
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional
from urllib.parse import unquote

from adpkv_gateway.cards.base import CardError, NodeIOError
from adpkv_gateway.cards.resp.conn import RespConnection, RespError

logger = logging.getLogger("adpkv.gateway.resp_cluster")

SLOTS = 16384
REFRESH_MIN_INTERVAL_S = 0.2
NODE_RETRY_S = 0.5            # a node that failed is not tried again before this (fail fast)
TRANSPORT_ERRORS = (OSError, ConnectionError, socket.timeout)
NODE_ERRORS = ("CLUSTERDOWN", "LOADING", "TRYAGAIN", "MASTERDOWN")   # a busy or failing node, not a bad command

Addr = tuple[str, int]


def key_slot(key: bytes) -> int:
    """The cluster slot of a key (CRC16/XMODEM of its hash tag, or of the whole key)."""
    s = key.find(b"{")
    if s >= 0:
        e = key.find(b"}", s + 1)
        if e > s + 1:
            key = key[s + 1:e]
    return binascii.crc_hqx(key, 0) % SLOTS


def parse_cluster_url(url: str) -> tuple[list[Addr], Optional[str]]:
    """Seed nodes and password of ``redis+cluster://[:password@]host:port[,host:port...]``
    (without a password in the URL: ``ADPKV_RESP_PASSWORD`` or the file named by
    ``ADPKV_RESP_PASSWORD_FILE``)."""
    if url.startswith("rediss+cluster://"):
        raise CardError(f"{url}: TLS (rediss+cluster://) is not supported yet; use redis+cluster:// "
                        "on a trusted network or a TLS tunnel")
    if not url.startswith("redis+cluster://"):
        raise CardError(f"a cluster card is redis+cluster://host:port[,host:port...], not {url!r}")
    rest = url[len("redis+cluster://"):].split("/", 1)[0].split("?", 1)[0]
    password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        password = cred.split(":", 1)[1] if ":" in cred else cred
        password = unquote(password) or None
    seeds: list[Addr] = []
    for part in rest.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, port = part.rpartition(":")
        if not host:
            host, port = part, "6379"
        try:
            seeds.append((host.strip("[]"), int(port)))
        except ValueError:
            raise CardError(f"{url}: {part!r} is not host:port") from None
    if not seeds:
        raise CardError(f"{url}: names no seed node")
    if password is None:
        password = os.environ.get("ADPKV_RESP_PASSWORD") or None
        path = os.environ.get("ADPKV_RESP_PASSWORD_FILE")
        if password is None and path:
            with open(path, "r", encoding="utf-8") as fh:
                password = fh.read().strip() or None
    return seeds, password


def fmt_addr(addr: Addr) -> str:
    return f"{addr[0]}:{addr[1]}"


class Redirect(Exception):
    """A ``MOVED`` (the slot has moved for good) or ``ASK`` (once, during a migration) reply."""

    def __init__(self, kind: str, slot: int, addr: Addr):
        super().__init__(kind)
        self.kind, self.slot, self.addr = kind, slot, addr


def redirect_of(err: RespError) -> Optional[Redirect]:
    """A MOVED/ASK error reply as a redirection (None for any other error)."""
    text = str(err)
    if text.startswith(("MOVED ", "ASK ")):
        kind, slot, where = text.split()[:3]
        host, _, port = where.rpartition(":")
        return Redirect(kind, int(slot), (host, int(port)))
    return None


def is_retryable(err: RespError) -> bool:
    """A reply that says "ask elsewhere or later" (a redirection or a busy node), not "no"."""
    return redirect_of(err) is not None or str(err).startswith(NODE_ERRORS)


def _addr_of(node: list, asked: Addr) -> Addr:
    """A node of a CLUSTER SLOTS reply; an empty or "?" host is the node that answered."""
    host = node[0].decode() if isinstance(node[0], bytes) else str(node[0])
    if host in ("", "?"):
        host = asked[0]
    return host, int(node[1])


class SlotMap:
    """The slot → primary map of one cluster, its replicas, and which nodes answer us.

    ``connect(addr, timeout_s)`` opens an authenticated connection (the card's); the map
    opens its own short-lived ones for CLUSTER SLOTS / INFO / NODES, never the I/O
    threads' connections."""

    def __init__(self, device: str, seeds: list[Addr], connect: Callable[[Addr, float], RespConnection],
                 probe_timeout_s: float = 1.0):
        self.device = device
        self.seeds = seeds
        self._connect = connect
        self._probe_timeout_s = probe_timeout_s
        self._lock = threading.Lock()
        self._slots: list[Optional[Addr]] = [None] * SLOTS
        self._replicas: dict[Addr, list[Addr]] = {}
        self._refreshed = 0.0
        self._down_until: dict[Addr, float] = {}
        self._down_logged: set[Addr] = set()
        self.refreshes = 0

    # ------------------------------------------------------------------ the map
    def refresh(self, force: bool = False) -> bool:
        """Learn the slot map from the first node that answers (answering nodes first).
        Without ``force``: at most every ``REFRESH_MIN_INTERVAL_S``, and not at all while
        another thread refreshes it. False only when no node answered."""
        if not self._lock.acquire(blocking=force):
            return True
        try:
            now = time.monotonic()
            if not force and now - self._refreshed < REFRESH_MIN_INTERVAL_S:
                return True
            self._refreshed = now
            for addr in self.known_nodes():
                try:
                    conn = self._connect(addr, self._probe_timeout_s)
                    try:
                        reply = conn.command(b"CLUSTER", b"SLOTS")
                    finally:
                        conn.close()
                except (TRANSPORT_ERRORS + (RespError,)):
                    continue
                slots: list[Optional[Addr]] = [None] * SLOTS
                replicas: dict[Addr, list[Addr]] = {}
                for entry in reply or []:
                    start, end, primary = int(entry[0]), int(entry[1]), entry[2]
                    p = _addr_of(primary, addr)
                    slots[start:end + 1] = [p] * (end - start + 1)
                    reps = replicas.setdefault(p, [])
                    for r in entry[3:]:
                        ra = _addr_of(r, addr)
                        if ra not in reps:
                            reps.append(ra)
                self._slots, self._replicas = slots, replicas
                self.refreshes += 1
                return True
            return False
        finally:
            self._lock.release()

    def primary(self, slot: int) -> Addr:
        """The primary of a slot (refreshing the map once if the slot has none)."""
        addr = self._slots[slot]
        if addr is None:
            self.refresh()
            addr = self._slots[slot]
            if addr is None:
                raise NodeIOError(f"cluster card {self.device}: slot {slot} has no node")
        return addr

    def moved(self, slot: int, addr: Addr) -> None:
        """A ``MOVED`` reply: the slot is served by ``addr`` now; the rest of the map is
        refreshed (rate-limited), since slots move in ranges."""
        self._slots[slot] = addr
        self.refresh()

    def primaries(self) -> list[Addr]:
        if all(a is None for a in self._slots):
            self.refresh(force=True)
        return sorted({a for a in self._slots if a is not None})

    def replicas_of(self, primary: Optional[Addr]) -> list[Addr]:
        return list(self._replicas.get(primary, [])) if primary else []

    def known_nodes(self) -> list[Addr]:
        """Every node of the map, their replicas and the seeds; the ones answering first."""
        seen: dict[Addr, None] = {}
        for addr in self._slots:
            if addr is not None:
                seen.setdefault(addr)
        for reps in self._replicas.values():
            for r in reps:
                seen.setdefault(r)
        for s in self.seeds:
            seen.setdefault(s)
        now = time.monotonic()
        return sorted(seen, key=lambda a: self._down_until.get(a, 0.0) > now)

    # ------------------------------------------------------------------ node health
    def resting(self, addr: Addr) -> bool:
        """Whether a node failed less than ``NODE_RETRY_S`` ago (do not try it yet)."""
        until = self._down_until.get(addr, 0.0)
        return bool(until) and time.monotonic() < until

    def node_failed(self, addr: Addr, exc: BaseException) -> None:
        """A node did not answer: it rests for a while (logged once until it answers again)
        and the map is refreshed (a failover shows up there)."""
        self._down_until[addr] = time.monotonic() + NODE_RETRY_S
        if addr not in self._down_logged:
            self._down_logged.add(addr)
            logger.warning("cluster card %s: node %s does not answer (%s); its slots are misses until "
                           "it answers or the cluster fails over", self.device, fmt_addr(addr), exc)
        self.refresh()

    def node_ok(self, addr: Addr) -> None:
        self._down_until.pop(addr, None)
        if addr in self._down_logged:
            self._down_logged.discard(addr)
            logger.info("cluster card %s: node %s answers again", self.device, fmt_addr(addr))

    # ------------------------------------------------------------------ the cluster's own view
    def topology(self) -> dict:
        """The cluster's view (CLUSTER INFO / NODES of the first node that answers) and ours
        (which nodes answer us), for STATS and the status file."""
        state, nodes = "unknown", []
        for addr in self.known_nodes():
            try:
                conn = self._connect(addr, self._probe_timeout_s)
                try:
                    info = conn.command(b"CLUSTER", b"INFO").decode()
                    listing = conn.command(b"CLUSTER", b"NODES").decode()
                finally:
                    conn.close()
            except (TRANSPORT_ERRORS + (RespError,)):
                continue
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            state = fields.get("cluster_state", "unknown").strip()
            now = time.monotonic()
            for line in listing.splitlines():
                parts = line.split()
                if len(parts) < 8:
                    continue
                host, _, port = parts[1].split("@", 1)[0].rpartition(":")
                flags = parts[2].split(",")
                role = "primary" if "master" in flags else "replica" if "slave" in flags else "unknown"
                slots = 0
                for r in parts[8:]:
                    if r.startswith("["):        # a slot being imported/migrated: counted where it is
                        continue
                    a, _, b = r.partition("-")
                    slots += (int(b) - int(a) + 1) if b else 1
                node = (host or addr[0], int(port or 0))
                nodes.append({"node": fmt_addr(node), "role": role, "slots": slots,
                              "failed": "fail" in flags or "fail?" in flags,
                              "answers": self._down_until.get(node, 0.0) <= now})
            break
        nodes.sort(key=lambda n: (n["role"] != "primary", n["node"]))
        return {"cluster_state": state, "cluster_nodes": nodes}
