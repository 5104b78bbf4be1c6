"""Failure rules and persistence: gateway down, gateway restarts, eviction vs. locks, restarts."""

from __future__ import annotations

import time

from adpkv_gateway.ops.spawn import free_port
from lmc_helpers import bits, fresh_prefix, gateway_stats, load, lookup, make_key, make_obj, same_bytes, store


def _adapter(port, **params):
    from adpkv_lmcache import AdpL2Adapter

    params.setdefault("timeout_s", 1.0)
    params.setdefault("connect_timeout_s", 0.5)
    params.setdefault("heartbeat_s", 0.2)
    params.setdefault("reconnect_s", 0.3)
    return AdpL2Adapter({"port": port, **params})


def test_gateway_down_misses_and_fails_without_raising():
    a = _adapter(free_port(), reconnect_s=0)
    try:
        keys = [make_key(i) for i in range(3)]
        t0 = time.monotonic()
        assert bits(lookup(a, keys)) == [0, 0, 0]
        r = store(a, keys, [make_obj(4096) for _ in keys])
        assert not r.is_successful() and r.bytes_transferred() == 0
        assert bits(load(a, keys, [make_obj(4096) for _ in keys])) == [0, 0, 0]
        assert time.monotonic() - t0 < 1.0          # fast misses, no waiting on timeouts
        a.submit_unlock(keys)
        a.delete(keys)
        st = a.report_status()
        assert st["is_healthy"] is False and st["attached"] is False
        u = a.get_usage()
        assert u.total_bytes_used == 0
    finally:
        a.close()


def test_gateway_killed_then_back_reattaches(start_gateway):
    gw = start_gateway(shared_memory_size=32 << 20, engine_timeout_s=2)
    a = _adapter(gw.port)
    try:
        p = fresh_prefix()
        keys = [make_key(i, prefix=p) for i in range(4)]
        objs = [make_obj(8192) for _ in keys]
        assert store(a, keys, objs).is_successful()

        gw.kill()   # a crash: no BYE, no reply ever
        # in flight at the crash or just after: resolves as a miss within timeout_s, never raises
        bm = lookup(a, keys, timeout=10)
        assert bits(bm) == [0, 0, 0, 0]
        deadline = time.monotonic() + 5
        while a.report_status()["attached"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.report_status()["is_healthy"] is False
        assert not store(a, keys, objs).is_successful()

        gw.start()  # same card: the objects are still there
        deadline = time.monotonic() + 15
        while not a.report_status()["attached"] and time.monotonic() < deadline:
            time.sleep(0.1)
        st = a.report_status()
        assert st["attached"] and st["reconnects"] >= 1
        assert bits(lookup(a, keys)) == [1, 1, 1, 1]
        dst = [make_obj(8192, fill=0.0) for _ in keys]
        assert load(a, keys, dst).popcount() == 4
        assert all(same_bytes(x, y) for x, y in zip(objs, dst))
        a.submit_unlock(keys)
    finally:
        a.close()


def test_objects_survive_restart_of_adapter_and_gateway(start_gateway):
    gw = start_gateway(shared_memory_size=32 << 20)
    p = fresh_prefix()
    keys = [make_key(i, prefix=p, salt="t1", group=i % 2) for i in range(16)]
    objs = [make_obj(32768) for _ in keys]
    a = _adapter(gw.port, namespace="persist-test")
    try:
        assert store(a, keys, objs).is_successful()
    finally:
        a.close()
    gw.stop()
    gw.start()
    b = _adapter(gw.port, namespace="persist-test")
    c = None
    try:
        assert lookup(b, keys).popcount() == 16
        dst = [make_obj(32768, fill=0.0) for _ in keys]
        assert load(b, keys, dst).popcount() == 16
        assert all(same_bytes(x, y) for x, y in zip(objs, dst))
        b.submit_unlock(keys)
        b.close()
        # another namespace sees nothing
        c = _adapter(gw.port, namespace="other-deployment")
        assert lookup(c, keys).popcount() == 0
    finally:
        b.close()
        if c is not None:
            c.close()


def test_locked_object_is_not_evicted_until_unlocked(start_gateway):
    """Lookup pins an object; the card evicts around it until LMCache unlocks it."""
    obj_bytes = 64 << 10
    gw = start_gateway(shared_memory_size=32 << 20, capacity_bytes=1 << 20)
    a = _adapter(gw.port, timeout_s=5.0)
    try:
        p = fresh_prefix()
        victim = make_key(0, prefix=p)
        victim_obj = make_obj(obj_bytes)
        assert store(a, [victim], [victim_obj]).is_successful()
        assert bits(lookup(a, [victim])) == [1]            # pinned now

        filler = [make_key(1000 + i, prefix=p) for i in range(48)]   # ~3x the card's capacity
        for i in range(0, len(filler), 8):
            store(a, filler[i:i + 8], [make_obj(obj_bytes) for _ in range(8)])
        assert sum(c["evicted"] for c in gateway_stats(gw.port)["cards"]) > 0
        dst = make_obj(obj_bytes, fill=0.0)
        assert bits(load(a, [victim], [dst])) == [1]       # still there, byte-exact
        assert same_bytes(victim_obj, dst)
        a.submit_unlock([victim])

        for i in range(0, len(filler), 8):                  # unpinned and cold: it goes now
            store(a, [make_key(5000 + i + j, prefix=p) for j in range(8)], [make_obj(obj_bytes) for _ in range(8)])
        assert bits(lookup(a, [victim])) == [0]
    finally:
        a.close()


def test_pins_survive_load_until_explicit_unlock(lmc_gateway, make_adapter):
    """LMCache unlocks explicitly after a load; the load itself must not drop the pin."""
    a = make_adapter()
    p = fresh_prefix()
    k = make_key(1, prefix=p)
    assert store(a, [k], [make_obj(4096)]).is_successful()
    pinned0 = gateway_stats(lmc_gateway.port)["pinned"]
    assert bits(lookup(a, [k])) == [1]
    assert bits(lookup(a, [k])) == [1]          # two requests pinned it
    assert bits(load(a, [k], [make_obj(4096)])) == [1]
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0 + 1
    a.submit_unlock([k])                        # request 1 done
    # a barrier, not a sleep: the client sends its requests in order and the gateway answers an
    # UNLOCK before it reads the next request, so once this lookup (a miss, it pins nothing) is
    # answered, the first UNLOCK has been applied
    assert bits(lookup(a, [make_key(2, prefix=p)])) == [0]
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0 + 1   # request 2 still holds it
    a.submit_unlock([k])
    deadline = time.monotonic() + 5
    while gateway_stats(lmc_gateway.port)["pinned"] != pinned0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0


def test_second_adapter_on_a_busy_gateway_is_refused_cleanly(lmc_gateway, make_adapter):
    """One engine per gateway: a second adapter instance is refused and serves misses."""
    first = make_adapter()
    other = _adapter(lmc_gateway.port, reconnect_s=0, busy_wait_s=0.3)
    try:
        st = other.report_status()
        assert st["is_healthy"] is False
        assert "ENGINE_BUSY" in st.get("attach_error", "")
        assert bits(lookup(other, [make_key(1)])) == [0]
        assert first.report_status()["is_healthy"] is True
    finally:
        other.close()
