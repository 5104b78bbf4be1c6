"""The gateway's side of the door (``adpkv_core.wire.door``): who may come in, and as whom.

- Before it, at start: the door directory (the default door's), the lock beside the door,
  then the door file (``claim``: another user's directory, lock or door is never used).
- ``DoorServer`` accepts connections on the loop's thread (its descriptors sit in the
  loop's poller), reads each peer's credentials, and keeps one ``Session`` per
  connection: a token (and its proof) for the control port, the uid that owns what the
  session attaches, whether it is an operator, and the regions it handed over
  (``regions``: what descriptor may be one; at most ``MAX_REGIONS_PER_SESSION``).
- Room at the door: root, the gateway's user and the attached engine's user are never
  refused for want of room (``privileged``). Every other user holds at most
  ``door_connections_per_user`` connections, and all of them together at most what the
  descriptors allow (``DESCRIPTOR_RESERVE`` below the soft ``RLIMIT_NOFILE``, and
  ``MAX_SESSIONS``). A connection that does not ask for a session, or a session whose
  token is not used on the control port, within ``door_handshake_s`` is closed. Out of
  descriptors (EMFILE, ENFILE), the door accepts on a spare descriptor kept for that,
  lets a privileged peer in by closing another user's connection, closes anyone else's,
  and stops polling its listener for ``ACCEPT_PAUSE_S`` when even that fails (or accept
  fails for a reason that is not the peer's alone). At most ``ACCEPTS_PER_WAKE`` connections
  are accepted per wake-up. Each such episode is logged once when it starts and once, with
  its count, when it ends.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import secrets
import socket
import time
from typing import Callable, Optional

from adpkv_core.wire import door as D
from adpkv_core.wire import protocol as P
from adpkv_core.memory.ring import Ring

from adpkv_gateway.door.claim import bind_door, group_id
from adpkv_gateway.door.regions import Region, take_region

logger = logging.getLogger("adpkv.gateway")

MAX_SESSIONS = 4096            # descriptors (connections, regions) of unprivileged users, in all
MAX_REGIONS_PER_SESSION = 8
DESCRIPTOR_RESERVE = 256       # descriptors kept below the soft limit for the cards, the control port, root
ACCEPT_PAUSE_S = 0.5           # out of descriptors even for the spare: the listener rests this long
ACCEPTS_PER_WAKE = 256        # connections accepted per wake-up of the loop, at most
DEADLINE_SCAN_S = 0.1          # how often the sessions are checked against their handshake deadline
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (door connections and card files
    take descriptors; services often start at 1024); the soft limit now, logged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open", encoding="ascii") as fh:
                target = int(fh.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("Open files: soft limit raised from %d to %d (the hard limit)", soft, target)
            return target
        except (ValueError, OSError) as exc:
            logger.warning("Open files: cannot raise the soft limit %d to %d: %s", soft, target, exc)
            return soft
    logger.info("Open files: limit %d, the hard limit (enough for the door connections this limit "
                "allows; systemd LimitNOFILE= sets it)", soft)
    return soft


class _Episode:
    """A run of refusals of one kind (``name``): logged once when it starts (``start_line``
    with the arguments of its first refusal), once with its count when it ends."""

    __slots__ = ("name", "start_line", "count", "since")

    def __init__(self, name: str, start_line: str):
        self.name = name
        self.start_line = start_line
        self.count = 0
        self.since = 0.0

    def refused(self, *args) -> None:
        if self.count == 0:
            self.since = time.monotonic()
            logger.warning(self.start_line, *args)
        self.count += 1

    def over(self) -> None:
        if self.count:
            logger.warning("Door: %s: over, %d connection(s) refused or closed in %.1f s", self.name, self.count,
                           time.monotonic() - self.since)
            self.count = 0


class Session:
    """One client connection at the door. ``deadline`` (CLOCK_MONOTONIC): when the door closes
    it unless it asked for a session (``answered``) and then used its token on the control
    port; None once it did."""

    __slots__ = ("token", "proof", "uid", "gid", "pid", "operator", "privileged", "conn", "identities", "regions",
                 "deadline", "answered")

    def __init__(self, conn: socket.socket, uid: int, gid: int, pid: int, operator: bool, privileged: bool,
                 deadline: float):
        self.token = secrets.token_bytes(16)
        self.proof = secrets.token_bytes(16)     # answered to HELLO: shows the client we are its door's gateway
        self.conn = conn
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.operator = operator
        self.privileged = privileged             # admitted as root, the gateway's or the engine's user
        self.identities: set[bytes] = set()      # control-port connections attached with this token
        self.regions: list[Region] = []
        self.deadline: Optional[float] = deadline
        self.answered = False                    # SESSION answered

    @property
    def descriptors(self) -> int:
        """What this session holds of the gateway's descriptors."""
        return 1 + len(self.regions)

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions.clear()
        self.conn.close()


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
    ``engine_uid()`` is the attached engine's user (None: none attached). ``tick(now)``
    runs on every pass of the loop: handshake deadlines and the listener's rest.
    ``ring_for(session)`` is the ring a session's RING gets (its engine's; raises
    ``ProtocolError`` FORBIDDEN when the session has no attached rank of an engine its user owns).
    ``map_for(session, request)`` serves a MAP (``gateway/datapath/direct_reads.py``): it checks who may
    (raising ``ProtocolError``) and answers later, through ``answer``, from the loop.
    """

    def __init__(self, path: str, mode: int, group: str, operator_group: str, ring_for: Callable[[Session], Ring],
                 register: Callable[[int], None], unregister: Callable[[int], None],
                 on_session_closed: Callable[[Session], None], engine_uid: Callable[[], Optional[int]],
                 per_user: int, handshake_s: float,
                 map_for: Optional[Callable[[Session, P.MapRequest], None]] = None):
        self.path = path
        self._ring_for = ring_for
        self._map_for = map_for
        self._register = register
        self._unregister = unregister
        self._on_session_closed = on_session_closed
        self._engine_uid = engine_uid
        self.per_user = per_user
        self.handshake_s = handshake_s
        self.operator_gid = group_id(operator_group) if operator_group else None
        self.sessions: dict[int, Session] = {}          # by connection descriptor
        self.by_token: dict[bytes, Session] = {}
        self.by_uid: dict[int, int] = {}                # connections open, by user
        self.others_descriptors = 0                     # held by unprivileged sessions (connections, regions)
        self._spare: Optional[int] = _open_spare()      # given up to accept (and close) when out of descriptors
        self._resting_until: Optional[float] = None     # the listener is out of the poller until then
        self._next_scan = 0.0                           # next check of the handshake deadlines
        self._out_of_descriptors = _Episode("out of descriptors", "Door: out of descriptors (%s): accepting on "
                                            "the spare descriptor, letting root, the gateway's and the engine's "
                                            "users in and closing others' connections")
        self._full = _Episode("full", "Door: users other than root, the gateway's and the engine's hold %d "
                              "descriptors, what this gateway can spare for them (soft open-files limit %d less "
                              "%d, at most %d); refusing their new connections")
        self._accept_failing = _Episode("accept failing", "Door: accept failed (%s); resting the listener")
        self._per_uid: dict[int, _Episode] = {}
        self._late = _Episode("handshake deadline", "Door: closing connections that did not ask for a session "
                              "or use its token within %.1f s (door_handshake_s), e.g. pid %d (%s)")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            bind_door(self.listener, path, mode, group)
        except BaseException:
            self.listener.close()
            if self._spare is not None:
                os.close(self._spare)
            raise
        self.listener.listen(64)
        self.listener.setblocking(False)
        register(self.listener.fileno())
        logger.info("Door %s (mode %o%s): local processes get their sessions here", path, mode,
                    f", group {group}" if group else "")

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

    def tick(self, now: float) -> None:
        """On every pass of the loop: put the listener back into the poller once its rest is
        over; every ``DEADLINE_SCAN_S``, close connections past their handshake deadline."""
        if self._resting_until is not None and now >= self._resting_until:
            self._resting_until = None
            self._register(self.listener.fileno())
        if now < self._next_scan:
            return
        self._next_scan = now + DEADLINE_SCAN_S
        late = [fd for fd, s in self.sessions.items() if s.deadline is not None and now >= s.deadline]
        for fd in late:
            session = self.sessions[fd]
            self._late.refused(self.handshake_s, session.pid, D.user_name(session.uid))
            self._close(fd)
        if not late and not any(s.deadline is not None for s in self.sessions.values()):
            self._late.over()

    def used(self, session: Session) -> None:
        """The session's token came on the control port: its handshake is complete."""
        session.deadline = None

    def privileged(self, uid: int) -> bool:
        """Root, the gateway's user and the attached engine's user: never refused for room."""
        return uid in (0, os.geteuid()) or uid == self._engine_uid()

    def _others_budget(self) -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return MAX_SESSIONS
        return max(0, min(MAX_SESSIONS, soft - DESCRIPTOR_RESERVE))

    def _accept(self) -> None:
        """Accept what waits, at most ``ACCEPTS_PER_WAKE`` (the loop's other work goes on
        while a user connects as fast as it can)."""
        for _ in range(ACCEPTS_PER_WAKE):
            if self._resting_until is not None:
                return
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._accept_without_descriptors(exc)
                elif exc.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):   # not that peer's alone
                    self._accept_failing.refused(exc)
                    self._rest()
                continue
            self._out_of_descriptors.over()
            self._accept_failing.over()
            self._admit(conn)

    def _accept_without_descriptors(self, exc: OSError) -> None:
        """EMFILE and the like: take the waiting connection on the spare descriptor (so it
        does not wake us again and again), keep it only for a privileged peer (making room by
        closing another user's connection), and rest the listener if the spare is gone."""
        self._out_of_descriptors.refused(exc.strerror)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
            try:
                conn, _ = self.listener.accept()
            except OSError:
                conn = None
            if conn is not None:
                if self.privileged(D.peer_credentials(conn)[1]) and self._make_room(3):
                    # freed descriptors: one for the spare, one for its control port, one for
                    # its engine's ring (a memfd made when its first rank asks for it)
                    self._admit(conn)
                else:
                    conn.close()
            self._spare = _open_spare()
        if self._spare is None:
            self._rest()

    def _engine_ring(self, session: Session) -> Ring:
        """``ring_for(session)``; out of descriptors (a new engine's ring is a memfd and its
        mapping), a privileged session's ring is made after closing other users' connections
        to make room; anyone else gets NO_RESOURCES, a clear refusal that changes nothing."""
        try:
            return self._ring_for(session)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            if not (session.privileged and self._make_room(4)):
                raise P.ProtocolError(P.NO_RESOURCES, f"the gateway is out of descriptors for a ring ({exc.strerror}); "
                                      "try again later") from None
        return self._ring_for(session)

    def _make_room(self, n: int) -> bool:
        """Close ``n`` connections of the unprivileged user holding the most (its newest first)."""
        for _ in range(n):
            others = [s for s in self.sessions.values() if not s.privileged]
            if not others:
                return False
            uid = max({s.uid for s in others}, key=lambda u: self.by_uid.get(u, 0))
            victim = max((s for s in others if s.uid == uid), key=lambda s: s.conn.fileno())
            logger.info("Door: closed a connection of pid %d (%s) to let a privileged user in",
                        victim.pid, D.user_name(victim.uid))
            self._close(victim.conn.fileno())
        return True

    def _rest(self) -> None:
        if self._resting_until is None:
            self._unregister(self.listener.fileno())
        self._resting_until = time.monotonic() + ACCEPT_PAUSE_S

    def _admit(self, conn: socket.socket) -> None:
        pid, uid, gid = D.peer_credentials(conn)
        privileged = self.privileged(uid)
        if not privileged:
            held = self.by_uid.get(uid, 0)
            if held >= self.per_user:
                episode = self._per_uid.setdefault(uid, _Episode(
                    f"{D.user_name(uid)} at its cap", "Door: %s holds %d connections (door_connections_per_user); "
                    "refusing its new ones"))
                episode.refused(D.user_name(uid), held)
                conn.close()
                return
            budget = self._others_budget()
            if self.others_descriptors + 1 > budget:
                self._full.refused(self.others_descriptors, resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                                   DESCRIPTOR_RESERVE, MAX_SESSIONS)
                conn.close()
                return
        operator = uid in (0, os.geteuid()) or (self.operator_gid is not None and (
            gid == self.operator_gid or self.operator_gid in _supplementary_groups(pid)))
        conn.setblocking(False)
        session = Session(conn, uid, gid, pid, operator, privileged, time.monotonic() + self.handshake_s)
        self.sessions[conn.fileno()] = session
        self.by_token[session.token] = session
        self.by_uid[uid] = self.by_uid.get(uid, 0) + 1
        if not privileged:
            self.others_descriptors += 1
        self._register(conn.fileno())

    def _close(self, fd: int) -> None:
        session = self.sessions.pop(fd, None)
        if session is None:
            return
        self._unregister(fd)
        self.by_token.pop(session.token, None)
        left = self.by_uid[session.uid] - 1
        if left:
            self.by_uid[session.uid] = left
        else:
            del self.by_uid[session.uid]
        if not session.privileged:
            self.others_descriptors -= session.descriptors
            if self.others_descriptors < self._others_budget():
                self._full.over()
            if session.uid in self._per_uid and left < self.per_user:
                self._per_uid.pop(session.uid).over()
        self._on_session_closed(session)
        session.close()

    def answer(self, session: Session, msg: P.Message, fds=()) -> None:
        """A reply sent later (MAP's): only while ``session`` is still connected (a closed or
        reused connection gets nothing). The caller closes ``fds`` after."""
        if self.sessions.get(session.conn.fileno()) is session:
            self._reply(session, msg, fds)

    def _reply(self, session: Session, msg: P.Message, fds=()) -> None:
        try:
            D.send(session.conn, msg, fds)
        except OSError as exc:
            logger.debug("Door: a reply to pid %d was dropped: %s", session.pid, exc)

    # ------------------------------------------------------------------ requests
    def _handle(self, session: Session, msg: P.DoorRequest, fds: list[int]) -> None:
        if isinstance(msg, (P.SessionRequest, P.RingRequest, P.MapRequest)) and fds:
            raise P.ProtocolError(P.BAD_MESSAGE, f"{msg.op} takes no descriptor")
        if isinstance(msg, P.SessionRequest):
            if not session.answered:
                session.answered = True
                session.deadline = time.monotonic() + self.handshake_s     # now: use the token
            self._reply(session, P.SessionOk(id=msg.id, token=session.token, proof=session.proof))
        elif isinstance(msg, P.RingRequest):
            ring = self._engine_ring(session)
            self._reply(session, P.RingOk(id=msg.id, size=ring.size), [ring.fd])
        elif isinstance(msg, P.MapRequest):
            if self._map_for is None:
                raise P.ProtocolError(P.FORBIDDEN, "this gateway hands no object files")
            self._map_for(session, msg)          # answered later (answer), from the loop
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
        if not session.privileged and self.others_descriptors + 1 > self._others_budget():
            raise P.ProtocolError(P.BAD_REGION, "the gateway has no descriptor to spare for another region of "
                                  "this user now")
        session.regions.append(take_region(fd, offset, size))
        if not session.privileged:
            self.others_descriptors += 1
        logger.info("pid %d (uid %d) registered region %d (%d bytes); its GET/PUT go straight to it",
                    session.pid, session.uid, len(session.regions) - 1, size)
        return len(session.regions) - 1

    def close(self) -> None:
        for fd in list(self.sessions):
            self._close(fd)
        if self._resting_until is None:
            self._unregister(self.listener.fileno())
        self.listener.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _open_spare() -> Optional[int]:
    """A descriptor held in reserve (``/dev/null``); None when there is none to have."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None