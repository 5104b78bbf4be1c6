"""A bounded fuzz of the control port and the door (issue 13, "Keep it tested").

One real gateway; while an engine (a real ``GatewayClient``, rank 0 of ``fuzz-engine``
with world 2, in a process of its own) stores and restores objects whose bytes are a
function of their key, three fuzz peers throw a few thousand frames at the control port:

- ``anon``: a door session that never stays attached (ops before HELLO; a HELLO that
  gets in is followed by BYE at once);
- ``lookup``: attached as a lookup peer of ``fuzz-engine`` (HELLO role=lookup);
- ``rank``: attached as rank 1 of ``fuzz-engine``, with a region of its own: its data
  requests get BATCHes, which it acknowledges well and badly (the wrong op, twice, a
  mistyped ``ok`` or ``batch``), and its RELEASE/FILLED name the engine's batches;
- ``foreign``: a door session of another user (uid 65534, ``ForeignDoor``), never attached
  (the engine is root's; a HELLO for it is FORBIDDEN, for another ENGINE_BUSY), which may
  also ask CLEAN and STATS with its own token.

Every peer's key lists hold, one time in five, a key of a namespace uid 65534 owns
(``fuzz-foreign``: it stored probe objects there before the engine attached): every request
naming such a key must be refused (an ERROR, never a BATCH), whatever else is wrong with it.

The structured part is Hypothesis (messages built from the op vocabulary with field
values good, out of bounds and of the wrong type); the raw part is a plain seeded loop
(random bytes, truncated and mutated msgpack, several frames, huge headers, deep
nesting, huge counts); the door part sends garbage packets and REGIONs of every wrong
kind of descriptor (a pipe, a directory, a read-only / write-only / O_PATH file, a file
outside /dev/shm, a symlink out of it, /dev/null, a socket, an eventfd, the ring, none,
two) with offsets and sizes out of bounds, against an exact oracle.

Asserted: the gateway stays alive and answers every frame that gets an answer (a
correct RELEASE/FILLED gets none; a tagged request waits for its collective until it
fails), no reply is INTERNAL or CARD_ERROR and the log has no internal error, the door keeps
no descriptor it refused, every byte the engine stored comes back exact, and the foreign
namespace holds what it held before (objects and bytes), its probe objects byte-exact.

Seed: ``ADPKV_FUZZ_SEED`` (an integer, or ``random``); the default is fixed, so the
normal test run is repeatable. ``ADPKV_FUZZ_SCALE`` multiplies the frame counts.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import select
import socket
import stat
import subprocess
import sys
import time
import uuid

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings, strategies as st

from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import DoorSession
from adpkv_core.keys import KEY_BYTES, namespace_id
from adpkv_gateway.ops import control

from ..adversary import NOBODY, as_nobody, read_back, store_own
from ..rankproc import gateway_door, make_keys

pytestmark = [pytest.mark.timeout(300), pytest.mark.fuzz, pytest.mark.security]

DEFAULT_SEED = 1313
SCALE = float(os.environ.get("ADPKV_FUZZ_SCALE", "1") or 1)
STRUCTURED_EXAMPLES = int(4000 * SCALE)
RAW_FRAMES = int(3000 * SCALE)
DOOR_PACKETS = int(1000 * SCALE)
ENGINE = "fuzz-engine"
FOREIGN_NS = "fuzz-foreign"            # uid 65534's: every request naming one of its keys is refused
KEYED_OPS = ("EXIST", "UNLOCK", "DELETE", "GET", "PUT")
WORLD = 2
RING = 64 << 20
REGION_BYTES = 1 << 20
MAX_KEYS = 1 << 20                     # gateway/loop/server.py MAX_KEYS_PER_REQUEST
ANSWER_S = 10.0                        # the longest any frame may wait for its answer
KNOWN_CODES = {P.BAD_MESSAGE, P.BAD_VERSION, P.UNKNOWN_OP, P.NOT_ATTACHED, P.ENGINE_BUSY, P.RANK_TAKEN,
               P.TOO_LARGE, P.UNKNOWN_BATCH, P.COLLECTIVE_MISMATCH, P.CLEAN_REFUSED, P.BAD_REGION,
               P.FORBIDDEN, P.DRAIN_REFUSED}


def fuzz_seed() -> int:
    raw = os.environ.get("ADPKV_FUZZ_SEED", "").strip()
    if raw == "random":
        return random.SystemRandom().randrange(1 << 32)
    return int(raw) if raw else DEFAULT_SEED


# ====================================================================== the engine
ENGINE_SCRIPT = r"""
import json, mmap, os, select, sys
sys.path.insert(0, sys.argv[3])
from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from rankproc import make_keys, pattern

port, shm = int(sys.argv[1]), sys.argv[2]
client = GatewayClient(ClientConfig(port=port, timeout_s=60, busy_wait_s=0), "%(engine)s",
                       rank=0, world_size=%(world)d)
if not client.enabled:
    print(json.dumps({"error": client.attach_error}), flush=True)
    sys.exit(1)
size = 4 << 20
fd = os.open(shm, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, size)
mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
os.close(fd)
region = client.register_region(shm, 0, size).result(timeout=30)
os.unlink(shm)
if region is None:
    print(json.dumps({"error": "region refused"}), flush=True)
    sys.exit(1)
print("ready", flush=True)
out = {"rounds": 0, "objects": 0, "stored": 0, "hits": 0, "exist_hits": 0, "wrong": 0,
       "region_objects": 0, "region_stored": 0, "region_hits": 0, "region_wrong": 0}
sizes = [4096, 20000, 65536 + 7, 300000]
r = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    obj, n = sizes[r %% len(sizes)], 6
    keys = make_keys(n, namespace="fuzz-engine-ns", salt=b"e" + r.to_bytes(4, "big"))

    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride + b.slice_offset
            client.ring[o:o + b.slice_bytes] = pattern(keys[b.first + j], 0, b.slice_bytes)

    def check(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride + b.slice_offset
                if bytes(client.ring[o:o + b.slice_bytes]) != pattern(keys[b.first + j], 0, b.slice_bytes):
                    out["wrong"] += 1

    out["objects"] += n
    out["stored"] += sum(client.put(keys, obj, fill).result(timeout=60).stored)
    out["exist_hits"] += sum(client.exist(keys).result(timeout=60))
    out["hits"] += sum(client.get(keys, obj, check).result(timeout=60).hits)
    if r %% 3 == 2:          # and through the region: the gateway copies, not the engine
        rkeys = make_keys(n, namespace="fuzz-engine-ns", salt=b"r" + r.to_bytes(4, "big"))
        at = [i * obj for i in range(n)]
        for k, a in zip(rkeys, at):
            mm[a:a + obj] = pattern(k, 0, obj)
        out["region_objects"] += n
        out["region_stored"] += sum(client.put_from(region, at, rkeys, obj).result(timeout=60).stored)
        mm[0:n * obj] = bytes(n * obj)
        out["region_hits"] += sum(client.get_into(region, at, rkeys, obj).result(timeout=60).hits)
        out["region_wrong"] += sum(mm[a:a + obj] != pattern(k, 0, obj) for k, a in zip(rkeys, at))
    r += 1
    out["rounds"] = r
client.close()
print(json.dumps(out), flush=True)
""" % {"engine": ENGINE, "world": WORLD}


def _read_line(proc, deadline: float) -> str:
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return proc.stdout.readline().strip()
    raise AssertionError("the engine process said nothing before the deadline")


# ====================================================================== control-port peers
class ForeignDoor:
    """A door session of uid 65534 held by this (root) process: a forked child drops to 65534,
    connects to the door and hands the connected socket back (``SCM_RIGHTS``). The gateway
    knows a connection by the credentials of its ``connect`` (``SO_PEERCRED``), so this
    session, and the control port with its token, act as uid 65534."""

    def __init__(self, path: str):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        pid = os.fork()
        if pid == 0:                       # the child: nothing but these calls, then _exit
            code = 1
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                door = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                door.connect(path)
                socket.send_fds(child, [b"door"], [door.fileno()])
                code = 0
            finally:
                os._exit(code)
        child.close()
        parent.settimeout(ANSWER_S)
        try:
            _, fds, _, _ = socket.recv_fds(parent, 16, 1)
        finally:
            parent.close()
            status = os.waitpid(pid, 0)[1]
        assert status == 0 and len(fds) == 1, (status, fds)
        self.sock = socket.socket(fileno=fds[0])
        self.sock.settimeout(ANSWER_S)
        self.sock.send(msgpack.packb({"v": 1, "op": "SESSION", "id": 1}))
        data, ring_fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        for fd in ring_fds:
            os.close(fd)
        reply = msgpack.unpackb(data, raw=False)
        assert reply.get("op") == "OK", reply
        self.token = reply["token"]

    def close(self):
        self.sock.close()


class Peer:
    """A DEALER with a door session (``door``, else one of its own); ``role`` says what it
    should stay attached as."""

    def __init__(self, port: int, name: str, ctx, door=None):
        self.name = name
        if door is None:
            door = DoorSession(gateway_door(port), 5.0)
        self.door = door
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.attached = False
        self.acks_expected: dict[str, str] = {}     # ack id -> the code its ERROR must carry
        self.pending_tags: set[int] = set()         # tagged requests waiting for their collective

    def close(self):
        self.sock.close(0)
        self.door.close()


TOKEN = object()         # placeholders the fuzzer fills in when it sends
UNIQUE = object()
NEAR_BATCH = object()


def peek(frame: bytes, any_map: bool = False):
    """The frame as a msgpack map of a protocol-1 request with a str op, else None (what
    the gateway will take for a request; its own decoding may refuse it still). With
    ``any_map``, any msgpack map."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return None
    if not isinstance(msg, dict):
        return None
    # (a missing v may be read as the current version)
    if not any_map and (msg.get("v", P.PROTOCOL_VERSION) != P.PROTOCOL_VERSION or
                        not isinstance(msg.get("op"), str)):
        return None
    return msg


def _same(a, b) -> bool:
    try:
        return a == b or repr(a) == repr(b)
    except Exception:
        return repr(a) == repr(b)


class Fuzzer:
    def __init__(self, port: int, rnd: random.Random, foreign_door: ForeignDoor, foreign_keys: list[bytes]):
        self.port = port
        self.rnd = rnd
        self.ctx = zmq.Context()
        self.peers = {name: Peer(port, name, self.ctx) for name in ("anon", "lookup", "rank")}
        self.peers["foreign"] = Peer(port, "foreign", self.ctx, foreign_door)
        self.foreign_keys = set(foreign_keys)
        self.ids = itertools.count(1)
        self.counts = collections.Counter()
        self.codes = collections.Counter()
        self.ops_sent = collections.Counter()
        self.problems: list[str] = []
        self.max_batch = 0
        self.corpus: list[bytes] = []
        # the rank's region: a memfd of its own session
        fd = os.memfd_create("fuzz-rank-region", os.MFD_CLOEXEC)
        os.ftruncate(fd, REGION_BYTES)
        door = self.peers["rank"].door.sock
        socket.send_fds(door, [msgpack.packb({"v": 1, "op": "REGION", "id": 1, "offset": 0,
                                              "size": REGION_BYTES})], [fd])
        os.close(fd)
        reply = msgpack.unpackb(socket.recv_fds(door, 1 << 16, 1)[0], raw=False)
        assert reply.get("op") == "OK" and reply["region"] == 0, reply
        for name in ("lookup", "rank"):
            self.restore(self.peers[name])

    def problem(self, text: str) -> None:
        self.counts["problems"] += 1
        if len(self.problems) < 40:
            self.problems.append(text[:600])
            print(f"fuzz problem: {text[:600]}", flush=True)
        if self.counts["unanswered"] > 3:
            raise AssertionError("the gateway stopped answering:\n" + "\n".join(self.problems))

    def close(self):
        for p in self.peers.values():
            p.close()
        self.ctx.term()

    # ------------------------------------------------------------------ sending
    def send_msg(self, peer: Peer, msg: dict, what: str = "", corpus: bool = False) -> dict | None:
        try:
            frame = msgpack.packb(msg, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            self.counts["unencodable"] += 1
            return None
        if corpus and msg.get("op") not in ("HELLO", "CLEAN") and "tag" not in msg and len(frame) < 4096:
            self.corpus.append(frame)
            del self.corpus[:-300]
        return self.send_frames(peer, [frame], what or f"{msg!r:.300}")

    def send_frames(self, peer: Peer, frames: list[bytes], what: str) -> dict | None:
        """Send one request; wait for its answer (and handle BATCHes on the way)."""
        expected, tagged, decoded = None, False, None
        if len(frames) == 1:
            # the reply echoes the id, or says None where the gateway could not read it
            expected = (peek(frames[0], any_map=True) or {}).get("id")
            decoded = peek(frames[0])
            if decoded is not None:
                tagged = decoded["op"] in ("GET", "PUT") and isinstance(decoded.get("tag"), str)
        if tagged and not (isinstance(expected, int) and not isinstance(expected, bool)):
            self.problem(f"test bug: a tagged request needs a unique id: {what}")
            return None
        self.counts["frames"] += 1
        if decoded is not None:
            self.ops_sent[str(decoded.get("op"))[:12]] += 1
        peer.sock.send_multipart(frames)
        sentinel = None
        if tagged:
            # a tagged request may wait for its collective: a PING behind it says when
            # everything the gateway had to say about it at once has been said
            sentinel = f"sentinel-{next(self.ids)}"
            peer.sock.send(msgpack.packb({"v": 1, "op": "PING", "id": sentinel}))
        reply = self.collect(peer, expected, what, sentinel, decoded.get("op") if decoded else None)
        if tagged and reply is None:
            peer.pending_tags.add(expected)
            self.counts["waiting_for_collective"] += 1
        if decoded is not None and reply is not None and reply.get("op") == "OK":
            if decoded["op"] == "HELLO":
                peer.attached = True
            elif decoded["op"] == "BYE":
                self.detached(peer)
        return reply

    def detached(self, peer: Peer) -> None:
        peer.attached = False
        # a rank that leaves takes its parts of collectives with it: no answer owed
        self.counts["collective_parts_left"] += len(peer.pending_tags)
        peer.pending_tags.clear()

    def collect(self, peer: Peer, expected, what: str, sentinel=None, op_sent=None) -> dict | None:
        """The answer to the frame just sent (id ``expected``, or None where the gateway could
        not read the frame's id); with a ``sentinel`` PING behind it, None when the gateway
        answered the PING first (a request that waits)."""
        deadline = time.monotonic() + ANSWER_S
        answer = None
        while answer is None or sentinel is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not peer.sock.poll(int(left * 1000) + 1):
                self.counts["unanswered"] += 1
                self.problem(f"{peer.name}: no answer within {ANSWER_S} s to {what}")
                return answer
            reply = self._recv(peer)
            if reply is None:
                continue
            rid, op = reply.get("id"), reply.get("op")
            if op == "BATCH":
                if not _same(rid, expected):
                    self.problem(f"{peer.name}: a BATCH for id {rid!r} while waiting for {expected!r}")
                self.on_batch(peer, reply, op_sent)
                continue
            if sentinel is not None and rid == sentinel and op == "OK":
                if answer is None:
                    return None          # it waits for its collective
                sentinel = None
                continue
            if self._stray(peer, reply):
                continue
            if answer is None and (rid is None or expected is None or _same(rid, expected)) and \
                    op in ("OK", "ERROR", "DONE"):
                # (expected None: a frame msgpack does not read as a map, which the gateway's
                # own decoder may still read, and answer with the id it found)
                answer = reply
                self.counts["answered"] += 1
                if reply.get("code") == P.NOT_ATTACHED and peer.attached:
                    # a frame the gateway read as BYE, where msgpack read something else
                    self.detached(peer)
                continue
            self.problem(f"{peer.name}: unexpected reply {reply!r:.300} while waiting for {expected!r} ({what})")
        return answer

    def _recv(self, peer: Peer) -> dict | None:
        raw = peer.sock.recv()
        self.counts["replies"] += 1
        try:
            reply = msgpack.unpackb(raw, raw=False)
        except Exception as exc:
            self.problem(f"{peer.name}: a reply that is not msgpack ({exc!r})")
            return None
        if reply.get("op") == "ERROR":
            code = reply.get("code")
            self.codes[code] += 1
            if code == P.INTERNAL:
                self.counts["internal"] += 1
                self.problem(f"{peer.name}: INTERNAL {reply!r:.400}")
            elif code not in KNOWN_CODES:
                self.problem(f"{peer.name}: unexpected code {reply!r:.300}")
            if not isinstance(reply.get("msg"), str) or len(reply["msg"]) > 1000:
                self.problem(f"{peer.name}: an error message that is not short text: {reply!r:.300}")
        if reply.get("op") == "BATCH":
            self.max_batch = max(self.max_batch, int(reply.get("batch", 0)))
        return reply

    def _stray(self, peer: Peer, reply: dict) -> bool:
        """Answers to earlier frames: a bad acknowledgement, a collective that failed."""
        rid, code = reply.get("id"), reply.get("code")
        if isinstance(rid, str) and rid in peer.acks_expected:
            want = peer.acks_expected.pop(rid)
            if reply.get("op") != "ERROR" or code != want:
                self.problem(f"{peer.name}: acknowledgement {rid} wanted {want}, got {reply!r:.300}")
            return True
        if isinstance(rid, int) and rid in peer.pending_tags and code == P.COLLECTIVE_MISMATCH:
            peer.pending_tags.discard(rid)
            self.counts["answered_late"] += 1
            return True
        return False

    def drain(self, peer: Peer) -> None:
        """Wait for every answer still owed to ``peer``."""
        deadline = time.monotonic() + ANSWER_S
        while peer.acks_expected or peer.pending_tags:
            left = deadline - time.monotonic()
            if left <= 0 or not peer.sock.poll(int(left * 1000) + 1):
                self.counts["unanswered"] += len(peer.acks_expected) + len(peer.pending_tags)
                self.problem(f"{peer.name}: still owed {peer.acks_expected} {peer.pending_tags}")
                return
            reply = self._recv(peer)
            if reply is not None and not self._stray(peer, reply):
                self.problem(f"{peer.name}: unexpected reply {reply!r:.300} while draining")

    # ------------------------------------------------------------------ batches of the fuzz rank
    def on_batch(self, peer: Peer, batch: dict, op_sent) -> None:
        """Acknowledge a BATCH, sometimes badly first or twice after; always well once."""
        bid = batch["batch"]
        self.counts["batches"] += 1
        if op_sent not in ("GET", "PUT"):
            # a mutated frame msgpack reads one way and the gateway another (a key twice):
            # a GET batch says what it found, a PUT batch does not
            op_sent = "GET" if batch.get("hits") is not None else "PUT"
        want = "RELEASE" if op_sent == "GET" else "FILLED"
        other = "FILLED" if want == "RELEASE" else "RELEASE"
        roll = self.rnd.random()

        def ack(op, expect=None, **fields):
            ack_id = f"ack-{next(self.ids)}"
            if expect:
                peer.acks_expected[ack_id] = expect
            self.counts["acks"] += 1
            self.counts["frames"] += 1
            self.counts["answers_owed" if expect else "acks_silent"] += 1
            peer.sock.send(msgpack.packb({"v": 1, "op": op, "id": ack_id, "batch": bid, **fields},
                                         use_bin_type=True))

        if roll < 0.10:
            ack(other, P.BAD_MESSAGE)                       # the wrong op for this batch
        elif roll < 0.15 and want == "FILLED":
            ack(want, P.BAD_MESSAGE, ok="yes")              # a mistyped ok
        elif roll < 0.20:
            ack_id = f"ack-{next(self.ids)}"                # a mistyped batch
            peer.acks_expected[ack_id] = P.BAD_MESSAGE
            self.counts["acks"] += 1
            self.counts["frames"] += 1
            peer.sock.send(msgpack.packb({"v": 1, "op": want, "id": ack_id, "batch": str(bid)}))
        ack(want, ok=self.rnd.random() > 0.15)
        if roll > 0.80:
            ack(want, P.UNKNOWN_BATCH, ok=True)             # twice

    # ------------------------------------------------------------------ roles
    def restore(self, peer: Peer) -> None:
        """Put a peer back in its role after a fuzz frame moved it."""
        if peer.name in ("anon", "foreign") and peer.attached:
            if peer.name == "foreign":
                self.problem("foreign: uid 65534 attached to the gateway of root's engine")
            reply = self.send_msg(peer, {"v": 1, "op": "BYE", "id": next(self.ids)}, "restore BYE")
            if reply is None or reply.get("op") != "OK":
                self.problem(f"{peer.name}: BYE refused: {reply!r}")
            self.drain(peer)
        elif peer.name in ("lookup", "rank") and not peer.attached:
            hello = {"v": 1, "op": "HELLO", "id": next(self.ids), "session": peer.door.token,
                     "engine": ENGINE, "world": WORLD}
            if peer.name == "lookup":
                hello["role"] = "lookup"
            else:
                hello["rank"] = 1
            reply = self.send_msg(peer, hello, f"restore HELLO {peer.name}")
            if reply is None or reply.get("op") != "OK":
                self.problem(f"{peer.name}: cannot attach again: {reply!r}")

    # ------------------------------------------------------------------ a structured message
    def send_structured(self, name: str, msg: dict) -> None:
        peer = self.peers[name]
        msg = dict(msg)
        if msg.get("op") in ("CLEAN", "DRAIN") and name != "foreign":
            # CLEAN (DRAIN) with root's session would delete (move) the engine's objects: only the
            # unattached peer sends it, with any session but its own (uid 65534 with its own: FORBIDDEN)
            peer = self.peers["anon"]
            if msg.get("session") is TOKEN:
                msg["session"] = os.urandom(16)
        for name_, value in list(msg.items()):
            if value is TOKEN:
                msg[name_] = peer.door.token
            elif value is UNIQUE:
                msg[name_] = next(self.ids)
            elif isinstance(value, tuple) and value and value[0] is NEAR_BATCH:
                msg[name_] = max(0, self.max_batch + value[1])
        if msg.get("op") in ("GET", "PUT") and isinstance(msg.get("tag"), str):
            msg["id"] = next(self.ids)
        keys = msg.get("keys")
        foreign = msg.get("op") in KEYED_OPS and isinstance(keys, list) and \
            any(isinstance(k, bytes) and k in self.foreign_keys for k in keys)
        batches = self.counts["batches"]
        reply = self.send_msg(peer, msg, corpus=True)
        if foreign:
            # refused, whatever else is wrong with it: an ERROR, no BATCH, no waiting
            self.counts["foreign_key_requests"] += 1
            if reply is None or reply.get("op") != "ERROR" or self.counts["batches"] != batches:
                self.problem(f"{peer.name}: a request naming a key of {FOREIGN_NS} was not refused: "
                             f"{msg!r:.300} -> {reply!r:.200}")
            elif reply.get("code") == P.FORBIDDEN:
                self.counts["foreign_key_forbidden"] += 1
        if peer.name == "foreign" and reply is not None and reply.get("op") == "OK":
            if msg.get("op") == "CLEAN" or (msg.get("op") == "STATS" and ENGINE in repr(reply)):
                self.problem(f"foreign: {msg.get('op')} answered {reply!r:.300}")
        self.restore(peer)


# ====================================================================== Hypothesis strategies
SPECIAL_INTS = [0, 1, -1, 2, 7, 255, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63,
                2 ** 64 - 1, -(2 ** 63)]
INTS = st.one_of(st.sampled_from(SPECIAL_INTS), st.integers(-(2 ** 63), 2 ** 64 - 1))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False), st.text(max_size=16),
                    st.binary(max_size=48))
ANYTHING = st.recursive(SCALARS, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6), c,
                                                                                        max_size=4),
                        max_leaves=12)
OPS = sorted(P.REQUEST_OPS)
FIELDS = {
    "HELLO": ("session", "engine", "role", "rank", "world", "namespace", "layout"),
    "BYE": (), "PING": (),
    "EXIST": ("keys", "marks", "lock"), "UNLOCK": ("keys",), "DELETE": ("keys", "marks"),
    "GET": ("keys", "marks", "obj", "tag", "unlock", "region", "at"),
    "PUT": ("keys", "marks", "obj", "tag", "region", "at"),
    "RELEASE": ("batch", "ok"), "FILLED": ("batch", "ok"),
    "CLEAN": ("session",), "DRAIN": ("session", "card"), "STATS": ("session",),
}
ALL_FIELDS = sorted({f for fs in FIELDS.values() for f in fs})
PRESENT = {"tag": 2, "region": 3, "marks": 4, "at": 3, "unlock": 3, "lock": 5, "role": 5, "layout": 4,
           "namespace": 5}          # chance in 10 that a field is there (else 8)


@st.composite
def weighted(draw, good, bad=ANYTHING, times=3):
    """``good`` ``times`` times as often as ``bad`` (``st.one_of`` would merge repeated branches)."""
    return draw(good) if draw(st.integers(0, times)) < times else draw(bad)


@st.composite
def maybe_foreign(draw, key_lists, foreign_keys):
    """A key list of ``key_lists``, one time in five with a key of ``FOREIGN_NS`` put in."""
    keys = draw(key_lists)
    if isinstance(keys, list) and draw(st.integers(0, 4)) == 0:
        keys.insert(draw(st.integers(0, len(keys))), draw(st.sampled_from(foreign_keys)))
    return keys


def field_strategies(fuzz_keys, foreign_keys):
    return {
        "session": weighted(st.just(TOKEN), st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40),
                                                      ANYTHING)),
        "engine": weighted(st.just(ENGINE), st.one_of(st.just("other-engine"), st.text(max_size=20),
                                                      st.sampled_from(["", "e" * 300, "a\nb", "\x00"]), ANYTHING),
                           times=2),
        "role": weighted(st.sampled_from(["rank", "lookup", "lookup", "Lookup", ""])),
        "rank": weighted(st.sampled_from([0, 1, 2, -1, WORLD]), INTS | ANYTHING),
        "world": weighted(st.sampled_from([WORLD, WORLD, 1, 0, 1024, 1025]), INTS | ANYTHING),
        "namespace": weighted(st.text(max_size=20), st.sampled_from(["n" * 257, "a\tb"]) | ANYTHING),
        "layout": weighted(st.dictionaries(st.text(max_size=8), SCALARS, max_size=4),
                           st.just({"x": "y" * 20_000}) | ANYTHING),
        "card": weighted(st.text(max_size=20), ANYTHING),
        "lock": weighted(st.booleans()), "unlock": weighted(st.booleans()), "ok": weighted(st.booleans()),
        "obj": weighted(st.sampled_from([1, 100, 4096, 4096, 65536 + 3, 131072]),
                        st.one_of(st.sampled_from([0, -1, 2 ** 40, 2 ** 48, 2 ** 62, 2 ** 63 - 1, 2 ** 63,
                                                   2 ** 64 - 1, -(2 ** 63), RING // 2, RING // 2 + 1]),
                                  INTS, ANYTHING), times=2),
        "tag": weighted(st.text(max_size=4), times=2),
        "region": weighted(st.just(0), st.sampled_from([1, -1, 8, 2 ** 63, 2 ** 64 - 1]) | ANYTHING),
        "batch": weighted(st.tuples(st.just(NEAR_BATCH), st.integers(-8, 8)), INTS | ANYTHING, times=2),
        "keys": weighted(maybe_foreign(st.lists(st.sampled_from(fuzz_keys), min_size=1, max_size=12),
                                       foreign_keys),
                         st.one_of(st.lists(st.binary(max_size=KEY_BYTES + 4), max_size=6),
                                   st.lists(st.sampled_from(fuzz_keys) | ANYTHING, max_size=4),
                                   st.just([]), ANYTHING), times=3),
    }


GOOD_OBJ = [1, 100, 4096, 65536 + 3, 131072]


@st.composite
def near_valid(draw, fuzz_keys, foreign_keys):
    """A well-formed request of a random op, then (half the time) one field made bad."""
    op = draw(st.sampled_from(OPS))
    msg = {"v": P.PROTOCOL_VERSION, "op": op, "id": UNIQUE}
    keys = draw(maybe_foreign(st.lists(st.sampled_from(fuzz_keys), min_size=1, max_size=12), foreign_keys))
    if op == "HELLO":
        msg.update(session=TOKEN, engine=ENGINE, world=WORLD)
        if draw(st.booleans()):
            msg["role"] = "lookup"
        else:
            msg["rank"] = draw(st.integers(0, WORLD - 1))
    elif op in ("EXIST", "UNLOCK", "DELETE"):
        msg["keys"] = keys
        if op != "UNLOCK" and draw(st.booleans()):
            msg["marks"] = draw(st.lists(st.integers(0, 2 ** 64 - 1), min_size=len(keys), max_size=len(keys)))
        if op == "EXIST":
            msg["lock"] = draw(st.booleans())
    elif op in ("GET", "PUT"):
        obj = draw(st.sampled_from(GOOD_OBJ))
        msg.update(keys=keys, obj=obj)
        if draw(st.integers(0, 3)) == 0:
            msg["marks"] = draw(st.lists(st.integers(0, 2 ** 64 - 1), min_size=len(keys), max_size=len(keys)))
        if draw(st.integers(0, 2)) == 0:
            msg["region"] = 0
            msg["at"] = draw(st.lists(st.integers(0, REGION_BYTES - obj), min_size=len(keys), max_size=len(keys)))
        elif draw(st.integers(0, 5)) == 0:
            msg["tag"] = draw(st.sampled_from(["a", "b", "c"]))
        if op == "GET" and draw(st.booleans()):
            msg["unlock"] = draw(st.booleans())
    elif op in ("RELEASE", "FILLED"):
        msg["batch"] = (NEAR_BATCH, draw(st.integers(-8, 8)))
        msg["ok"] = draw(st.booleans())
    elif op in ("STATS", "CLEAN", "DRAIN"):
        msg["session"] = TOKEN
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(set(msg) | set(FIELDS[op]) | {"v", "id"})))
        msg[field] = draw(st.one_of(st.sampled_from(SPECIAL_INTS), st.sampled_from([True, None, "", b"", [], {}]),
                                    ANYTHING))
    return msg


@st.composite
def messages(draw, strategies, fuzz_keys, foreign_keys):
    name = draw(st.sampled_from(["anon", "lookup", "rank", "rank", "rank", "foreign"]))
    if draw(st.integers(0, 2)) == 0:
        return name, draw(near_valid(fuzz_keys, foreign_keys))
    op = draw(weighted(st.sampled_from(OPS),
                       st.one_of(st.sampled_from(["ping", "Get", "", "SESSION", "REGION", "DONE", "BATCH", "OK",
                                                  "ERROR", "HELLO "]), st.text(max_size=12), ANYTHING),
                       times=8))
    fields = FIELDS.get(op) if isinstance(op, str) else None
    if fields is None:
        fields = draw(st.lists(st.sampled_from(ALL_FIELDS), max_size=4, unique=True))
    msg = {"v": draw(weighted(st.just(P.PROTOCOL_VERSION), times=12)), "op": op,
           "id": draw(weighted(st.just(UNIQUE), times=8))}
    n = None
    for f in fields:
        if draw(st.integers(0, 9)) >= PRESENT.get(f, 8):
            continue
        if f == "marks":
            k = n if n is not None else 1
            msg[f] = draw(weighted(st.lists(st.integers(0, 2 ** 64 - 1), min_size=k, max_size=k),
                                   st.one_of(st.lists(INTS | SCALARS, min_size=k, max_size=k),
                                             st.lists(INTS, max_size=k + 2), ANYTHING), times=2))
        elif f == "at":
            k = n if n is not None else 1
            msg[f] = draw(weighted(st.lists(st.integers(0, REGION_BYTES - 131072), min_size=k, max_size=k),
                                   st.one_of(st.lists(st.sampled_from([-1, REGION_BYTES, REGION_BYTES - 1,
                                                                       2 ** 63 - 1, 2 ** 64 - 1]) | INTS | SCALARS,
                                                      min_size=k, max_size=k),
                                             st.lists(INTS, max_size=k + 2), ANYTHING), times=2))
        else:
            msg[f] = draw(strategies[f])
            if f == "keys" and isinstance(msg[f], list):
                n = len(msg[f])
    if draw(st.integers(0, 19)) == 0:                       # an unknown extra field
        msg[draw(st.text(max_size=8))] = draw(ANYTHING)
    for essential in ("v", "op", "id"):                    # and now and then one missing
        if draw(st.integers(0, 39)) == 0:
            msg.pop(essential, None)
    return name, msg


# ====================================================================== raw frames
HUGE_HEADERS = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff", b"\xda\xff\xff"]


def raw_frames(rnd: random.Random, corpus: list[bytes]) -> tuple[list[bytes], str]:
    kind = rnd.randrange(10)
    if kind == 0:
        return [rnd.randbytes(rnd.choice([0, 1, 2, 5, 17, 64, 300, 4096]))], "random bytes"
    if kind in (1, 2) and corpus:
        base = rnd.choice(corpus)
        return [base[:rnd.randrange(len(base))]], "truncated msgpack"
    if kind in (3, 4, 5) and corpus:
        data = bytearray(rnd.choice(corpus))
        for _ in range(rnd.randint(1, 4)):
            at = rnd.randrange(len(data))
            how = rnd.randrange(4)
            if how == 0:
                data[at] ^= 1 << rnd.randrange(8)
            elif how == 1:
                data[at] = rnd.randrange(256)
            elif how == 2:
                data.insert(at, rnd.randrange(256))
            elif len(data) > 1:
                del data[at]
        return [bytes(data)], "mutated msgpack"
    if kind == 6:
        return [rnd.randbytes(rnd.randrange(40)) for _ in range(rnd.randint(2, 4))], "several frames"
    if kind == 7:
        value = rnd.choice([1, [1, 2], "PING", None, 3.5, b"x", [{"v": 1, "op": "PING"}], True])
        return [msgpack.packb(value, use_bin_type=True)], "not a map"
    if kind == 8:
        head = rnd.choice(HUGE_HEADERS)
        body = msgpack.packb({"v": 1, "op": "PING", "id": 1})[:-1] + head if rnd.random() < 0.5 else head
        return [body + rnd.randbytes(rnd.randrange(8))], "huge header"
    packer = msgpack.Packer(use_bin_type=True, strict_types=False)
    m = rnd.randrange(3)
    if m == 0:                                  # keys that are not strings
        return [b"\x83\x01\x01" + packer.pack("op") + packer.pack("PING") + packer.pack("v") + b"\x01"], "int map key"
    if m == 1:           # deeper nesting: test_deeply_nested_frames_are_bad_messages
        depth = rnd.choice([1, 10, 100, 300])
        return [b"\x81\xa2id" + b"\x91" * depth + b"\xc0"], "nesting"
    return [msgpack.packb({"v": 1, "op": rnd.choice(["GET", "PING", "STATS"]), "id": 5,
                           "pad": rnd.randbytes(rnd.choice([1000, 100_000]))})], "padded"


def explicit_cases(fuzz_keys) -> list[tuple[str, dict, str]]:
    """Huge counts and sizes that a random search would rarely reach."""
    k = fuzz_keys
    short = [b""] * (MAX_KEYS + 1)
    return [
        ("lookup", {"op": "EXIST", "keys": short}, "keys over the limit"),
        ("rank", {"op": "GET", "keys": short, "obj": 4096}, "GET keys over the limit"),
        ("rank", {"op": "PUT", "keys": [k[0]] * 5000, "obj": 4096, "marks": [0] * 4999}, "marks short by one"),
        ("rank", {"op": "GET", "keys": k[:3], "obj": 2 ** 63}, "obj 2^63"),
        ("rank", {"op": "PUT", "keys": k[:3], "obj": 2 ** 64 - 1}, "obj 2^64-1"),
        ("rank", {"op": "PUT", "keys": k[:3], "obj": RING // 2 + 1}, "obj half the ring + 1"),
        ("rank", {"op": "GET", "keys": k[:3], "obj": 4096, "marks": [2 ** 64 - 1, 0, -1]}, "mark -1"),
        ("rank", {"op": "GET", "keys": k[:2], "obj": 4096, "marks": [True, 0]}, "mark bool"),
        ("rank", {"op": "GET", "keys": k[:2], "obj": 4096, "region": 0, "at": [0]}, "at short"),
        ("rank", {"op": "GET", "keys": k[:2], "obj": 4096, "region": 0, "at": [0, REGION_BYTES - 4095]},
         "at past the end"),
        ("rank", {"op": "PUT", "keys": k[:2], "obj": 4096, "region": 0, "at": [-1, 0]}, "at negative"),
        ("rank", {"op": "PUT", "keys": k[:2], "obj": 4096, "region": 0, "at": [2 ** 63, 0]}, "at 2^63"),
        ("rank", {"op": "PUT", "keys": k[:2], "obj": 4096, "region": 0, "at": ["0", 0]}, "at str"),
        ("rank", {"op": "PUT", "keys": k[:2], "obj": 4096, "region": 2 ** 63, "at": [0, 0]}, "region 2^63"),
        ("rank", {"op": "PUT", "keys": k[:2], "obj": 4096, "region": 0, "at": [0, 0], "tag": "t"},
         "region with a tag"),
        ("rank", {"op": "GET", "keys": k[:2], "obj": 4096, "id": None}, "GET without id"),
        ("rank", {"op": "PUT", "keys": k[:2], "obj": 4096, "id": None}, "PUT without id"),
        ("rank", {"op": "GET", "keys": k[:2], "obj": 4096, "id": [1, {"x": b"y"}]}, "GET with a list id"),
        ("rank", {"op": "RELEASE", "batch": 2 ** 64 - 1}, "RELEASE 2^64-1"),
        ("rank", {"op": "FILLED", "batch": -(2 ** 63), "ok": 1}, "FILLED ok int"),
        ("lookup", {"op": "GET", "keys": k[:2], "obj": 4096}, "GET from a lookup peer"),
        ("lookup", {"op": "PUT", "keys": k[:2], "obj": 4096, "region": 0, "at": [0, 0]}, "PUT from a lookup"),
        ("anon", {"op": "HELLO", "session": TOKEN, "engine": "other", "rank": 0, "world": 1}, "another engine"),
        ("anon", {"op": "HELLO", "session": TOKEN, "engine": ENGINE, "rank": 0, "world": WORLD}, "rank 0 taken"),
        ("anon", {"op": "HELLO", "session": TOKEN, "engine": ENGINE, "rank": 0, "world": 1}, "another world"),
        ("anon", {"op": "HELLO", "session": TOKEN, "engine": ENGINE, "role": "lookup", "world": 2 ** 64 - 1},
         "lookup world 2^64-1"),
        ("anon", {"op": "HELLO", "session": TOKEN, "engine": ENGINE, "world": WORLD, "layout": [1]}, "layout list"),
        ("anon", {"op": "HELLO", "session": TOKEN, "engine": ENGINE, "world": WORLD, "rank": 1,
                  "layout": {"deep": [[[[[[[[1]]]]]]]] * 500}}, "layout big"),
    ]


# ====================================================================== the door
class DoorObjects:
    """Descriptors of every kind for REGION, and how to tell the gateway still holds one."""

    def __init__(self, tmp_path, tag: str):
        self.fds: dict[str, int] = {}
        self.paths: list[str] = []
        outside = str(tmp_path / f"doorfuzz-outside-{tag}")
        with open(outside, "wb") as fh:
            fh.truncate(REGION_BYTES)
        shm = f"/dev/shm/adpkv-doorfuzz-{tag}"
        fd = os.open(shm, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, REGION_BYTES)
        self.fds["shm_rw"] = fd
        link = f"/dev/shm/adpkv-doorfuzz-link-{tag}"
        os.symlink(outside, link)
        self.paths += [shm, link]
        self.markers = [outside, shm, "/memfd:doorfuzz", str(tmp_path / f"doorfuzz-dir-{tag}")]
        os.mkdir(self.markers[3])
        self.fds["shm_ro"] = os.open(shm, os.O_RDONLY)
        self.fds["shm_wo"] = os.open(shm, os.O_WRONLY)
        self.fds["shm_path"] = os.open(shm, os.O_PATH)
        self.fds["outside_rw"] = os.open(outside, os.O_RDWR)
        self.fds["link_rw"] = os.open(link, os.O_RDWR)
        self.fds["dir"] = os.open(self.markers[3], os.O_RDONLY | os.O_DIRECTORY)
        self.fds["devnull"] = os.open("/dev/null", os.O_RDWR)
        r, w = os.pipe()
        self.fds["pipe_r"], self.fds["pipe_w"] = r, w
        a, b = socket.socketpair()
        self.sockets = (a, b)
        self.fds["socket"] = a.fileno()
        self.fds["eventfd"] = os.eventfd(0)
        mfd = os.memfd_create("doorfuzz", os.MFD_CLOEXEC)
        os.ftruncate(mfd, REGION_BYTES)
        self.fds["memfd"] = mfd
        small = os.memfd_create("doorfuzz", os.MFD_CLOEXEC)
        os.ftruncate(small, 4096)
        self.fds["memfd_small"] = small
        self.inodes = {f"pipe:[{os.fstat(r).st_ino}]", f"socket:[{os.fstat(a.fileno()).st_ino}]"}

    def size_of(self, name: str) -> int:
        return RING if name == "ring" else os.fstat(self.fds[name]).st_size

    def usable(self, name: str) -> bool:
        return name in ("shm_rw", "memfd", "memfd_small")      # not "ring": a ring is no region

    def held_by(self, pid: int) -> list[str]:
        held = []
        for entry in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{entry}")
            except OSError:
                continue
            if target in self.inodes or any(target.startswith(m) for m in self.markers):
                held.append(target)
        return held

    def close(self):
        for name, fd in self.fds.items():
            if name != "socket":
                os.close(fd)
        for s in self.sockets:
            s.close()
        for p in self.paths:
            os.unlink(p)


def door_connect(path: str):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(ANSWER_S)
    sock.connect(path)
    return [sock, 0]                 # the socket, and the regions the gateway accepted on it


def door_fuzz(gw, rnd: random.Random, objs: DoorObjects, ring_fd_holder: list, counts, codes, problems):
    path = gateway_door(gw.port)
    conns = [door_connect(path) for _ in range(3)]
    names = sorted(objs.fds)

    def request(conn, data: bytes, fds: list[int], what: str):
        counts["door_packets"] += 1
        socket.send_fds(conn[0], [data], fds)
        try:
            reply_data, got, flags, _ = socket.recv_fds(conn[0], 1 << 16, 4)
        except socket.timeout:
            counts["door_unanswered"] += 1
            problems.append(f"door: no answer to {what}")
            return None
        for fd in got:
            if not ring_fd_holder:
                ring_fd_holder.append(os.dup(fd))
            os.close(fd)
        if not reply_data:
            problems.append(f"door: the gateway closed the session after {what}")
            return None
        counts["door_answered"] += 1
        reply = msgpack.unpackb(reply_data, raw=False)
        if reply.get("op") == "ERROR":
            codes[reply.get("code")] += 1
            if reply.get("code") == P.INTERNAL:
                counts["door_internal"] += 1
                problems.append(f"door: INTERNAL on {what}: {reply!r:.300}")
        return reply

    def oracle(msg, names, regions) -> set:
        """What the door may answer a REGION. Where the gateway may check the fields or the
        descriptor count first, or call an offset out of bounds a bad message or a bad region,
        either code is clear; everything else has one answer."""
        if len(names) > 1:
            return {P.BAD_MESSAGE}        # more descriptors than a door message carries
        either = {P.BAD_MESSAGE, P.BAD_REGION}
        missing = [f for f in ("offset", "size") if f not in msg]
        values = {"offset": 0, "size": 1, **msg}  # a missing field: refused, or its default
        if any(isinstance(values[f], bool) or not isinstance(values[f], int) for f in ("offset", "size")):
            return {P.BAD_MESSAGE} if names else either
        off, size = values["offset"], values["size"]
        if off < 0 or size <= 0 or off >= 1 << 62 or size >= 1 << 62:
            return either
        if not names:
            return either if missing else {P.BAD_REGION}
        if regions >= 8 or not objs.usable(names[0]) or off + size > objs.size_of(names[0]):
            want = {P.BAD_REGION}
        else:
            want = {"OK"}
        return want | either if missing else want

    for i in range(DOOR_PACKETS):
        if rnd.random() < 0.02:                       # a new connection now and then
            old = conns.pop(rnd.randrange(len(conns)))
            old[0].close()
            conns.append(door_connect(path))
        conn = rnd.choice(conns)
        kind = rnd.randrange(10)
        if kind == 0:
            data = rnd.randbytes(rnd.choice([1, 3, 30, 300]))
            reply = request(conn, data, [], "random bytes")
            if reply is not None and reply.get("code") != P.BAD_MESSAGE and reply.get("code") != P.BAD_VERSION:
                if not (reply.get("code") == P.UNKNOWN_OP):
                    problems.append(f"door: random bytes answered {reply!r:.200}")
            continue
        if kind == 1:
            reply = request(conn, rnd.randbytes(70_000), [], "an oversized packet")
            if reply is not None and reply.get("code") != P.BAD_MESSAGE:
                problems.append(f"door: an oversized packet answered {reply!r:.200}")
            continue
        if kind == 2:
            op = rnd.choice(["SESSION", "session", "HELLO", "GET", "", "REGIONS", "RING"])
            fds = [objs.fds[rnd.choice(names)]] if rnd.random() < 0.5 else []
            reply = request(conn, msgpack.packb({"v": 1, "op": op, "id": i}), fds, f"door op {op!r}")
            # RING: these sessions attach nothing, so no ring is ever handed to them
            want = {"SESSION": "OK", "RING": P.FORBIDDEN}.get(op, P.UNKNOWN_OP) if not fds or \
                op not in ("SESSION", "RING") else P.BAD_MESSAGE
            if reply is not None and (reply.get("code") or reply.get("op")) != want:
                problems.append(f"door: {op!r} with {len(fds)} fd answered {reply!r:.200}, wanted {want}")
            continue
        # REGION
        nfd = rnd.choice([0, 1, 1, 1, 1, 1, 1, 2])
        chosen = [rnd.choice(names) for _ in range(nfd)]
        if nfd == 1 and rnd.random() < 0.3:
            chosen = [rnd.choice(["shm_rw", "memfd", "memfd_small"])]
        fds = [objs.fds[n] for n in chosen]
        use_ring = nfd == 1 and ring_fd_holder and rnd.random() < 0.05
        if use_ring:
            fds, chosen = [ring_fd_holder[0]], ["ring"]
        size = objs.size_of(chosen[0]) if chosen and chosen[0] != "ring" else RING
        msg = {"v": 1, "op": "REGION", "id": i}
        for f in ("offset", "size"):
            r = rnd.random()
            if r < 0.55:
                msg[f] = rnd.randrange(0, size + 1) if f == "offset" else rnd.randrange(1, size + 2)
            elif r < 0.85:
                msg[f] = rnd.choice([0, -1, 1, size, size - 1, size + 1, 2 ** 62, 2 ** 62 + 1, 2 ** 63 - 1,
                                     2 ** 64 - 1, -(2 ** 63)])
            elif r < 0.95:
                msg[f] = rnd.choice(["0", 1.0, True, None, [1], b"\x00", {"a": 1}])
        if "offset" in msg and "size" in msg and rnd.random() < 0.3:
            msg["offset"] = 0
            msg["size"] = size
        reply = request(conn, msgpack.packb(msg, use_bin_type=True), fds, f"REGION {chosen} {msg}")
        if reply is None:
            continue
        want = oracle(msg, chosen, conn[1])
        got = reply.get("code") or reply.get("op")
        if got not in want:
            problems.append(f"door: REGION {chosen} {msg} answered {reply!r:.200}, wanted {want}")
        if got == "OK":
            conn[1] += 1
            counts["door_regions_accepted"] += 1
    for conn in conns:
        conn[0].close()


# ====================================================================== the test
def _foreign_usage(port: int) -> tuple[int, int]:
    """(objects, bytes) the cards hold of ``FOREIGN_NS``, from an operator's STATS."""
    stats = control.request(port, {"op": "STATS"})
    assert stats is not None and stats["op"] == "OK", stats
    tid = namespace_id(FOREIGN_NS).hex()
    rows = [t for t in stats["stats"]["tenants"] if t["id"] == tid]
    return (rows[0]["objects"], rows[0]["used_bytes"]) if rows else (0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: uid 65534 owns the foreign namespace and a door session")
def test_fuzz_control_port_and_door(start_gateway, tmp_path):
    seed = fuzz_seed()
    print(f"\nadpkv fuzz seed {seed} (ADPKV_FUZZ_SEED={seed} repeats this run)")
    t0 = time.monotonic()
    # a door every user may open: uid 65534 stores into a namespace of its own and holds a session
    gw = start_gateway(shared_memory_size=RING, engine_timeout_s=120, control_socket_mode="0666")
    rnd = random.Random(seed)
    fuzz_keys = make_keys(24, namespace="fuzz-keys", salt=seed.to_bytes(8, "big"))
    foreign_keys = make_keys(3, namespace=FOREIGN_NS, salt=seed.to_bytes(8, "big"))
    probe = as_nobody(store_own, gw.port, foreign_keys)
    assert probe == {"hello": "OK", "put": "DONE", "stored": [1, 1, 1]}, probe
    foreign_before = _foreign_usage(gw.port)
    assert foreign_before[0] == 3, foreign_before

    # the engine: attached first, so every other engine id is ENGINE_BUSY
    shm = f"/dev/shm/adpkv-fuzz-engine-{uuid.uuid4().hex[:8]}"
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(gw.port), shm,
                               os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = _read_line(engine, time.monotonic() + 60)
        assert line == "ready", line
        fz = Fuzzer(gw.port, rnd, ForeignDoor(gateway_door(gw.port)), foreign_keys)
        try:
            # ---------------------------------------------------------------- structured
            strategies = field_strategies(fuzz_keys, foreign_keys)

            @hypothesis_seed(seed)
            @settings(max_examples=STRUCTURED_EXAMPLES, database=None, deadline=None, derandomize=False,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(messages(strategies, fuzz_keys, foreign_keys))
            def structured(case):
                fz.send_structured(*case)

            structured()
            t_structured = time.monotonic()
            for name, msg, what in explicit_cases(fuzz_keys):
                msg = {"v": 1, "id": UNIQUE, **msg}
                fz.send_structured(name, msg)
            # ---------------------------------------------------------------- raw bytes
            for _ in range(RAW_FRAMES):
                peer = fz.peers[rnd.choice(["anon", "lookup", "rank", "foreign"])]
                frames, what = raw_frames(rnd, fz.corpus)
                m = peek(frames[0]) if len(frames) == 1 else None
                if m is not None and (m["op"] in ("HELLO", "CLEAN") or (m["op"] in ("GET", "PUT") and "tag" in m)):
                    continue       # roles and the engine's objects stay as they are
                fz.send_frames(peer, frames, what)
                fz.restore(peer)
            t_raw = time.monotonic()
            for peer in fz.peers.values():
                fz.drain(peer)
            # the rank leaves: every collective it still waited for fails, with an answer
            rank = fz.peers["rank"]
            reply = fz.send_msg(rank, {"v": 1, "op": "BYE", "id": next(fz.ids)}, "final BYE")
            assert reply is not None and reply["op"] == "OK", reply
            fz.drain(rank)
            # ---------------------------------------------------------------- the door
            objs = DoorObjects(tmp_path, f"{os.getpid()}-{seed}")
            ring_holder: list[int] = []
            door_problems: list[str] = []
            try:
                door_fuzz(gw, rnd, objs, ring_holder, fz.counts, fz.codes, door_problems)
                # once its sessions are gone the gateway holds none of those descriptors
                deadline = time.monotonic() + 10
                while objs.held_by(gw.proc.pid) and time.monotonic() < deadline:
                    select.select([], [], [], 0.05)
                assert not objs.held_by(gw.proc.pid), objs.held_by(gw.proc.pid)
            finally:
                for fd in ring_holder:
                    os.close(fd)
                objs.close()
            # an empty door packet reads as the end of the connection: that session closes
            s = door_connect(gateway_door(gw.port))[0]
            s.send(b"")
            assert s.recv(100) == b""
            s.close()
            t_door = time.monotonic()

            # ---------------------------------------------------------------- verdicts
            assert gw.alive(), "the gateway died"
            check = Peer(gw.port, "check", fz.ctx)
            assert fz.send_msg(check, {"v": 1, "op": "PING", "id": 1})["op"] == "OK"
            stats = fz.send_msg(check, {"v": 1, "op": "STATS", "id": 2, "session": check.door.token})
            assert stats["op"] == "OK" and stats["stats"]["engine"]["id"] == ENGINE, stats
            check.close()
            foreign_after = _foreign_usage(gw.port)
        finally:
            fz.close()
        engine.stdin.write("stop\n")
        engine.stdin.flush()
        summary = json.loads(_read_line(engine, time.monotonic() + 120))
        assert engine.wait(timeout=30) == 0
        # the engine gone, uid 65534 reads its probe objects back: all there, byte-exact
        probe_back = as_nobody(read_back, gw.port, foreign_keys, 1)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        if os.path.exists(shm):
            os.unlink(shm)
    elapsed = time.monotonic() - t0
    log = gw.log()
    figures = {
        "seed": seed, "seconds": round(elapsed, 1),
        "structured_s": round(t_structured - t0, 1), "raw_s": round(t_raw - t_structured, 1),
        "door_s": round(t_door - t_raw, 1),
        **{k: v for k, v in sorted(fz.counts.items())}, "codes": dict(fz.codes.most_common()),
        "ops": dict(fz.ops_sent.most_common(16)), "engine": summary,
        "log_internal_errors": log.lower().count("internal error"),
        "foreign_objects_bytes": [foreign_before, foreign_after],
    }
    print("FUZZ-FIGURES " + json.dumps(figures))
    problems = fz.problems + door_problems
    assert not problems, "\n".join(problems[:40])
    assert fz.counts["internal"] == 0 and fz.counts["door_internal"] == 0
    assert "internal error" not in log.lower()
    assert fz.counts["unanswered"] == 0 and fz.counts["door_unanswered"] == 0
    assert fz.counts["frames"] >= 0.8 * (STRUCTURED_EXAMPLES + RAW_FRAMES)
    # the engine: every object stored, found and byte-exact, all along
    assert "error" not in summary, summary
    assert summary["rounds"] >= 3, summary
    assert summary["wrong"] == 0 and summary["region_wrong"] == 0, summary
    assert summary["stored"] == summary["hits"] == summary["exist_hits"] == summary["objects"], summary
    assert summary["region_stored"] == summary["region_hits"] == summary["region_objects"], summary
    # the namespace of another user: refused every time, nothing of it changed
    assert fz.codes[P.CARD_ERROR] == 0
    assert fz.counts["foreign_key_forbidden"] >= STRUCTURED_EXAMPLES // 100, fz.counts
    assert foreign_after == foreign_before, (foreign_before, foreign_after)
    assert probe_back == {"hello": "OK", "get": "DONE", "hits": [1, 1, 1], "exact": [True] * 3}, probe_back


def test_deeply_nested_frames_are_bad_messages(gateway):
    """A frame nested a thousand levels deep is a bad message, on the control port and at
    the door (msgspec raises RecursionError there, which is no DecodeError)."""
    ctx = zmq.Context()
    peer = Peer(gateway.port, "deep", ctx)
    door = door_connect(gateway_door(gateway.port))[0]
    try:
        got = {}
        for depth in (10, 100, 1000, 5000, 100_000):
            frame = b"\x83\xa1v\x01\xa2op\xa4PING\xa2id" + b"\x91" * depth + b"\xc0"
            peer.sock.send(frame)
            assert peer.sock.poll(int(ANSWER_S * 1000)), f"no answer at depth {depth}"
            reply = msgpack.unpackb(peer.sock.recv(), raw=False)
            got[("control", depth)] = reply.get("code") or reply["op"]
            door.send(b"\x83\xa1v\x01\xa2op\xa6REGION\xa2id" + b"\x91" * depth + b"\xc0")
            reply = msgpack.unpackb(door.recv(1 << 16), raw=False)
            got[("door", depth)] = reply.get("code") or reply["op"]
        assert gateway.alive()
        # a PING (a REGION without its descriptor) whose id is nested deep: served (refused),
        # or refused as a bad message where the nesting is too deep to read; never INTERNAL
        assert all(code in (("OK", P.BAD_MESSAGE) if where == "control" else (P.BAD_REGION, P.BAD_MESSAGE))
                   for (where, _), code in got.items()), got
        assert "internal error" not in gateway.log().lower()
    finally:
        door.close()
        peer.close()
        ctx.term()
