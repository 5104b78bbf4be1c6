"""Peers of the adversary tests: a control connection of one's own (``Raw``), what a reply
said (``answer``), and what an unprivileged child does with them (``store_own``,
``read_back``: run them through ``as_nobody``, a forked child that is uid/gid ``NOBODY``), and
root's objects written through the ring (``ring_fill``)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import traceback

import msgpack
import zmq

from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import DoorSession

from .rankproc import gateway_door, pattern

NOBODY = 65534
OBJ = 8192
ANSWER_S = 10.0


class Raw:
    """A control connection of its own: a door session, a region (a memfd of REGION_BYTES)
    and a DEALER, attached (HELLO) as rank 0 of ``engine`` when one is given. ``ask`` sends
    a request as a plain map and returns its final reply; a BATCH on the way (a refused
    request gets none) is counted in the reply's ``batches`` and acknowledged without data
    (RELEASE for a GET, FILLED ok=false for a PUT: nothing is stored from it)."""

    REGION_BYTES = 1 << 20

    def __init__(self, port: int, engine: str = "", world: int = 1):
        self.door = DoorSession(gateway_door(port), 5.0)
        self.region_fd = os.memfd_create("adpkv-test-region", os.MFD_CLOEXEC)
        os.ftruncate(self.region_fd, self.REGION_BYTES)
        reply = self.door.register_region(self.region_fd, 0, self.REGION_BYTES)
        assert isinstance(reply, P.RegionOk) and reply.region == 0, reply
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ids = itertools.count(1)
        self.hello = self.ask("HELLO", session=self.door.token, engine=engine, world=world, rank=0) \
            if engine else None

    def ask(self, op: str, **fields) -> dict:
        rid = next(self.ids)
        self.sock.send(msgpack.packb({"v": 1, "op": op, "id": rid, **fields}, use_bin_type=True))
        batches = 0
        while True:
            assert self.sock.poll(int(ANSWER_S * 1000)), f"no answer to {op}"
            reply = msgpack.unpackb(self.sock.recv(), raw=False)
            if reply.get("op") == "BATCH":
                batches += 1
                ack = {"op": "RELEASE"} if op == "GET" else {"op": "FILLED", "ok": False}
                self.sock.send(msgpack.packb({"v": 1, "id": f"ack-{rid}", "batch": reply["batch"], **ack}))
                continue
            if reply.get("id") != rid:
                continue                      # an acknowledgement's answer
            reply["batches"] = batches
            return reply

    def write(self, at: int, data: bytes) -> None:
        os.pwrite(self.region_fd, data, at)

    def read(self, at: int, n: int) -> bytes:
        return os.pread(self.region_fd, n, at)

    def close(self) -> None:
        try:
            if self.hello is not None and self.hello.get("op") == "OK":
                self.ask("BYE")
        finally:
            self.sock.close(0)
            self.ctx.term()
            self.door.close()
            os.close(self.region_fd)

    def __enter__(self) -> "Raw":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def answer(reply: dict) -> str:
    """What a reply said: its error code, else its op (a BATCH on the way shows as +BATCH)."""
    said = reply.get("code") or reply["op"]
    return said + ("+BATCH" if reply.get("batches") else "")


def store_own(port: int, keys: list) -> dict:
    """Attach ``nobody-engine`` and store ``keys`` from its region (``pattern(key, 1, OBJ)``
    each); the answers."""
    at = [i * OBJ for i in range(len(keys))]
    with Raw(port, "nobody-engine") as raw:
        for key, a in zip(keys, at):
            raw.write(a, pattern(key, 1, OBJ))
        put = raw.ask("PUT", keys=keys, obj=OBJ, region=0, at=at)
        return {"hello": answer(raw.hello), "put": answer(put), "stored": list(put.get("stored", b""))}


def read_back(port: int, keys: list, rank_pattern: int) -> dict:
    """Attach ``nobody-engine`` and GET ``keys`` into its region; the answers, and which
    objects came back as ``pattern(key, rank_pattern, OBJ)``."""
    at = [i * OBJ for i in range(len(keys))]
    with Raw(port, "nobody-engine") as raw:
        got = raw.ask("GET", keys=keys, obj=OBJ, region=0, at=at)
        return {"hello": answer(raw.hello), "get": answer(got), "hits": list(got.get("hits", b"")),
                "exact": [raw.read(a, OBJ) == pattern(k, rank_pattern, OBJ) for k, a in zip(keys, at)]}


def as_nobody(fn, *args, timeout: float = 60.0):
    """Run ``fn(*args)`` in a forked child that is uid/gid 65534; its return value, or the
    child's exception re-raised here as AssertionError with its traceback."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            assert os.geteuid() == NOBODY
            q.put(("ok", fn(*args)))
        except BaseException:
            q.put(("error", traceback.format_exc()))

    p = ctx.Process(target=child)
    p.start()
    try:
        kind, value = q.get(timeout=timeout)
    finally:
        p.join(10)
    if kind == "error":
        raise AssertionError("in the unprivileged child:\n" + value)
    return value


def ring_fill(client, keys):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
    return fill
