"""Talk to a running gateway from tools (the ``adpkv`` CLI, tests): one request, one reply.

A request other than PING needs a session: ``request`` opens one at the gateway's door
(``adpkv_core.wire.door``) for the call, with the caller's own credentials. Requests and
replies are plain maps here (what the CLI prints and tests inspect); the request is
checked against its ``adpkv_core.wire.protocol`` type before it is sent.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import msgspec
import zmq

from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import DoorSession, UntrustedGateway, default_trusted_uids, find_door

_ids = itertools.count(1)


def request(port: int, msg: dict, host: str = "127.0.0.1", timeout_s: float = 3.0,
            door: Optional[str] = None) -> Optional[dict]:
    """Send one control message; the reply, or None if the gateway did not answer in time.
    ``door`` is the gateway's control socket when it is not the default for ``port`` (the door
    of a gateway of our own user, else root's: ``adpkv_core.wire.door.find_door``)."""
    session = None
    msg = dict(msg)
    if msg.get("op") != "PING":
        try:
            session = DoorSession(door or find_door(port, default_trusted_uids()), timeout_s)
        except (OSError, ValueError) as exc:
            if isinstance(exc, UntrustedGateway):
                return {"op": "ERROR", "code": P.FORBIDDEN, "msg": str(exc)}
            if isinstance(exc, PermissionError):
                return {"op": "ERROR", "code": P.FORBIDDEN, "msg": f"no permission to open the gateway's door: {exc}"}
            return None
        msg["session"] = session.token
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        msg.setdefault("id", next(_ids))
        msg.setdefault("v", P.PROTOCOL_VERSION)
        frame = msgspec.msgpack.encode(msg)
        P.decode_request(frame)              # a tool's own mistake fails here, not at the gateway
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close(0)
        if session is not None:
            session.close()


def ready(port: int, host: str = "127.0.0.1", timeout_s: float = 3.0, door: Optional[str] = None) -> bool:
    """Whether an engine can attach now: the door (of a user we trust) hands out a session
    and the control port answers. What ``adpkv status`` and the deploy files' probes mean
    by "up" too (the index of a large card may still be loading)."""
    try:
        session = DoorSession(door or find_door(port, default_trusted_uids()), timeout_s)
    except (OSError, ValueError):
        return False
    try:
        return request(port, {"op": "PING"}, host, timeout_s=timeout_s) is not None
    finally:
        session.close()


def wait_until_up(port: int, timeout_s: float = 15.0, host: str = "127.0.0.1", door: Optional[str] = None) -> bool:
    """Poll until the gateway is ``ready``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready(port, host, timeout_s=0.3, door=door):
            return True
        time.sleep(0.05)
    return False
