"""Where the cluster card's commands go and how they come back: connections per node, one
command routed to its slot's primary (``MOVED``/``ASK`` followed), single-key commands
pipelined per node.

Contract: ``ClusterRouting`` is mixed into ``ClusterCard`` (``cards.resp_cluster``), which
sets before any call: ``device`` (its URL, for messages), ``password`` (or None),
``timeout_s`` (I/O timeout of a connection), ``map`` (the ``cluster_map.SlotMap``, built
with ``_connect``), ``_conns`` (a ``resp_conn.ThreadConnections``) and ``counters`` (a dict
with ``moved``, ``ask`` and ``node_errors``, counted here).

- ``_run(key, fn)``: ``fn(conn)`` on the primary of the key's slot, a ``MOVED`` updating the
  map and an ``ASK`` followed by ``ASKING``, at most ``MAX_REDIRECTS`` times; a node that
  does not answer (transport error, or a retryable error such as ``CLUSTERDOWN``/``LOADING``)
  raises ``NodeIOError`` (a miss, no strike against the card); other ``RespError`` pass.
- ``_keyed_pipeline(keys, commands)``: single-key commands for each key, one round trip per
  node, every node's batch sent before any reply is read; replies in order, a redirected or
  busy command run again alone through ``_run``; a ``NodeIOError`` (or ``RespError``) in
  place of a reply that failed.
- ``_conn(addr)`` raises ``NodeIOError`` for a node resting after a failure (with a
  rate-limited map refresh); ``_node_failed`` drops the node's connection, counts it, lets it
  rest and returns the ``NodeIOError`` to raise.
"""

from __future__ import annotations

from typing import Callable, Optional

from adpkv_gateway.cards.base import NodeIOError
from adpkv_gateway.cards.resp.cluster_map import (
    TRANSPORT_ERRORS, Addr, Redirect, SlotMap, fmt_addr, is_retryable, key_slot, redirect_of
)
from adpkv_gateway.cards.resp.conn import RespConnection, RespError, ThreadConnections

MAX_REDIRECTS = 5
_TRANSPORT = TRANSPORT_ERRORS


class ClusterRouting:
    """Connections, redirections and pipelines of a card that is a Redis Cluster (see the module's contract)."""

    # set by the card before any call (the module's contract)
    device: str
    password: Optional[str]
    timeout_s: float
    map: SlotMap
    _conns: ThreadConnections
    counters: dict[str, int]

    # ------------------------------------------------------------------ connections
    def _connect(self, addr: Addr, timeout: Optional[float]) -> RespConnection:
        conn = RespConnection(f"redis://{addr[0]}:{addr[1]}", timeout)
        try:
            if self.password:
                conn.command(b"AUTH", self.password.encode())
        except BaseException:
            conn.close()
            raise
        return conn

    def _conn(self, addr: Addr) -> RespConnection:
        if not self._conns.has(addr) and self.map.resting(addr):
            self.map.refresh()             # rate-limited: learns a failover as soon as it happened
            raise NodeIOError(f"cluster card {self.device}: node {fmt_addr(addr)} is down")
        return self._conns.get(addr, lambda: self._connect(addr, self.timeout_s))

    def _drop(self, addr: Addr) -> None:
        self._conns.drop(addr)

    def _node_failed(self, addr: Addr, exc: BaseException) -> NodeIOError:
        """A node did not answer: its connection is dropped, it rests a while (``SlotMap``)
        and the error the command raises is a miss, no strike against the card."""
        self._drop(addr)
        self.counters["node_errors"] += 1
        self.map.node_failed(addr, exc)
        return NodeIOError(f"cluster card {self.device}: node {fmt_addr(addr)}: {exc}")

    def reset_connections(self) -> None:
        self._conns.reset()

    # ------------------------------------------------------------------ one command, redirected
    def _run(self, key: bytes, fn: Callable[[RespConnection], object]):
        """``fn(conn)`` on the primary of the key's slot, following MOVED and ASK."""
        slot = key_slot(key)
        addr, asking = self.map.primary(slot), False
        for _ in range(MAX_REDIRECTS):
            try:
                conn = self._conn(addr)
                if asking:
                    conn.command(b"ASKING")
                result = fn(conn)
            except _TRANSPORT as exc:
                raise self._node_failed(addr, exc) from None
            except RespError as exc:
                red = redirect_of(exc)
                if red is None:
                    if is_retryable(exc):        # a busy or failing node
                        raise self._node_failed(addr, exc) from None
                    raise
                addr, asking = self._follow(red)
                continue
            self.map.node_ok(addr)
            return result
        raise NodeIOError(f"cluster card {self.device}: too many redirections for slot {slot}")

    def _follow(self, red: Redirect) -> tuple[Addr, bool]:
        if red.kind == "MOVED":
            self.counters["moved"] += 1
            self.map.moved(red.slot, red.addr)
            return red.addr, False
        self.counters["ask"] += 1
        return red.addr, True

    def _keyed_pipeline(self, keys: list[bytes], commands) -> list:
        """Every command of ``commands`` (a name and its arguments after the key) for each key
        in turn (``RespConnection.encode_keyed``), pipelined per node and in parallel across
        nodes: one round trip per node, every node's batch sent before any reply is read. A
        command redirected or refused by a busy node is run again alone through ``_run``.
        Replies in that order (``len(keys) * len(commands)``); a NodeIOError in place of every
        reply of a node that did not answer (the other nodes' replies stand)."""
        m = len(commands)
        out: list = [None] * (len(keys) * m)
        by_node: dict[Addr, list[int]] = {}
        for i, key in enumerate(keys):
            try:
                by_node.setdefault(self.map.primary(key_slot(key)), []).append(i)
            except NodeIOError as exc:
                out[i * m:(i + 1) * m] = [exc] * m
        sent: list[tuple[Addr, RespConnection, list[int]]] = []
        for addr, idx in by_node.items():
            try:
                conn = self._conn(addr)
                conn.sock.sendall(conn.encode_keyed([keys[i] for i in idx], commands))
                sent.append((addr, conn, idx))
            except _TRANSPORT as exc:
                err = self._node_failed(addr, exc)
                for i in idx:
                    out[i * m:(i + 1) * m] = [err] * m
            except NodeIOError as exc:
                for i in idx:
                    out[i * m:(i + 1) * m] = [exc] * m
        retry: list[tuple[int, int]] = []                 # (key, command) to run again alone
        for addr, conn, idx in sent:
            try:
                replies = conn.read_replies(len(idx) * m)
            except _TRANSPORT as exc:
                err = self._node_failed(addr, exc)
                for i in idx:
                    out[i * m:(i + 1) * m] = [err] * m
                continue
            for n, reply in enumerate(replies):
                i, j = idx[n // m], n % m
                if isinstance(reply, RespError) and is_retryable(reply):
                    retry.append((i, j))
                else:
                    out[i * m + j] = reply
            self.map.node_ok(addr)
        for i, j in retry:
            name, *args = commands[j]
            cmd = (name, keys[i], *args)
            try:                         # _run calls the function before it returns: cmd is this one's
                out[i * m + j] = self._run(keys[i], lambda c: c.command(*cmd))
            except (NodeIOError, RespError) as exc:
                out[i * m + j] = exc
        return out
