"""The gateway's side of the door (``adpkv_core.door``): who may come in, and as whom.

- ``claim_door`` runs before anything else at start: it takes the lock beside the
  door (``flock``), so a second gateway on the same port refuses to start instead of
  touching anything the first one owns. A door file left by a dead gateway is
  removed only once the lock is held.
- ``DoorServer`` accepts connections on the loop's thread (its descriptors sit in the
  loop's poller), reads each peer's credentials, and keeps one ``Session`` per
  connection: a token for the control port, the uid that owns what the session
  attaches, whether it is an operator, and the regions it handed over.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import secrets
import socket
import stat
import struct
import time
from typing import Callable, Optional

from adpkv_core import door as D
from adpkv_core import protocol as P
from adpkv_core.ring import Ring, is_ring_fd

logger = logging.getLogger("adpkv.gateway")

MAX_SESSIONS = 4096
MAX_REGIONS_PER_SESSION = 8


class DoorBusy(SystemExit):
    """Another live gateway owns this door (and port)."""


def claim_door(path: str) -> int:
    """Take the lock beside ``path``; the lock's descriptor (held for the gateway's life).
    Raises ``DoorBusy`` when another gateway holds it."""
    lock = D.lock_path(path)
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise SystemExit(f"cannot open the lock {lock}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DoorBusy(f"another gateway is running on this port (it holds {lock}); refusing to start. "
                       "Stop it first, or give this gateway another port") from None
    return fd


class Region:
    """A buffer of a client's own, as the open descriptor it handed over. The gateway never
    maps it: data moves with ``pread``/``pwrite`` on the descriptor, so a client that
    truncates its buffer makes those calls fail (its own objects miss), nothing else."""

    __slots__ = ("fd", "offset", "size")

    def __init__(self, fd: int, offset: int, size: int):
        self.fd = fd
        self.offset = offset
        self.size = size

    def places(self, at: list, nbytes: int) -> list[int]:
        """File offsets of ``nbytes`` at each region offset in ``at``; BAD_REGION outside it."""
        out = []
        for off in at:
            if not isinstance(off, int) or isinstance(off, bool) or off < 0 or off + nbytes > self.size:
                raise P.ProtocolError(P.BAD_REGION, f"offset {off!r} + {nbytes} bytes is outside the region "
                                      f"of {self.size} bytes")
            out.append(self.offset + off)
        return out

    def size_now(self, write_by: Optional[float]) -> Optional[int]:
        """The descriptor's size now, or None when nothing may be written into the region any
        more: the client gave up on the request (``write_by`` passed, on CLOCK_MONOTONIC: its
        engine may reuse the buffer) or the descriptor is gone. Checked before every write
        into a region: a write past the size now would grow the client's file."""
        if write_by is not None and time.monotonic() >= write_by:
            return None
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return None

    def close(self) -> None:
        os.close(self.fd)


class Session:
    """One client connection at the door."""

    __slots__ = ("token", "uid", "gid", "pid", "operator", "conn", "identities", "regions")

    def __init__(self, conn: socket.socket, uid: int, gid: int, pid: int, operator: bool):
        self.token = secrets.token_bytes(16)
        self.conn = conn
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.operator = operator
        self.identities: set[bytes] = set()      # control-port connections attached with this token
        self.regions: list[Region] = []

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions.clear()
        self.conn.close()


def _peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return pid, uid, gid


def _supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


class DoorServer:
    """The listening door and its sessions; runs on the gateway loop's thread.

    ``register(fd)`` / ``unregister(fd)`` put descriptors into the loop's poller;
    ``on_session_closed(session)`` lets the gateway detach what the session attached;
    ``ring_for(session)`` is the ring a session's RING gets (its engine's; raises
    ``ProtocolError`` FORBIDDEN when the session has no attached rank of an engine its user owns).
    """

    def __init__(self, path: str, mode: int, group: str, operator_group: str, ring_for: Callable[[Session], Ring],
                 register: Callable[[int], None], unregister: Callable[[int], None],
                 on_session_closed: Callable[[Session], None]):
        self.path = path
        self._ring_for = ring_for
        self._register = register
        self._unregister = unregister
        self._on_session_closed = on_session_closed
        self.operator_gid = _group_id(operator_group) if operator_group else None
        self.sessions: dict[int, Session] = {}          # by connection descriptor
        self.by_token: dict[bytes, Session] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise SystemExit(f"{path} exists and is not a socket; refusing to remove it")
            os.unlink(path)        # a dead gateway's door: we hold the lock, so it is not live
        old = os.umask(0o177)      # no window in which the door is open to everyone
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        gid = _group_id(group) if group else -1
        os.chown(path, -1, gid)
        os.chmod(path, mode)
        self.listener.listen(64)
        self.listener.setblocking(False)
        register(self.listener.fileno())
        logger.info("Door %s (mode %o%s): local processes get their sessions here", path, mode,
                    f", group {group}" if group else "")

    # ------------------------------------------------------------------ events
    def on_readable(self, fd: int) -> bool:
        """Handle readiness of ``fd``; False if it is not one of the door's."""
        if fd == self.listener.fileno():
            self._accept()
            return True
        session = self.sessions.get(fd)
        if session is None:
            return False
        try:
            frame, fds = D.recv(session.conn)
        except (EOFError, ConnectionError):
            self._close(fd)
            return True
        except BlockingIOError:
            return True
        except P.ProtocolError as exc:
            self._reply(session, P.error(None, exc.code, exc.message))
            return True
        except OSError as exc:
            logger.warning("Door: a receive failed (%s); closing that session", exc)
            self._close(fd)
            return True
        msg = None
        try:
            msg = P.decode_door_request(frame)
            self._handle(session, msg, fds)
        except P.ProtocolError as exc:
            D.close_fds(fds)
            logger.warning("Door: refused a request from pid %d (uid %d): %s", session.pid, session.uid, exc)
            self._reply(session, P.error(msg.id if msg else P.request_id(frame), exc.code, exc.message))
        except Exception as exc:        # a bug must not take the gateway down for everyone
            D.close_fds(fds)
            logger.exception("Door: internal error")
            self._reply(session, P.error(msg.id if msg else None, P.INTERNAL, str(exc)))
        return True

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("Door: accept failed: %s", exc)
                return
            if len(self.sessions) >= MAX_SESSIONS:
                logger.warning("Door: %d sessions open; refusing another", MAX_SESSIONS)
                conn.close()
                continue
            pid, uid, gid = _peer_credentials(conn)
            operator = uid in (0, os.geteuid()) or (self.operator_gid is not None and (
                gid == self.operator_gid or self.operator_gid in _supplementary_groups(pid)))
            conn.setblocking(False)
            session = Session(conn, uid, gid, pid, operator)
            self.sessions[conn.fileno()] = session
            self.by_token[session.token] = session
            self._register(conn.fileno())

    def _close(self, fd: int) -> None:
        session = self.sessions.pop(fd, None)
        if session is None:
            return
        self._unregister(fd)
        self.by_token.pop(session.token, None)
        self._on_session_closed(session)
        session.close()

    def _reply(self, session: Session, msg: P.Message, fds=()) -> None:
        try:
            D.send(session.conn, msg, fds)
        except OSError as exc:
            logger.debug("Door: a reply to pid %d was dropped: %s", session.pid, exc)

    # ------------------------------------------------------------------ requests
    def _handle(self, session: Session, msg: P.DoorRequest, fds: list[int]) -> None:
        if isinstance(msg, (P.SessionRequest, P.RingRequest)) and fds:
            raise P.ProtocolError(P.BAD_MESSAGE, f"{msg.op} takes no descriptor")
        if isinstance(msg, P.SessionRequest):
            self._reply(session, P.SessionOk(id=msg.id, token=session.token))
        elif isinstance(msg, P.RingRequest):
            ring = self._ring_for(session)
            self._reply(session, P.RingOk(id=msg.id, size=ring.size), [ring.fd])
        else:
            region = self._region(session, msg, fds)
            self._reply(session, P.RegionOk(id=msg.id, region=region))

    def _region(self, session: Session, msg: P.RegionRequest, fds: list[int]) -> int:
        """Take the buffer behind ``fds[0]`` as a region of the session; its id. On a refusal
        the caller (``on_readable``) closes the descriptor."""
        if len(fds) != 1:
            raise P.ProtocolError(P.BAD_REGION, "REGION carries exactly one open descriptor of the buffer")
        fd = fds[0]
        offset, size = msg.offset, msg.size
        if len(session.regions) >= MAX_REGIONS_PER_SESSION:
            raise P.ProtocolError(P.BAD_REGION, f"at most {MAX_REGIONS_PER_SESSION} regions per session")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise P.ProtocolError(P.BAD_REGION, "a region must be a regular file (a shared-memory buffer)")
        if is_ring_fd(fd):
            raise P.ProtocolError(P.BAD_REGION, "a ring cannot be a region")
        if not _is_shared_memory(fd):
            raise P.ProtocolError(P.BAD_REGION, f"a region must be a shared-memory buffer: a file directly "
                                  f"in {D.SHM_DIR} or a memfd")
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            raise P.ProtocolError(P.BAD_REGION, "the region's descriptor must be open for reading and writing")
        if offset + size > st.st_size:
            raise P.ProtocolError(P.BAD_REGION, f"[{offset}, {offset + size}) is beyond the end of the "
                                  f"file ({st.st_size} bytes)")
        session.regions.append(Region(fd, offset, size))
        logger.info("pid %d (uid %d) registered region %d (%d bytes); its GET/PUT go straight to it",
                    session.pid, session.uid, len(session.regions) - 1, size)
        return len(session.regions) - 1

    def close(self) -> None:
        for fd in list(self.sessions):
            self._close(fd)
        self._unregister(self.listener.fileno())
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _is_shared_memory(fd: int) -> bool:
    """Whether a descriptor is a file directly in /dev/shm or a memfd (what engines share
    their host KV buffers as); anything else is refused as a region, even one the client
    may write (a region is a buffer, not a way to have the gateway write arbitrary files)."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    if target.endswith(" (deleted)"):
        target = target[:-len(" (deleted)")]
    return target.startswith("/memfd:") or os.path.dirname(target) == D.SHM_DIR


def _group_id(name: str) -> int:
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise SystemExit(f"unknown group {name!r}") from None
