"""The door: the gateway's Unix-domain socket, where a local process gets a session.

Control messages travel over ZeroMQ (``tcp://127.0.0.1:<port>``), but nothing on
that port is served to a process that has not first come through the door:

- the door is a ``SOCK_SEQPACKET`` socket file, ``adpkv-<port>.sock`` in the door directory of
  the gateway's user (``door_dir``) unless a setting names another path. Its file permissions
  decide who may connect at all; the gateway reads the peer's credentials (``SO_PEERCRED``) on
  every connection;
- ``SESSION`` answers a random session token (carried by HELLO, STATS and CLEAN on
  the control port), and nothing else: no session maps any memory before it is settled
  whose engine it serves;
- ``RING``, once a connection of the session is attached (HELLO) as a rank of an engine
  the session's user owns, answers that engine's ring as an open file descriptor
  (``SCM_RIGHTS``): a sealed memfd of the engine's own (a fresh one for every engine
  that attaches), that no one can shrink or grow, so no engine can make the gateway
  fault on it. There is no ring file to open, replace or link to;
- ``REGION`` hands the gateway an open descriptor of a buffer of the client's own
  (an engine's shared-memory file). The gateway never opens a path on a client's
  behalf: a client reaches through a region only what it could open itself;
- the connection lives as long as the client: when it closes (the client exited or
  the gateway died), the other side knows at once;
- the client trusts the door only once it knows who serves it: right after connect(),
  before sending anything, it reads the gateway's credentials (``SO_PEERCRED``) and goes
  no further unless that uid is one it trusts (root, its own, ``gateway_users``). The
  session's ``proof`` then lets it tell the door's gateway from any other process on the
  control port (``protocol``: HELLO's reply).

One message is one packet: a msgpack map (``adpkv_core.wire.protocol``), descriptors in
its ancillary data.

Where the door is (the default, when neither the gateway's ``control_socket`` nor the client's
``socket`` names a path): in a directory only the gateway's user may create entries in, so no
other local user can take the door's path, or its lock's, before the gateway starts:

- root's gateways: ``/run/adpkv`` (only root may create entries in ``/run``);
- another user's: ``/dev/shm/adpkv-<uid>`` (``/dev/shm`` is sticky: no one else may remove or
  rename that user's directory; containers that share ``/dev/shm`` share the door).

The gateway makes its directory (0755) or refuses to start when what is there is not a directory
of its own user that no one else may write (``door_dir_problem``: a symbolic link, another user's,
group- or world-writable). The path depends on the uid alone, so a client of any user finds it:
it looks in the door directory of each user whose gateway it trusts (``find_door``: its own first,
then ``gateway_users``, root's last), passing over a directory that fails the same check, and takes
the first that holds a socket for the port; the gateway's credentials are checked on connect as
ever.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from typing import Iterable, Optional, Sequence

from adpkv_core.wire import protocol as P
from adpkv_core.memory.regions import SHM_DIR
from adpkv_core.memory.ring import Ring

ROOT_DOOR_DIR = "/run/adpkv"  # root's gateways' doors
USER_DOOR_DIR = os.path.join(SHM_DIR, "adpkv-{uid}")   # another user's
MAX_PACKET = 1 << 16          # a door message is small: a map of a few fields
MAX_FDS = 1                   # descriptors per message


def door_dir(uid: int) -> str:
    """The directory of the doors of the gateways user ``uid`` runs (see the module)."""
    return ROOT_DOOR_DIR if uid == 0 else USER_DOOR_DIR.format(uid=uid)


def door_path(port: int, uid: int) -> str:
    """The door of the gateway that user ``uid`` runs on control port ``port``."""
    return os.path.join(door_dir(uid), f"adpkv-{port}.sock")


def user_name(uid: int) -> str:
    """A uid as messages name it: "uid 1000 (alice)"."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def door_dir_problem(path: str, uid: int) -> str:
    """Why ``path`` may not hold the doors of user ``uid``'s gateways, in one line naming the path
    and its owner; "" when it may: a directory (not a symbolic link) that ``uid`` owns and no
    other user may write. ``OSError`` (``FileNotFoundError``) when ``path`` cannot be looked at."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        what = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        what = "is not a directory"
    elif st.st_uid != uid:
        what = f"is not {user_name(uid)}'s"
    elif mode & (stat.S_IWGRP | stat.S_IWOTH):
        what = "may be written by users other than its owner"
    else:
        return ""
    return f"the door directory {path} (owner {user_name(st.st_uid)}, mode {mode:04o}) {what}"


class DoorNotFound(FileNotFoundError):
    """No door directory of a trusted user holds a door for the port."""


def find_door(port: int, uids: Iterable[int]) -> str:
    """The door a client connects to when no setting names one: of the door directories of
    ``uids`` (the users whose gateway it trusts), looked at in the order its own user's, the
    others' by uid, root's last, the first that passes ``door_dir_problem`` and holds a socket
    for ``port``. ``DoorNotFound`` saying where it looked (and why a directory was passed over)."""
    me = os.geteuid()
    looked = []
    for uid in sorted(set(uids), key=lambda u: (u != me, u == 0, u)):
        where = door_dir(uid)
        try:
            problem = door_dir_problem(where, uid)
        except OSError:
            looked.append(where)
            continue
        if problem:
            looked.append(f"{where} (passed over: {problem})")
            continue
        path = door_path(port, uid)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                return path
        except OSError:
            pass
        looked.append(where)
    raise DoorNotFound(f"no gateway's door for port {port} in {', '.join(looked)}")


def lock_path(door: str) -> str:
    """The lock file beside a door: held by the gateway that owns the door (and the port)."""
    return door + ".lock"


class UntrustedGateway(ConnectionRefusedError):
    """The process serving the door runs as a user this client does not trust."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process on the other side of a connected Unix socket."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def check_gateway(sock: socket.socket, path: str, trusted_uids: frozenset[int]) -> None:
    """Raise ``UntrustedGateway`` unless the door ``sock`` is connected to is served by a
    process of one of ``trusted_uids``."""
    pid, uid, _ = peer_credentials(sock)
    if uid not in trusted_uids:
        raise UntrustedGateway(f"the gateway at {path} runs as uid {uid} (pid {pid}), not a user this client "
                               f"trusts (uids {', '.join(map(str, sorted(trusted_uids)))}; setting "
                               "gateway_users names others); not attaching to it")


def default_trusted_uids() -> frozenset[int]:
    """Root and this process's own user: whose gateway a client trusts unless told more."""
    return frozenset((0, os.geteuid()))


def send(sock: socket.socket, msg: P.Message, fds: Sequence[int] = ()) -> None:
    """Send one message (and descriptors) as one packet."""
    socket.send_fds(sock, [P.encode(msg)], list(fds))


def recv(sock: socket.socket, max_fds: int = MAX_FDS) -> tuple[bytes, list[int]]:
    """One packet and the descriptors that came with it (the receiver decodes it as the
    message it expects; ``max_fds``: how many it takes, MAP's reply carries one per hit).
    ``EOFError`` when the other side closed; ``ProtocolError`` for a packet larger than a
    message or with too many descriptors (those are closed)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_PACKET, max_fds)
    if not data and not fds:
        raise EOFError("the other side closed the door")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_fds(fds)
        raise P.ProtocolError(P.BAD_MESSAGE, "a door message is one packet of at most "
                              f"{MAX_PACKET} bytes with at most {MAX_FDS} descriptor")
    return data, fds


_SESSION_REPLY = P.ReplyDecoder(P.SessionOk)
_RING_REPLY = P.ReplyDecoder(P.RingOk)
_REGION_REPLY = P.ReplyDecoder(P.RegionOk)
_MAP_REPLY = P.ReplyDecoder(P.MapOk)


def close_fds(fds) -> None:
    """Close descriptors received with a message (a refused or unwanted one), quietly."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class DoorSession:
    """A client's session at the gateway's door: its token, its engine's ring, its regions.

    Requests on the door are synchronous and serialised by the caller (one at a time);
    they are rare (once at attach, once per registered region, MAP batches). A reply carries
    no request id: it is the answer to the one request in flight. So a request that fails
    between its send and its reply (a timeout above all: the reply may still come) ends the
    session: the door is shut down at once (the gateway sees the hang-up and detaches what
    the session attached; the client's link turns the cache off) and every later request
    raises ``ConnectionError`` — a late reply is never taken as the answer to a later
    request (MAP's descriptors of other objects under these keys).
    """

    def __init__(self, path: str, timeout_s: float, trusted_uids: Optional[frozenset[int]] = None):
        """Connect, check the gateway's user (``trusted_uids``, default root and ours:
        ``UntrustedGateway`` before anything is sent), and open a session."""
        self.path = path
        self.broken: Optional[str] = None        # why the session ended (see the class)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(path)
            check_gateway(self.sock, path, default_trusted_uids() if trusted_uids is None else trusted_uids)
            reply, fds = self.request(P.SessionRequest(), _SESSION_REPLY)
        except BaseException:
            self.sock.close()
            raise
        close_fds(fds)
        if not isinstance(reply, P.SessionOk):
            self.sock.close()
            raise ConnectionRefusedError(f"the gateway at {path} refused a session: "
                                         f"{getattr(reply, 'code', '')} {getattr(reply, 'msg', '')}")
        self.token: bytes = reply.token
        self.proof: bytes = reply.proof

    def ring(self) -> Ring:
        """The ring of this session's engine, mapped (RING: only after a HELLO of ours as a rank
        was answered). ``ConnectionRefusedError`` when the gateway refuses, ``ValueError`` when
        what it handed is not a sealed ring of the size it announced."""
        reply, fds = self.request(P.RingRequest(), _RING_REPLY)
        if not isinstance(reply, P.RingOk) or len(fds) != 1:
            close_fds(fds)
            raise ConnectionRefusedError(f"the gateway at {self.path} handed no ring: "
                                         f"{getattr(reply, 'code', '')} {getattr(reply, 'msg', '')}")
        return Ring.from_fd(fds[0], reply.size)

    def request(self, msg: P.Message, replies: P.ReplyDecoder, fds: Sequence[int] = (),
                max_fds: int = MAX_FDS, timeout_s: Optional[float] = None) -> tuple[P.Message, list[int]]:
        """Send ``msg`` (with ``fds``); the reply, decoded by ``replies``, and its descriptors,
        within ``timeout_s`` (None: the session's). ``ConnectionError`` once the session has
        ended; any failure between the send and the reply ends it (see the class)."""
        if self.broken is not None:
            raise ConnectionError(f"the door session at {self.path} has ended ({self.broken})")
        try:
            if timeout_s is not None:
                self.sock.settimeout(timeout_s)
            send(self.sock, msg, fds)
            data, got = recv(self.sock, max_fds)
        except BaseException as exc:
            self._end(f"{type(msg).__name__} failed: {exc or type(exc).__name__}")
            raise
        try:
            return replies.decode(data), got
        except P.ProtocolError as exc:
            close_fds(got)
            self._end(f"an undecodable reply to {type(msg).__name__}: {exc}")
            raise

    def _end(self, why: str) -> None:
        """End the session: shut the door down (the gateway sees the hang-up), never reuse it."""
        self.broken = why
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def register_region(self, fd: int, offset: int, size: int, timeout_s: Optional[float] = None) -> P.Message:
        """Hand the gateway ``size`` bytes at ``offset`` of an open file; the reply
        (``RegionOk`` or ``Error``)."""
        reply, fds = self.request(P.RegionRequest(offset=int(offset), size=int(size)), _REGION_REPLY, [fd],
                                  timeout_s=timeout_s)
        close_fds(fds)
        return reply

    def map_objects(self, keys: Sequence[bytes], object_bytes: int, marks: Optional[Sequence[int]] = None,
                    timeout_s: Optional[float] = None) -> tuple[P.Message, list[int]]:
        """MAP (at most ``protocol.MAX_MAP_KEYS`` keys): the reply (``MapOk`` or ``Error``) and
        the read-only descriptors it carried, one per hit in key order (the caller's to close).
        ``ValueError`` (descriptors closed, the session ended) when their count is not the
        reply's hits."""
        msg = P.MapRequest(keys=list(keys), obj=int(object_bytes), marks=list(marks) if marks is not None else None)
        reply, fds = self.request(msg, _MAP_REPLY, max_fds=P.MAX_MAP_KEYS, timeout_s=timeout_s)
        hits = sum(1 for b in reply.hits if b) if isinstance(reply, P.MapOk) else 0
        if len(fds) != hits or (isinstance(reply, P.MapOk) and len(reply.hits) != len(keys)):
            close_fds(fds)
            self._end("a MAP reply that does not match its request")
            raise ValueError(f"the gateway at {self.path} answered MAP with {len(fds)} descriptors for "
                             f"{hits} hits of {len(keys)} keys")
        return reply, fds

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        """Close the door connection (the gateway then forgets the session); a ring it
        handed (``ring``) is the caller's to close."""
        self.sock.close()
