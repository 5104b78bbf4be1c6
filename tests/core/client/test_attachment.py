"""adpkv_core.attachment: the one re-attach policy of every adapter, and its ring view.

The policy tests use a fake clock and a stand-in client (the real GatewayClient needs a
gateway and real time; the last test uses both): no sleeps.
"""

from __future__ import annotations

import ctypes
import logging
import time

import pytest

from adpkv_core.attachment import (BACK_ON_MESSAGE, LOOKUPS_BACK_MESSAGE, Attachment, Backoff,
                                   reconnect_setting)
from adpkv_core.ringview import RingView
from adpkv_core.client import TURNED_OFF_MESSAGE, GatewayClient, RingBatch
from adpkv_core.settings import ClientConfig


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeClient:
    """Stands in for GatewayClient: attaches when the fake gateway is up, turns off (with the
    real client's log line) when told the gateway went away."""

    made: list["FakeClient"] = []

    def __init__(self, world, config, engine_id, rank, world_size, layout):
        self.rank, self.layout = rank, layout
        self.enabled = world["up"]
        self._buf = bytearray(4096)
        self.ring = memoryview(self._buf) if self.enabled and rank is not None else None
        self.closed = False
        self.world = world
        FakeClient.made.append(self)

    def lose(self):
        if self.enabled:
            self.enabled = False
            logging.getLogger("adpkv.client").warning("%s (test); the engine goes on without it",
                                                      TURNED_OFF_MESSAGE)

    def close(self):
        self.closed = True
        self.enabled = False


def make(world, clock, **kw):
    FakeClient.made = []
    probes = []

    def probe(cfg, timeout):
        probes.append(clock())
        return world["up"]

    kw.setdefault("reconnect_s", 5.0)
    a = Attachment(ClientConfig(), "eng", 0, 1, {"x": 1}, watch_s=0, clock=clock,
                   client_factory=lambda *args: FakeClient(world, *args), probe=probe, **kw)
    return a, probes


def adpkv_lines(caplog):
    return [r for r in caplog.records if r.name.startswith("adpkv") and r.levelno >= logging.INFO]


def test_backoff_doubles_to_the_cap_and_resets():
    b = Backoff(5.0, 60.0)
    assert not b.armed and not b.due(0)
    b.lost(100.0)
    assert not b.due(104.9) and b.due(105.0)
    waits = []
    now = 105.0
    for _ in range(7):
        b.failed(now)
        waits.append(b.next_at - now)
        now = b.next_at
    assert waits == [10, 20, 40, 60, 60, 60, 60]
    b.reset()
    assert not b.armed
    b.lost(0.0)
    assert b.next_at == 5.0          # a new loss starts from the first wait again
    assert Backoff(90, 60).cap_s == 90   # a first wait above the cap is the cap


def test_one_policy_doubling_cap_and_one_line_each_way(caplog):
    caplog.set_level(logging.DEBUG, logger="adpkv")
    clock, world = Clock(), {"up": True}
    attached = []
    a, probes = make(world, clock, max_backoff_s=40.0, on_attach=lambda s: attached.append(s.number))
    s1 = a.refresh()
    assert s1.enabled and attached == [1] and a.reattaches == 0
    caplog.clear()

    # the gateway dies: the client turns off (its one line); nobody answers for a while
    world["up"] = False
    s1.client.lose()
    t_loss = clock.t
    a.refresh()                          # the loss is seen: first attempt reconnect_s later
    for _ in range(500):                 # 125 s of calls between requests, 0.25 s apart
        clock.t += 0.25
        assert a.refresh() is s1         # never a half-made session, never a different one
    gaps = [round(b - a_, 2) for a_, b in zip([t_loss] + probes, probes)]
    assert gaps == [5.0, 10.0, 20.0, 40.0, 40.0], gaps     # doubling, capped at 40 s
    assert len(FakeClient.made) == 1     # a probe that nobody answers builds no client

    # it comes back: the next due attempt attaches, once
    world["up"] = True
    clock.t = probes[-1] + 40.0
    s2 = a.refresh()
    assert s2 is not s1 and s2.enabled and a.reattaches == 1 and attached == [1, 2]
    assert s1.client.closed
    assert s2.client.layout == {"x": 1}
    for _ in range(10):
        clock.t += 1
        assert a.refresh() is s2

    lines = [r.getMessage() for r in adpkv_lines(caplog)]
    assert sum(TURNED_OFF_MESSAGE in m for m in lines) == 1, lines
    assert sum(BACK_ON_MESSAGE in m for m in lines) == 1, lines
    assert len(lines) == 2, lines        # nothing else at INFO or above: failed attempts are debug

    # a second loss starts from the first wait again
    s2.client.lose()
    world["up"] = False
    a.refresh()
    world["up"] = True
    t = clock.t
    clock.t = t + 4.9
    assert a.refresh() is s2
    clock.t = t + 5.0
    assert a.refresh() is not s2 and a.reattaches == 2
    a.close()
    assert a.session is None and all(c.closed for c in FakeClient.made)


def test_on_refresh_installs_only_when_asked_and_lookup_peer_line(caplog):
    caplog.set_level(logging.INFO, logger="adpkv")
    clock, world = Clock(), {"up": True}
    FakeClient.made = []
    a = Attachment(ClientConfig(), "eng", None, 1, None, watch_s=0, clock=clock, reconnect_s=1.0,
                   install="on_refresh", client_factory=lambda *args: FakeClient(world, *args),
                   probe=lambda cfg, t: world["up"])
    s1 = a.session
    assert s1.enabled and s1.ring is None          # a lookup peer has no ring
    s1.client.lose()
    a.tick()
    clock.t += 1.0
    a.tick()                                       # the attempt: a fresh session waits
    assert a.session is s1 and len(FakeClient.made) == 2
    assert a.refresh() is not s1 and a.enabled     # installed between requests
    assert any(LOOKUPS_BACK_MESSAGE in r.getMessage() for r in caplog.records)
    a.close()


def test_reconnect_zero_never_retries_and_a_stale_fresh_session_is_dropped():
    clock, world = Clock(), {"up": True}
    a, probes = make(world, clock, reconnect_s=0)
    a.session.client.lose()
    for _ in range(100):
        clock.t += 10
        a.refresh()
    assert probes == [] and not a.enabled
    a.close()

    b, probes = make(world, clock, reconnect_s=1.0, install="on_refresh")
    b.session.client.lose()
    b.tick()
    clock.t += 1
    b.tick()
    FakeClient.made[-1].lose()                     # lost again before it was used
    s = b.refresh()
    assert s is not FakeClient.made[-1] and not b.enabled and FakeClient.made[-1].closed
    clock.t += 0.5
    assert b.refresh() is s                        # back-off armed again: first wait from now
    clock.t += 0.5
    assert b.refresh().enabled
    b.close()


def test_reconnect_setting_parses():
    assert reconnect_setting({}) == 5.0
    assert reconnect_setting({"adpkv.reconnect_s": "2.5"}) == 2.5
    assert reconnect_setting({"reconnect_s": 0}) == 0
    for bad in ("soon", -1, True):
        with pytest.raises(ValueError):
            reconnect_setting({"reconnect_s": bad})


def test_ring_view_copies_batches_and_checks_bounds():
    ring = bytearray(8192)
    view = RingView(memoryview(ring))
    src = [(ctypes.c_char * 100)(*([bytes([i + 1])] * 100)) for i in range(3)]
    addrs = [ctypes.addressof(b) for b in src]
    batch = RingBatch(1, 2, 512, 256, 100, 0, 100, None)
    assert view.fill(batch, addrs)
    assert ring[512:612] == b"\x02" * 100 and ring[768:868] == b"\x03" * 100
    dst = [(ctypes.c_char * 100)() for _ in range(3)]
    batch.hits = [True, False]
    view.drain(batch, [ctypes.addressof(b) for b in dst])
    assert dst[1].raw == b"\x02" * 100 and dst[2].raw == b"\x00" * 100   # a miss is not touched
    # segments: object = two pieces from two places
    seg = RingBatch(0, 1, 0, 4096, 30, 0, 30, None)
    view.fill(seg, [[addrs[0], addrs[2]]], segments=([0, 10], [10, 20]))
    assert ring[0:30] == b"\x01" * 10 + b"\x03" * 20
    with pytest.raises(IndexError):
        view.fill(RingBatch(0, 2, 8000, 256, 100, 0, 100, None), addrs)
    with pytest.raises(IndexError):
        view.read(8100, addrs[0], 100)


def test_real_gateway_restart_brings_a_real_client_back(start_gateway, caplog):
    """The real thing: GatewayClient, gateway_answers and a gateway process restarted under it."""
    caplog.set_level(logging.INFO, logger="adpkv")
    gw = start_gateway()
    cfg = ClientConfig(port=gw.port, timeout_s=2.0, heartbeat_s=0.2, connect_timeout_s=1.0)
    a = Attachment(cfg, "eng-real", 0, 1, {"t": 1}, reconnect_s=0.2, watch_s=0.05)
    try:
        s1 = a.session
        assert s1.enabled and s1.ring.size > 0
        key = b"k" * 28
        payload = bytes(range(256)) * 16
        buf = (ctypes.c_char * len(payload)).from_buffer_copy(payload)
        put = s1.client.put([key], len(payload), lambda b: s1.ring.fill(b, [ctypes.addressof(buf)]))
        assert put.result(10).stored == [True]
        gw.restart(hard=True)
        deadline = time.monotonic() + 20
        while a.session is s1 or not a.enabled:
            assert time.monotonic() < deadline, "no re-attach"
            s = a.refresh()
            # a request between polls: the first one after the restart is refused (a miss)
            # and turns the old client off; an idle client would only notice at its next request
            s.client.exist([key]).result(5)
            time.sleep(0.05)   # polling with a deadline
        s2 = a.session
        out = (ctypes.c_char * len(payload))()
        got = s2.client.get([key], len(payload), lambda b: s2.ring.drain(b, [ctypes.addressof(out)]))
        assert list(got.result(10).hits) == [True] and out.raw == payload
        assert isinstance(s2.client, GatewayClient) and s1.client.enabled is False
        msgs = [r.getMessage() for r in caplog.records]
        assert sum(BACK_ON_MESSAGE in m for m in msgs) == 1
    finally:
        a.close()
