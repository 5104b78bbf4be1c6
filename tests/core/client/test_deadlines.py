"""A data request's deadline runs from the gateway's last progress on it or on the requests sent
before it (adpkv_core/link.py): a restore far longer than ``timeout_s`` in all, whose layers queue
behind each other, completes with every byte; a gateway that stops answering still turns the
cache off within ``timeout_s``."""

from __future__ import annotations

import os
import signal
import time

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig

from ..rankproc import make_keys, pattern
from ..stall import Stall

OBJ = 1 << 20
TIMEOUT_S = 0.5
READ_S = 0.01          # each read system call of the slow card (a few per object)


def _store(client: GatewayClient, keys: list[bytes]) -> None:
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
    res = client.put(keys, OBJ, fill).result(timeout=60)
    assert all(res.stored), "the store did not complete"


def test_restore_queued_behind_slow_reads_is_not_timed_out(start_gateway):
    # a slow card (every object read held READ_S at its system call) read by one thread: 16
    # layers of 4 objects one after another take seconds, and the last
    # layer's first reply comes only once the layers before it are read, far past timeout_s
    # after it was sent, while the gateway keeps moving
    gw = start_gateway(thread_pool_size=1)
    layers = [make_keys(4, layer=i) for i in range(16)]
    client = GatewayClient(ClientConfig(port=gw.port, timeout_s=TIMEOUT_S, busy_wait_s=0), "deadline")
    try:
        for keys in layers:
            _store(client, keys)
        wrong: list[bytes] = []

        def reader(keys):
            def copy(b):
                for j in range(b.count):
                    o = b.offset + j * b.stride
                    if bytes(client.ring[o:o + OBJ]) != pattern(keys[b.first + j], 0, OBJ):
                        wrong.append(keys[b.first + j])
            return copy

        stall = Stall(gw.proc.pid, READ_S, "preadv,preadv2")
        try:
            t0 = time.monotonic()
            futs = [client.get(keys, OBJ, reader(keys)) for keys in layers]
            hits = [f.result(timeout=120).hits for f in futs]
            took = time.monotonic() - t0
        finally:
            stall.stop()
        assert client.enabled, f"the cache turned off during a restore that kept moving ({took:.2f} s)"
        assert all(all(h) for h in hits), [sum(h) for h in hits]
        assert not wrong
        assert took > 3 * TIMEOUT_S, f"the restore took {took:.2f} s: too short to test the deadline"
    finally:
        client.close()


def test_a_gateway_that_stops_answering_turns_the_cache_off(start_gateway):
    gw = start_gateway()
    keys = make_keys(4)
    client = GatewayClient(ClientConfig(port=gw.port, timeout_s=TIMEOUT_S, busy_wait_s=0), "deadline-stop")
    try:
        _store(client, keys)
        os.kill(gw.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            hits = client.get(keys, OBJ, lambda b: None).result(timeout=30).hits
            took = time.monotonic() - t0
        finally:
            os.kill(gw.proc.pid, signal.SIGCONT)
        assert hits == [False] * 4 and not client.enabled
        assert took < TIMEOUT_S + 1.0, took
    finally:
        client.close()
