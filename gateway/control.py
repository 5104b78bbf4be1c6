"""Talk to a running gateway from tools (the ``adpkv`` CLI, tests): one request, one reply."""

from __future__ import annotations

import itertools
from typing import Optional

import zmq

from adpkv_core import protocol as P

_ids = itertools.count(1)


def request(port: int, msg: dict, host: str = "127.0.0.1", timeout_s: float = 3.0) -> Optional[dict]:
    """Send one control message; the reply, or None if the gateway did not answer in time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        msg = dict(msg)
        msg.setdefault("id", next(_ids))
        sock.send(P.encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return P.decode(sock.recv())
    finally:
        sock.close(0)


def wait_until_up(port: int, timeout_s: float = 15.0, host: str = "127.0.0.1") -> bool:
    """Poll the gateway with PING until it answers."""
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if request(port, {"op": "PING"}, host, timeout_s=0.3) is not None:
            return True
    return False
