"""Engine ranks as separate processes for the gateway tests (real clients, real rings)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import xxhash

from adpkv_core.client import GatewayClient
from adpkv_core.wire.door import door_path
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig

GATEWAY_UID = os.geteuid()     # the tests' gateways run as the test's user (read before any child drops to 65534)


def gateway_door(port: int) -> str:
    """The door of a gateway this test started on ``port`` (its default place)."""
    return door_path(port, GATEWAY_UID)


def get_checked(c: GatewayClient, keys, nbytes: int, marks=None, timeout: float = 60) -> list[bool]:
    """Hits of a ring GET of ``keys`` (rank 0's patterns); fails the test on any hit whose
    bytes are not its key's."""
    wrong = []

    def check(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride
                if bytes(c.ring[o:o + nbytes]) != pattern(keys[b.first + j], 0, nbytes):
                    wrong.append(b.first + j)
    hits = list(c.get(keys, nbytes, check, marks=marks).result(timeout=timeout).hits)
    assert not wrong, f"wrong bytes restored for objects {wrong}"
    return hits


def pattern(key: bytes, rank: int, nbytes: int) -> bytes:
    """Deterministic bytes for (key, rank): what a rank stores and expects back."""
    seed = xxhash.xxh3_128_digest(key + rank.to_bytes(2, "big"))
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += xxhash.xxh3_128_digest(seed + counter.to_bytes(8, "big"))
        counter += 1
    return bytes(out[:nbytes])


def make_keys(n: int, namespace: str = "test", layer: int = 0, salt: bytes = b"") -> list[bytes]:
    return KeyBuilder(namespace).keys([salt + i.to_bytes(8, "big") for i in range(n)], layers=[layer])


def rank_job(port, engine, rank, world, op, keys, slice_bytes, tag, out_q, timeout_s=30.0):
    """PUT or GET ``keys`` as rank ``rank`` of ``world``; report (rank, flags, exact) on ``out_q``."""
    try:
        client = GatewayClient(ClientConfig(port=port, timeout_s=timeout_s, busy_wait_s=0), engine,
                               rank=rank, world_size=world)
        obj = slice_bytes * world
        sl = (rank * slice_bytes, slice_bytes)
        wrong = []

        def fill(b):
            for j in range(b.count):
                o = b.offset + j * b.stride + b.slice_offset
                client.ring[o:o + slice_bytes] = pattern(keys[b.first + j], rank, slice_bytes)

        def check(b):
            for j in range(b.count):
                if b.hits[j]:
                    o = b.offset + j * b.stride + b.slice_offset
                    if bytes(client.ring[o:o + slice_bytes]) != pattern(keys[b.first + j], rank, slice_bytes):
                        wrong.append(b.first + j)

        call = client.put if op == "PUT" else client.get
        flags = call(keys, obj, fill if op == "PUT" else check, tag=tag, slice=sl).result().ok
        out_q.put((rank, flags, not wrong, client.enabled))
        client.close()
    except Exception:
        out_q.put((rank, None, traceback.format_exc(), False))


def run_ranks(port, world, op, keys, slice_bytes, tag="t1", engine="engine-test", timeout=120):
    """Run ``world`` rank processes of one engine; results sorted by rank."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_job, args=(port, engine, r, world, op, keys, slice_bytes,
                                                tag if world > 1 else None, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r in results:
        assert r[1] is not None, r[2]
    return results
