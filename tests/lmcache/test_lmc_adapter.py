"""AdpL2Adapter against a real gateway process, in the style of LMCache's own L2 adapter tests."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lmc_helpers import (bits, fresh_prefix, gateway_stats, load, lookup, make_key, make_obj, same_bytes, store,
                         wait_fd)


def test_three_distinct_event_fds(adapter):
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    assert all(fd >= 0 for fd in fds)


def test_store_lookup_load_byte_exact(adapter):
    p = fresh_prefix()
    keys = [make_key(i, prefix=p) for i in range(8)]
    objs = [make_obj(64 << 10, dtype=torch.bfloat16) for _ in keys]

    tid = adapter.submit_store_task(keys, objs)
    assert wait_fd(adapter.get_store_event_fd())
    done = adapter.pop_completed_store_tasks()
    assert tid in done and done[tid].is_successful()
    assert done[tid].bytes_transferred() == sum(o.get_size() for o in objs)
    assert adapter.pop_completed_store_tasks() == {}          # popped once

    tid = adapter.submit_lookup_and_lock_task(keys, {})
    assert wait_fd(adapter.get_lookup_and_lock_event_fd())
    bm = adapter.query_lookup_and_lock_result(tid)
    assert bm is not None and bm.popcount() == len(keys)
    assert adapter.query_lookup_and_lock_result(tid) is None  # answers once

    dst = [make_obj(64 << 10, dtype=torch.bfloat16, fill=0.0) for _ in keys]
    tid = adapter.submit_load_task(keys, dst)
    assert wait_fd(adapter.get_load_event_fd())
    bm = adapter.query_load_result(tid)
    assert bm is not None and bm.popcount() == len(keys)
    assert adapter.query_load_result(tid) is None
    assert all(same_bytes(a, b) for a, b in zip(objs, dst))
    adapter.submit_unlock(keys)


def test_mixed_hit_miss_bitmaps(adapter):
    p = fresh_prefix()
    keys = [make_key(i, prefix=p) for i in range(10)]
    present = [0, 2, 3, 7, 9]
    objs = {i: make_obj(8192) for i in present}
    assert store(adapter, [keys[i] for i in present], [objs[i] for i in present]).is_successful()

    bm = lookup(adapter, keys)
    assert bits(bm) == [1 if i in present else 0 for i in range(10)]

    dst = [make_obj(8192, fill=0.0) for _ in keys]
    bm = load(adapter, keys, dst)
    assert bits(bm) == [1 if i in present else 0 for i in range(10)]
    for i in range(10):
        if i in present:
            assert same_bytes(objs[i], dst[i])
        else:   # a miss leaves the caller's buffer alone
            assert torch.count_nonzero(dst[i].raw_data) == 0
    adapter.submit_unlock(keys)
    assert adapter.report_status()["pinned_keys"] == 0


def test_duplicate_store_overwrites_and_counts_once(adapter):
    p = fresh_prefix()
    keys = [make_key(i, prefix=p, salt="tenant-dup") for i in range(4)]
    first = [make_obj(4096) for _ in keys]
    assert store(adapter, keys, first).is_successful()
    salt_bytes = adapter.get_usage().bytes_by_cache_salt["tenant-dup"]
    assert salt_bytes == 4 * 4096

    # Keys name content (chunk hashes): a second store of a key is not written again and,
    # like LMCache's fs adapter, reports success with 0 bytes transferred.
    again = [make_obj(4096) for _ in keys]
    r = store(adapter, keys, again)
    assert r.is_successful() and r.bytes_transferred() == 0
    assert adapter.get_usage().bytes_by_cache_salt["tenant-dup"] == salt_bytes   # not double counted

    # half new, half duplicate: bytes count only the new ones
    more = [make_key(10 + i, prefix=p, salt="tenant-dup") for i in range(2)]
    r = store(adapter, keys[:2] + more, [make_obj(4096) for _ in range(4)])
    assert r.is_successful() and r.bytes_transferred() == 2 * 4096

    dst = [make_obj(4096, fill=0.0) for _ in keys]
    assert load(adapter, keys, dst).popcount() == 4
    assert all(same_bytes(a, b) for a, b in zip(first, dst))   # the first write stays, never a mix


def test_duplicate_keys_within_one_task(adapter):
    k = make_key(1, prefix=fresh_prefix())
    a, b = make_obj(4096), make_obj(4096)
    assert store(adapter, [k, k], [a, b]).is_successful()
    dst = make_obj(4096, fill=0.0)
    assert load(adapter, [k], [dst]).popcount() == 1
    assert same_bytes(dst, a) or same_bytes(dst, b)


def test_usage_accounting_and_delete(lmc_gateway, adapter):
    p = fresh_prefix()
    before = adapter.get_usage()
    ka = [make_key(i, prefix=p, salt="alice") for i in range(3)]
    kb = [make_key(i, prefix=p, salt="bob") for i in range(2)]
    kn = [make_key(i, prefix=p) for i in range(5)]
    assert store(adapter, ka, [make_obj(16384) for _ in ka]).is_successful()
    assert store(adapter, kb, [make_obj(32768) for _ in kb]).is_successful()
    assert store(adapter, kn, [make_obj(4096) for _ in kn]).is_successful()
    # the total comes from the gateway's cards, cached by the adapter for usage_refresh_s
    stored = 3 * 16384 + 2 * 32768 + 5 * 4096
    deadline = time.monotonic() + 5
    u = adapter.get_usage()
    while u.total_bytes_used < before.total_bytes_used + stored and time.monotonic() < deadline:
        u = adapter.get_usage()
    assert u.bytes_by_cache_salt["alice"] == 3 * 16384
    assert u.bytes_by_cache_salt["bob"] == 2 * 32768
    assert u.bytes_by_cache_salt[""] >= 5 * 4096
    # the total comes from the gateway's cards (payload plus the card's per-object header)
    assert u.total_bytes_used >= before.total_bytes_used + 3 * 16384 + 2 * 32768 + 5 * 4096
    assert u.total_capacity_bytes > 0
    assert 0.0 <= u.usage_fraction <= 1.0
    stats = gateway_stats(lmc_gateway.port)
    assert sum(c["used_bytes"] for c in stats["cards"]) >= u.total_bytes_used - 1

    adapter.delete(ka)
    u2 = adapter.get_usage()
    assert "alice" not in u2.bytes_by_cache_salt
    assert u2.bytes_by_cache_salt["bob"] == 2 * 32768
    assert bits(lookup(adapter, ka + kb)) == [0, 0, 0, 1, 1]
    adapter.submit_unlock(ka + kb)


def test_cache_salt_isolates_tenants(adapter):
    p = fresh_prefix()
    k_alice = make_key(5, prefix=p, salt="alice")
    k_bob = make_key(5, prefix=p, salt="bob")
    k_none = make_key(5, prefix=p)
    assert store(adapter, [k_alice], [make_obj(4096)]).is_successful()
    assert bits(lookup(adapter, [k_alice, k_bob, k_none])) == [1, 0, 0]
    adapter.submit_unlock([k_alice])


def test_every_key_field_matters(adapter):
    p = fresh_prefix()
    base = make_key(1, prefix=p)
    assert store(adapter, [base], [make_obj(4096)]).is_successful()
    variants = [make_key(1, prefix=p, model="other/model"), make_key(1, prefix=p, kv_rank=1),
                make_key(1, prefix=p, group=1), make_key(1, prefix=p, salt="s"), make_key(2, prefix=p)]
    assert bits(lookup(adapter, [base] + variants)) == [1, 0, 0, 0, 0, 0]
    adapter.submit_unlock([base])


def test_mixed_object_sizes_in_one_task(adapter):
    p = fresh_prefix()
    sizes = [4096, 12288, 4096, 100_000, 1 << 20]
    keys = [make_key(i, prefix=p) for i in range(len(sizes))]
    objs = [make_obj(s, dtype=torch.uint8) for s in sizes]
    r = store(adapter, keys, objs)
    assert r.is_successful() and r.bytes_transferred() == sum(sizes)
    dst = [make_obj(s, dtype=torch.uint8, fill=0) for s in sizes]
    assert load(adapter, keys, dst).popcount() == len(sizes)
    assert all(same_bytes(a, b) for a, b in zip(objs, dst))


def test_size_mismatch_on_load_is_a_miss(adapter):
    k = make_key(1, prefix=fresh_prefix())
    assert store(adapter, [k], [make_obj(8192)]).is_successful()
    dst = make_obj(4096, fill=0.0)
    assert bits(load(adapter, [k], [dst])) == [0]


def test_request_larger_than_the_ring(adapter):
    """96 MiB through a 64 MiB ring: the gateway splits it into batches."""
    p = fresh_prefix()
    keys = [make_key(i, prefix=p) for i in range(48)]
    objs = [make_obj(2 << 20, dtype=torch.uint8, seed=i) for i in range(48)]
    assert store(adapter, keys, objs, timeout=60).is_successful()
    dst = [make_obj(2 << 20, dtype=torch.uint8, fill=0) for _ in keys]
    assert load(adapter, keys, dst, timeout=60).popcount() == 48
    assert all(same_bytes(a, b) for a, b in zip(objs, dst))


def test_empty_tasks(adapter):
    assert store(adapter, [], []).is_successful()
    assert len(lookup(adapter, [])) == 0
    assert len(load(adapter, [], [])) == 0
    adapter.submit_unlock([])
    adapter.delete([])


def test_concurrent_store_and_prefetch_threads(adapter):
    """The store controller and the prefetch controller call from two threads at once."""
    p = fresh_prefix()
    n_tasks, per = 12, 6
    keys = [[make_key(t * 100 + i, prefix=p) for i in range(per)] for t in range(n_tasks)]
    objs = [[make_obj(16384, seed=t * 100 + i) for i in range(per)] for t in range(n_tasks)]
    stored_ok: list = []
    errors: list = []

    def storer():
        try:
            tids = {adapter.submit_store_task(keys[t], objs[t]): t for t in range(n_tasks)}
            got: dict = {}
            deadline = time.monotonic() + 30
            while len(got) < len(tids) and time.monotonic() < deadline:
                wait_fd(adapter.get_store_event_fd(), 0.5)
                got.update(adapter.pop_completed_store_tasks())
            stored_ok.extend(got[t].is_successful() for t in tids)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    def looker():
        try:
            for _ in range(20):
                lookup(adapter, keys[0])
                adapter.submit_unlock(keys[0])
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=storer), threading.Thread(target=looker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert stored_ok == [True] * n_tasks
    flat_k = [k for ks in keys for k in ks]
    flat_o = [o for os_ in objs for o in os_]
    dst = [make_obj(16384, fill=0.0) for _ in flat_k]
    assert load(adapter, flat_k, dst).popcount() == len(flat_k)
    assert all(same_bytes(a, b) for a, b in zip(flat_o, dst))


def test_lookup_pins_until_unlock(lmc_gateway, adapter):
    p = fresh_prefix()
    keys = [make_key(i, prefix=p) for i in range(3)]
    assert store(adapter, keys, [make_obj(4096) for _ in keys]).is_successful()
    pinned0 = gateway_stats(lmc_gateway.port)["pinned"]
    assert lookup(adapter, keys).popcount() == 3
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0 + 3
    assert adapter.report_status()["pinned_keys"] == 3
    adapter.submit_unlock(keys)
    deadline = time.monotonic() + 5
    while gateway_stats(lmc_gateway.port)["pinned"] != pinned0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0
    # unlocking again (or unlocking keys never locked) is harmless
    adapter.submit_unlock(keys + [make_key(99, prefix=p)])
    assert adapter.report_status()["pinned_keys"] == 0


def test_report_status(adapter):
    st = adapter.report_status()
    assert st["is_healthy"] is True
    assert st["attached"] is True
    assert st["type"] == "AdpL2Adapter"
    assert st["engine_id"].startswith("lmcache-")


def test_close_releases_pins_and_fds(lmc_gateway, make_adapter):
    a = make_adapter()
    p = fresh_prefix()
    keys = [make_key(i, prefix=p) for i in range(2)]
    assert store(a, keys, [make_obj(4096) for _ in keys]).is_successful()
    pinned0 = gateway_stats(lmc_gateway.port)["pinned"]
    assert lookup(a, keys).popcount() == 2
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0 + 2       # the lookup pinned both
    assert gateway_stats(lmc_gateway.port)["engine"] is not None
    fds = (a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd())
    import os
    # open eventfds before the close (the numbers may be reused afterwards: checked below by -1)
    assert [os.readlink(f"/proc/self/fd/{fd}") for fd in fds] == ["anon_inode:[eventfd]"] * 3
    a.close()
    a.close()   # idempotent
    deadline = time.monotonic() + 5
    while gateway_stats(lmc_gateway.port)["pinned"] != pinned0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway_stats(lmc_gateway.port)["pinned"] == pinned0
    assert gateway_stats(lmc_gateway.port)["engine"] is None     # BYE sent: the gateway is free again
    # the eventfds are closed (LMCache's notifier answers -1 once closed; the number itself may
    # already name another eventfd, e.g. one of ZeroMQ's, so fstat proves nothing)
    assert (a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()) == (-1, -1, -1)
