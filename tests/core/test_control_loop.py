"""The control loop only dispatches (issue 12, defect 7): card metadata — EXIST, DELETE,
the usage behind STATS and the status file — runs on the I/O workers, so a card that hangs
stalls the requests that need it, never everybody's control messages."""

from __future__ import annotations

import time

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway import control

from .rankproc import make_keys


def test_a_hanging_card_does_not_stall_the_control_loop(redis_servers, start_gateway, tmp_path):
    server, = redis_servers(1)
    gw = start_gateway(card_dirs=[server.url], storage_backend="resp", status_file=str(tmp_path / "s.prom"))
    keys = make_keys(8)
    client = GatewayClient(ClientConfig(port=gw.port, timeout_s=60.0), "engine")
    assert client.enabled
    assert client.exist(keys).result(10) == [False] * 8
    server.pause()                      # SIGSTOP: every command to the card now hangs
    try:
        stuck_exist = client.exist(keys)
        stuck_delete = client.delete(keys[:2])
        t0 = time.monotonic()
        for _ in range(5):              # the loop answers at once, though the card does not
            assert control.request(gw.port, {"op": "PING"}, timeout_s=2.0)["op"] == "OK"
        other = GatewayClient(ClientConfig(port=gw.port, busy_wait_s=0), "engine", rank=None)
        assert other.enabled            # HELLO is served meanwhile
        other.close()
        assert time.monotonic() - t0 < 2.0, "control messages waited for the hanging card"
        assert not stuck_exist.done() and not stuck_delete.done()
    finally:
        server.resume()
    assert stuck_exist.result(30) == [False] * 8
    assert stuck_delete.result(30) == 0
    assert control.request(gw.port, {"op": "STATS"})["stats"]["cards"][0]["active"]
    client.close()
