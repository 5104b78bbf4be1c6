"""Door flood: 1100 door connections of uid 65534 against a root gateway at RLIMIT_NOFILE 1024.

Prints how many of the flood's connections connected, whether root's engine then attached (and
how fast), and how many lines of the gateway's log are the door's ("Door:"). Run as root, with
PYTHONPATH pointing at the tree to measure (docs/notes-door.md has the figures before/after):

    python benchmarks/door_flood.py [per_user_cap]

``per_user_cap`` sets ``door_connections_per_user`` (omit it on a gateway without that setting).
"""

import multiprocessing as mp
import os
import resource
import socket
import sys
import tempfile
import time

from adpkv_core.client import GatewayClient
from adpkv_core.wire.door import door_path
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops.spawn import GatewayProcess

CONNECTIONS = 1100
NOBODY = 65534


def flood(port: int, q) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    held = []
    end = time.monotonic() + 10
    while len(held) < CONNECTIONS and time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(door_path(port, 0))           # root's gateway's door
            held.append(s)
        except BlockingIOError:          # the backlog is full
            s.close()
            time.sleep(0.001)
    q.put(len(held))
    time.sleep(30)


def main() -> None:
    d = tempfile.mkdtemp(dir="/tmp")
    settings = dict(control_socket_mode="0666", shared_memory_size=16 << 20)
    if len(sys.argv) > 1:
        settings["door_connections_per_user"] = int(sys.argv[1])
    gw = GatewayProcess(os.path.join(d, "card"), log_path=os.path.join(d, "gw.log"), **settings).start()
    resource.prlimit(gw.proc.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=flood, args=(gw.port, q))
    child.start()
    try:
        n = q.get(timeout=60)
        t0 = time.monotonic()
        client = GatewayClient(ClientConfig(port=gw.port, connect_timeout_s=3, busy_wait_s=0), "root-engine")
        print(f"flood connected {n}/{CONNECTIONS}; root attached: {client.enabled} in {time.monotonic() - t0:.2f} s")
        client.close()
        time.sleep(2)
        print("door log lines:", sum(1 for line in gw.log().splitlines() if "Door:" in line))
    finally:
        child.kill()
        gw.stop()


if __name__ == "__main__":
    main()
