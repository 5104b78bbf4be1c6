"""L1 in shared memory: the gateway reads and writes LMCache's L1 buffers directly (no ring copy).

The L1 arena is allocated with LMCache's own allocator in /dev/shm, as `lmcache server --shm-name`
does, and described with LMCache's own ``L1MemoryDesc``.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.memory_management import (MemoryFormat, MemoryObjMetadata, TensorMemoryObj, _allocate_cpu_memory,
                                          _free_cpu_memory)

from lmc_helpers import bits, fresh_prefix, gateway_stats, load, lookup, make_key, make_obj, same_bytes, store

L1_BYTES = 16 << 20
OBJ = 256 << 10


@pytest.fixture
def shm_l1():
    """LMCache's shared-memory L1 pool: the arena tensor and its L1MemoryDesc."""
    name = f"adpkv_test_l1_{uuid.uuid4().hex[:8]}"
    arena = _allocate_cpu_memory(L1_BYTES, shm_name=name).view(-1)
    assert os.path.exists(f"/dev/shm/{name}")
    yield arena, L1MemoryDesc(ptr=arena.data_ptr(), size=L1_BYTES, align_bytes=4096)
    _free_cpu_memory(arena, L1_BYTES, shm_name=name)


def _l1_obj(arena: torch.Tensor, slot: int, seed: int | None = None) -> TensorMemoryObj:
    """A MemoryObj at ``slot`` of the arena (bfloat16, OBJ bytes), random content or zeros."""
    raw_u8 = arena[slot * OBJ:(slot + 1) * OBJ]
    if seed is None:
        raw_u8.zero_()
    else:
        g = torch.Generator().manual_seed(seed)
        raw_u8.copy_(torch.randint(0, 256, (OBJ,), dtype=torch.uint8, generator=g))
    raw = raw_u8.view(torch.bfloat16)
    meta = MemoryObjMetadata(shape=raw.shape, dtype=torch.bfloat16, address=raw.data_ptr(), phy_size=OBJ,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def _counters(port):
    return gateway_stats(port)["counters"]


def test_l1_in_shm_goes_straight_to_the_gateway(lmc_gateway, shm_l1):
    from adpkv_lmcache import AdpL2Adapter

    arena, desc = shm_l1
    before = _counters(lmc_gateway.port)
    a = AdpL2Adapter({"port": lmc_gateway.port, "timeout_s": 5.0}, l1_memory_desc=desc)
    try:
        assert a.report_status()["l1_region"] is not None
        p = fresh_prefix()
        keys = [make_key(i, prefix=p) for i in range(12)]
        src = [_l1_obj(arena, i, seed=i) for i in range(8)]
        outside = [make_obj(OBJ, dtype=torch.bfloat16) for _ in range(2)]     # anonymous memory: the ring
        assert store(a, keys[:10], src + outside).is_successful()
        assert bits(lookup(a, keys)) == [1] * 10 + [0] * 2
        dst = [_l1_obj(arena, 20 + i) for i in range(8)] + [make_obj(OBJ, dtype=torch.bfloat16, fill=0.0)
                                                            for _ in range(4)]
        assert bits(load(a, keys, dst)) == [1] * 10 + [0] * 2
        assert all(same_bytes(x, y) for x, y in zip(src + outside, dst[:10]))
        status = a.report_status()["counters"]
        assert status["region_stored_keys"] == 8 and status["region_loaded_keys"] == 8
        after = _counters(lmc_gateway.port)
        for op in ("put_region_requests", "get_region_requests"):
            assert after.get(op, 0) - before.get(op, 0) == 1, op
        for op in ("put_requests", "get_requests"):   # one into the region, one through the ring
            assert after.get(op, 0) - before.get(op, 0) == 2, op
        a.submit_unlock(keys[:10])
    finally:
        a.close()
    assert gateway_stats(lmc_gateway.port)["regions"] == 0


def test_corrupt_object_loaded_into_l1_is_a_miss(start_gateway, shm_l1, tmp_path):
    from adpkv_lmcache import AdpL2Adapter

    arena, desc = shm_l1
    gw = start_gateway(shared_memory_size=64 << 20)
    a = AdpL2Adapter({"port": gw.port, "timeout_s": 5.0}, l1_memory_desc=desc)
    try:
        p = fresh_prefix()
        keys = [make_key(i, prefix=p) for i in range(4)]
        assert store(a, keys, [_l1_obj(arena, i, seed=100 + i) for i in range(4)]).is_successful()
        card = tmp_path / "card0"
        victim = max((f for f in card.rglob("*") if f.is_file() and f.name != "adpkv-card.json"),
                     key=lambda f: f.stat().st_mtime)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x5A
        victim.write_bytes(bytes(data))
        got = bits(load(a, keys, [_l1_obj(arena, 10 + i) for i in range(4)]))
        assert sum(got) == 3, got
    finally:
        a.close()


@pytest.mark.parametrize("how", ["l1_direct off", "anonymous L1"])
def test_ring_path_when_l1_is_not_shared(lmc_gateway, shm_l1, how):
    from adpkv_lmcache import AdpL2Adapter

    arena, desc = shm_l1
    params = {"port": lmc_gateway.port, "timeout_s": 5.0}
    if how == "l1_direct off":
        params["l1_direct"] = False
    else:
        anon = torch.empty(L1_BYTES, dtype=torch.uint8)
        desc = L1MemoryDesc(ptr=anon.data_ptr(), size=L1_BYTES, align_bytes=4096)
    before = _counters(lmc_gateway.port)
    a = AdpL2Adapter(params, l1_memory_desc=desc)
    try:
        assert a.report_status()["l1_region"] is None
        p = fresh_prefix()
        keys = [make_key(i, prefix=p) for i in range(3)]
        src = [_l1_obj(arena, i, seed=7 + i) for i in range(3)]
        assert store(a, keys, src).is_successful()
        dst = [_l1_obj(arena, 30 + i) for i in range(3)]
        assert bits(load(a, keys, dst)) == [1, 1, 1]
        assert all(same_bytes(x, y) for x, y in zip(src, dst))
        after = _counters(lmc_gateway.port)
        assert after.get("get_region_requests", 0) == before.get("get_region_requests", 0)
        a.submit_unlock(keys)
    finally:
        a.close()


def test_region_registered_again_after_the_gateway_restarts(start_gateway, shm_l1):
    from adpkv_lmcache import AdpL2Adapter

    arena, desc = shm_l1
    gw = start_gateway(shared_memory_size=32 << 20, engine_timeout_s=2)
    a = AdpL2Adapter({"port": gw.port, "timeout_s": 2.0, "reconnect_s": 0.5}, l1_memory_desc=desc)
    try:
        p = fresh_prefix()
        keys = [make_key(i, prefix=p) for i in range(3)]
        src = [_l1_obj(arena, i, seed=200 + i) for i in range(3)]
        assert store(a, keys, src).is_successful()
        gw.stop()
        gw.start()                                   # a new gateway process: regions are gone with the old one
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (a.report_status()["reconnects"] < 1 or
                                               not a.report_status()["attached"]):
            bits(lookup(a, keys, timeout=10))        # traffic makes the client notice the restart
            time.sleep(0.2)
        st = a.report_status()
        assert st["attached"] and st["reconnects"] >= 1 and st["l1_region"] is not None
        dst = [_l1_obj(arena, 40 + i) for i in range(3)]
        assert bits(load(a, keys, dst)) == [1, 1, 1]
        assert all(same_bytes(x, y) for x, y in zip(src, dst))
        assert gateway_stats(gw.port)["counters"].get("get_region_requests", 0) == 1
        a.submit_unlock(keys)
    finally:
        a.close()
