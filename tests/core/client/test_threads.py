"""adpkv_core.threads: every thread adpkv starts in an engine's process runs the set-ups an
adapter registered (``at_start``) before its work; a set-up that raises is logged and the
thread works on. Checked on a real client's I/O thread (the one that runs the ring batches'
copies) against a real gateway."""

from __future__ import annotations

import threading

from adpkv_core import threads
from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig

from ..rankproc import make_keys, pattern

OBJ = 1 << 16


def test_a_clients_thread_runs_the_set_ups_first_and_works_past_one_that_raises(start_gateway, caplog):
    ran: list[str] = []
    copied_on: list[str] = []

    def record() -> None:
        ran.append(threading.current_thread().name)

    def broken() -> None:
        raise RuntimeError("a set-up that fails")

    threads.at_start(broken)
    threads.at_start(record)
    threads.at_start(record)             # registered once
    gw = start_gateway()
    keys = make_keys(4)
    client = GatewayClient(ClientConfig(port=gw.port), "threads")
    try:
        def fill(b):
            copied_on.append(threading.current_thread().name)
            for j in range(b.count):
                o = b.offset + j * b.stride
                client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
        assert all(client.put(keys, OBJ, fill).result(timeout=30).stored)
        got = bytearray(4 * OBJ)

        def read(b):
            for j in range(b.count):
                o = b.offset + j * b.stride
                got[(b.first + j) * OBJ:(b.first + j + 1) * OBJ] = client.ring[o:o + OBJ]
        assert all(client.get(keys, OBJ, read).result(timeout=30).hits)
        assert bytes(got) == b"".join(pattern(k, 0, OBJ) for k in keys)
    finally:
        client.close()
        threads._SETUPS[:] = [s for s in threads._SETUPS if s not in (broken, record)]
    # the set-up ran on the thread that ran the copies, once, before them
    assert copied_on and set(copied_on) == {ran[0]}, (ran, copied_on)
    assert ran.count(ran[0]) == 1 and ran[0].startswith("adpkv-client")
    assert "a thread set-up failed" in caplog.text
