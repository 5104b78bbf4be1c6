"""A real client process for the reliability suite (tests/core/gateway/test_reliability.py).

It attaches to a gateway with the public SDK (``GatewayClient``), floods it with PUTs of
objects whose bytes are a function of their key (SHAKE-128 of the key: any wrong byte is
seen), optionally mixes in GETs of keys stored before and checks every byte, and appends
what happened to a log file, one line per event, so that the test (another process) can
follow its progress and, after a kill -9 of the gateway or of this process, knows which
objects were submitted and which the gateway acknowledged as stored::

    READY <t>                       attached (t: time.monotonic(), the same clock in every process)
    S <first> <n>                   PUT of keys first..first+n-1 submitted
    A <first> <flags> <t> <on>      its DONE: flags per key ('1' stored), t, client.enabled (1/0)
    G <idx,idx,...> <hits> <wrong>  a GET of those keys: hits per key, how many hits had wrong bytes
    STALL <first> <n>               the fill of that PUT stopped half-way (--stall-put); we block
    OFF <t>                         client.enabled turned False (first seen at time t)
    END <reason>                    the worker finished

Key ``i`` of prefix ``p`` is ``key_of(p, i)``; its bytes ``payload(key, n)``.

    python tests/core/gateway/reliability_worker.py --port P --log FILE --prefix p [--count N] ...
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import threading
import time

from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig

NAMESPACE = "reliability"
_KB = KeyBuilder(NAMESPACE)


def key_of(prefix: str, i: int) -> bytes:
    return _KB.key(f"{prefix}:{i}".encode(), layer=0)


def payload(key: bytes, nbytes: int) -> bytes:
    """The bytes of the object stored under ``key``: a SHAKE-128 stream of the key."""
    return hashlib.shake_128(b"adpkv-reliability:" + key).digest(nbytes)


class EventLog:
    """Append-only event lines; one write(2) per line on an O_APPEND descriptor, so a line is
    in the file (the kernel's page cache) the moment the call returns, whatever kills us next."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lock = threading.Lock()

    def write(self, *fields) -> None:
        line = (" ".join(str(f) for f in fields) + "\n").encode()
        with self.lock:
            os.write(self.fd, line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--engine", default="reliability-writer")
    ap.add_argument("--prefix", required=True, help="keys this worker PUTs: key_of(prefix, i)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=1 << 30, help="PUT this many keys, then END")
    ap.add_argument("--obj", type=int, default=192 * 1024 + 123, help="object bytes")
    ap.add_argument("--batch", type=int, default=8, help="keys per PUT/GET request")
    ap.add_argument("--inflight", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--timeout-s", type=float, default=None, help="ClientConfig.timeout_s (default: the SDK's)")
    ap.add_argument("--get-prefix", default=None, help="also GET keys of this prefix ...")
    ap.add_argument("--get-count", type=int, default=0, help="... with indices 0..get-count-1 (stored before)")
    ap.add_argument("--get-own", action="store_true", help="also GET this worker's own acknowledged keys")
    ap.add_argument("--stall-put", type=int, default=0, help="stop half-way through the fill of the N-th PUT")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    log = EventLog(args.log)
    rng = random.Random(args.seed)
    cfg = ClientConfig(port=args.port, busy_wait_s=15.0)
    if args.timeout_s is not None:
        cfg.timeout_s = args.timeout_s
    client = GatewayClient(cfg, args.engine, rank=0, world_size=1)
    if not client.enabled:
        log.write("END", "attach-failed")
        return 2
    log.write("READY", f"{time.monotonic():.6f}")

    obj = args.obj
    slots = threading.BoundedSemaphore(args.inflight)
    off_logged = threading.Event()
    acked: list[int] = []              # own keys acknowledged as stored (for --get-own)
    acked_lock = threading.Lock()
    stall = threading.Event()          # never set: a stalled fill blocks until we are killed

    def note_off():
        if not client.enabled and not off_logged.is_set():
            off_logged.set()
            log.write("OFF", f"{time.monotonic():.6f}")

    def put(first: int, n: int, stall_here: bool):
        keys = [key_of(args.prefix, first + j) for j in range(n)]

        def fill(b):
            for j in range(b.count):
                o = b.offset + j * b.stride
                data = payload(keys[b.first + j], obj)
                if stall_here:
                    client.ring[o:o + obj // 2] = data[:obj // 2]
                    log.write("STALL", first, n)
                    stall.wait()          # killed here, mid-transfer, the slot half filled
                client.ring[o:o + obj] = data

        log.write("S", first, n)
        fut = client.put(keys, obj, fill)

        def done(f):
            flags = f.result().stored
            log.write("A", first, "".join("1" if x else "0" for x in flags), f"{time.monotonic():.6f}",
                      int(client.enabled))
            with acked_lock:
                acked.extend(first + j for j, x in enumerate(flags) if x)
            note_off()
            slots.release()

        fut.add_done_callback(done)

    def get(prefix: str, idx: list[int]):
        keys = [key_of(prefix, i) for i in idx]
        wrong = [0]

        def check(b):
            for j in range(b.count):
                if b.hits[j]:
                    o = b.offset + j * b.stride
                    if bytes(client.ring[o:o + obj]) != payload(keys[b.first + j], obj):
                        wrong[0] += 1

        fut = client.get(keys, obj, check)

        def done(f):
            hits = f.result().hits
            log.write("G", prefix + ":" + ",".join(map(str, idx)), "".join("1" if x else "0" for x in hits),
                      wrong[0])
            note_off()
            slots.release()

        fut.add_done_callback(done)

    nxt, puts = args.start, 0
    end = args.start + args.count
    while nxt < end and client.enabled:
        slots.acquire()
        n = min(args.batch, end - nxt)
        puts += 1
        put(nxt, n, stall_here=puts == args.stall_put)
        nxt += n
        sources = []
        if args.get_prefix and args.get_count:
            sources.append((args.get_prefix, args.get_count, None))
        if args.get_own:
            with acked_lock:
                own = list(acked)
            if own:
                sources.append((args.prefix, 0, own))
        for prefix, count, pool in sources:
            slots.acquire()
            if not client.enabled:
                slots.release()
                break
            idx = sorted(rng.sample(pool, min(args.batch, len(pool))) if pool
                         else rng.sample(range(count), min(args.batch, count)))
            get(prefix, idx)
    for _ in range(args.inflight):          # wait for every request in flight
        slots.acquire()
    note_off()
    log.write("END", "done" if client.enabled else "off")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
