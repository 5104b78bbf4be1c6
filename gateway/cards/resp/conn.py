"""A minimal RESP2 connection that moves values straight between a socket and a buffer.

Values of 128 KiB–3 MiB are the common case: a GET reads the reply's payload
with ``recv_into`` directly into the caller's buffer (a ring slot), and a SET
sends header and payload with one ``sendmsg`` — no intermediate ``bytes``.
Replies to pipelined small commands (STRLEN, GETRANGE of a header, DEL) are
parsed from a small read buffer in one pass (``read_replies``), and a batch of
single-key commands is encoded from one template per command (``encode_keyed``).
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, Optional, Sequence
from urllib.parse import urlparse


class RespError(Exception):
    """An error reply of the server (``-ERR ...``), e.g. OOM when the server is full."""


class RespConnection:
    """One connection to a Redis-protocol server (Redis, Valkey, Kvrocks)."""

    def __init__(self, url: str, timeout_s: Optional[float]):
        u = urlparse(url)
        if u.scheme not in ("redis", "tcp"):
            raise ValueError(f"a resp card is redis://host:port[/db], not {url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 6379
        self.db = int(u.path.strip("/") or 0)
        self.password = u.password
        self.sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        if self.password:
            self.command(b"AUTH", self.password.encode())
        if self.db:
            self.command(b"SELECT", str(self.db).encode())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ sending
    @staticmethod
    def encode(*args: bytes) -> bytes:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def command(self, *args: bytes):
        self.sock.sendall(self.encode(*args))
        return self.read_reply()

    def pipeline(self, commands: Sequence[Sequence[bytes]]) -> list:
        """Send all commands at once, then read every reply (errors returned as RespError)."""
        self.sock.sendall(b"".join(self.encode(*c) for c in commands))
        return self.read_replies(len(commands))

    @staticmethod
    def encode_keyed(keys: Sequence[bytes], commands: Sequence[Sequence[bytes]]) -> bytes:
        """Every command of ``commands`` (a name and its arguments after the key) for each key
        in turn, the key second: ``k0 c0, k0 c1, ..., k1 c0, ...`` (one template per command,
        filled per key: the encoding of a large batch of single-key commands)."""
        parts = []
        for name, *args in commands:
            pre = b"*%d\r\n$%d\r\n%s\r\n" % (2 + len(args), len(name), name)
            post = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
            parts.append(pre.replace(b"%", b"%%") + b"$%d\r\n%s\r\n" + post.replace(b"%", b"%%"))
        template = b"".join(parts)
        if len(commands) == 1:
            return b"".join([template % (len(k), k) for k in keys])
        return b"".join([template % tuple(x for _ in commands for x in (len(k), k)) for k in keys])

    def keyed_pipeline(self, keys: Sequence[bytes], commands: Sequence[Sequence[bytes]]) -> list:
        """``encode_keyed(keys, commands)`` sent at once, one round trip; the replies in that
        order (``len(keys) * len(commands)``, errors as RespError)."""
        self.sock.sendall(self.encode_keyed(keys, commands))
        return self.read_replies(len(keys) * len(commands))

    def set_value(self, key: bytes, parts: Sequence[memoryview]) -> None:
        """SET key to the concatenation of ``parts`` (one sendmsg, no copy of the payload)."""
        total = sum(len(p) for p in parts)
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, total)
        pending = [memoryview(head), *[memoryview(p).cast("B") for p in parts], memoryview(b"\r\n")]
        while pending:
            sent = self.sock.sendmsg(pending)
            while sent and pending:
                if sent >= len(pending[0]):
                    sent -= len(pending[0])
                    pending.pop(0)
                else:
                    pending[0] = pending[0][sent:]
                    sent = 0
        self.read_reply()

    # ------------------------------------------------------------------ receiving
    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self._buf += chunk

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[:i + 2]
                return line
            self._fill()

    def _exact_into(self, view: memoryview) -> None:
        n = len(view)
        have = min(n, len(self._buf))
        if have:
            view[:have] = self._buf[:have]
            del self._buf[:have]
        while have < n:
            got = self.sock.recv_into(view[have:], n - have)
            if not got:
                raise ConnectionError("the server closed the connection")
            have += got

    def _skip(self, n: int) -> None:
        scratch = bytearray(min(n, 1 << 20) or 1)
        while n > 0:
            k = min(n, len(scratch))
            self._exact_into(memoryview(scratch)[:k])
            n -= k

    def read_replies(self, n: int) -> list:
        """The next ``n`` replies, an error reply as a RespError in its place. Integers, simple
        and bulk strings (the replies of a batch of single-key commands) are parsed in one pass
        over the read buffer; an array reply goes through ``read_reply``."""
        out: list = []
        buf, pos = self._buf, 0
        while len(out) < n:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                del buf[:pos]
                pos = 0
                self._fill()
                continue
            kind = buf[pos]
            if kind == 36:                                   # $: a bulk string
                size = int(buf[pos + 1:eol])
                if size < 0:
                    out.append(None)
                    pos = eol + 2
                    continue
                end = eol + 2 + size
                if len(buf) < end + 2:
                    del buf[:pos]
                    pos = 0
                    self._fill()
                    continue
                out.append(bytes(buf[eol + 2:end]))
                pos = end + 2
            elif kind == 58:                                 # :
                out.append(int(buf[pos + 1:eol]))
                pos = eol + 2
            elif kind == 43:                                 # +
                out.append(bytes(buf[pos + 1:eol]))
                pos = eol + 2
            elif kind == 45:                                 # -
                out.append(RespError(bytes(buf[pos + 1:eol]).decode(errors="replace")))
                pos = eol + 2
            else:                                            # an array (or garbage): the general parser
                del buf[:pos]
                pos = 0
                try:
                    out.append(self.read_reply())
                except RespError as exc:
                    out.append(exc)
        del buf[:pos]
        return out

    def read_reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = bytearray(n)
            self._exact_into(memoryview(data))
            self._skip(2)
            return bytes(data)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        raise ConnectionError(f"unexpected reply {line[:40]!r}")

    def get_into(self, key: bytes, header: memoryview, payload: memoryview) -> Optional[int]:
        """GET key; the value's first ``len(header)`` bytes go to ``header`` and the next
        ``len(payload)`` to ``payload``. Returns the value's length (None for a missing key);
        a value of another length is drained and returned without filling ``payload``."""
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        return self.read_value_into(header, payload)

    def read_value_into(self, header: memoryview, payload: memoryview) -> Optional[int]:
        """The next reply (a GET's, e.g. of a pipeline), read as ``get_into`` does."""
        line = self._line()
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        if n != len(header) + len(payload):
            self._skip(n + 2)
            return n
        self._exact_into(header)
        self._exact_into(payload)
        self._skip(2)
        return n


class ThreadConnections:
    """Connections of a card's I/O threads: one per thread and node (a RESP connection is
    not shared between threads), all tracked so that ``reset`` closes every one of them and
    makes each thread open new ones on its next command."""

    def __init__(self):
        self._local = threading.local()
        self._generation = 0
        self._all: list[RespConnection] = []
        self._lock = threading.Lock()

    def _mine(self) -> dict:
        local = self._local
        if getattr(local, "gen", -1) != self._generation:
            local.conns, local.gen = {}, self._generation
        return local.conns

    def get(self, node, connect: Callable[[], RespConnection]) -> RespConnection:
        """This thread's connection to ``node``, made by ``connect()`` when there is none."""
        mine = self._mine()
        conn = mine.get(node)
        if conn is None:
            conn = mine[node] = connect()
            with self._lock:
                self._all.append(conn)
        return conn

    def has(self, node) -> bool:
        return node in self._mine()

    def drop(self, node) -> None:
        """Close this thread's connection to ``node`` (after a transport failure)."""
        conn = self._mine().pop(node, None)
        if conn is not None:
            conn.close()
            with self._lock:
                if conn in self._all:
                    self._all.remove(conn)

    def reset(self) -> None:
        """Close every thread's connections; each thread reconnects on its next command."""
        self._generation += 1
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
