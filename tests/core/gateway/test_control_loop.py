"""The control loop only dispatches (issue 12, defect 7): card metadata — EXIST, DELETE,
the usage behind STATS and the status file — runs on the I/O workers, so a card that hangs
stalls the requests that need it, never everybody's control messages. And what the loop
accounts for an I/O-process task at once (statistics, health strikes) comes out as it would
read by read (issue 19 item 3)."""

from __future__ import annotations

import time

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.store.health import CardHealth
from adpkv_gateway.store.object_store import ObjectStore
from adpkv_gateway.store.pins import Pins
from adpkv_gateway.store.card_stats import CardStats

from ..rankproc import make_keys


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


def test_a_task_s_reads_are_counted_as_one_by_one():
    """``CardStats.record_reads`` (a task's reads at once) gives the counters and latency
    buckets that ``record`` read by read gives."""
    seconds = [0.00001, 0.00007, 0.0003, 0.002, 0.04, 0.7, 30.0, 0.00005]
    ok = [True, True, False, True, True, False, True, True]
    nbytes = 4096
    one, many = CardStats(), CardStats()
    for s, good in zip(seconds, ok):
        one.record(False, good, nbytes, s)
    many.record_reads(seconds, nbytes * sum(ok), ok.count(False))
    many.record_reads([], 0, 0)
    for field in ("reads", "bytes_read", "read_errors", "io_count", "io_max_s", "writes"):
        assert getattr(many, field) == getattr(one, field), field
    assert abs(many.io_seconds - one.io_seconds) < 1e-9
    (counts_one, sum_one), (counts_many, sum_many) = one.latency("read"), many.latency("read")
    assert counts_many == counts_one and abs(sum_many - sum_one) < 1e-9


def test_a_task_s_reads_strike_as_one_by_one(tmp_path):
    """``CardHealth.ios`` (a task's reads at once, through ``CardService.observe_many``)
    strikes as ``io`` read by read in their order: late or transport-failed reads in a row
    take the card out of the store's service, one good read after them clears the strikes."""
    cards = []

    def monitor(n):
        card = FsCard(str(tmp_path / f"card{n}"), num_dbs=1)
        card.open()
        cards.append(card)
        health = CardHealth([card], io_timeout_ms=10, io_timeout_strikes=3)
        store = ObjectStore([card], 64, 1, "stripe", 0, False, 1, observer=health, pins=Pins())
        return health, store

    h, store = monitor(0)
    store.service.observe_many(0, [0.001] * 50)
    assert h.strikes[0] == 0 and store.service.in_service(0)
    store.service.observe_many(0, [0.02, 0.02])                   # two late reads: two strikes
    assert h.strikes[0] == 2 and store.service.in_service(0)
    store.service.observe_many(0, [0.001, 0.02])                  # good (cleared), then late
    assert h.strikes[0] == 1 and store.service.in_service(0)
    store.service.observe_many(0, [0.02, 0.001])                  # late (a second strike), then good: cleared
    assert h.strikes[0] == 0 and store.service.in_service(0)
    store.service.observe_many(0, [0.001, 0.001, 0.001, 0.001], failed={1, 2})   # failures not in a row of 3
    assert h.strikes[0] == 0 and store.service.in_service(0)
    store.service.observe_many(0, [0.001, 0.001, 0.001], failed={0, 1, 2})       # three transport failures in a row
    assert not store.service.in_service(0) and h.out_by_io[0]

    h, store = monitor(1)
    store.service.observe_many(0, [0.001, 0.02])
    store.service.observe_many(0, [0.02])
    store.service.observe_many(0, [0.001], failed={0})            # strikes run on across tasks: the third in a row
    assert not store.service.in_service(0)
    h, store = monitor(2)
    store.service.observe_many(0, [])
    assert h.strikes[0] == 0 and store.service.in_service(0)
    for card in cards:
        card.close()
