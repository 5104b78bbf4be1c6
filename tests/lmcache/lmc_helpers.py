"""Helpers in the style of LMCache's own L2 adapter tests: keys, memory objects, eventfd polling."""

from __future__ import annotations

import os
import select
import time

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

MODEL = "test/model-7b"


def make_key(i: int | bytes, model: str = MODEL, kv_rank: int = 0, group: int = 0, salt: str = "",
             prefix: bytes = b"") -> ObjectKey:
    chunk = i if isinstance(i, bytes) else prefix + i.to_bytes(8, "big")
    return ObjectKey(chunk_hash=chunk, model_name=model, kv_rank=kv_rank, object_group_id=group,
                     cache_salt=salt)


def fresh_prefix() -> bytes:
    """A random chunk-hash prefix: keys of one test never meet keys of another."""
    return os.urandom(8)


def make_obj(nbytes: int = 4096, dtype: torch.dtype = torch.float16, fill: float | None = None,
             seed: int | None = None) -> TensorMemoryObj:
    """A TensorMemoryObj of ``nbytes`` logical bytes; random content unless ``fill`` is given."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = nbytes // elem
    raw = torch.empty(n, dtype=dtype)
    if fill is not None:
        raw.fill_(fill)
    else:
        g = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "big"))
        raw.view(torch.uint8).copy_(torch.randint(0, 256, (n * elem,), dtype=torch.uint8, generator=g))
    meta = MemoryObjMetadata(shape=torch.Size([n]), dtype=dtype, address=raw.data_ptr(), phy_size=n * elem,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def same_bytes(a: TensorMemoryObj, b: TensorMemoryObj) -> bool:
    return torch.equal(a.raw_data.view(torch.uint8)[:a.get_size()], b.raw_data.view(torch.uint8)[:b.get_size()])


def wait_fd(fd: int, timeout: float = 10.0) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if p.poll(timeout * 1000):
        try:
            consume_fd(fd)
        except BlockingIOError:
            pass
        return True
    return False


def store(adapter, keys, objs, timeout: float = 20.0):
    tid = adapter.submit_store_task(keys, objs)
    deadline = time.monotonic() + timeout
    got = {}
    while tid not in got:
        assert time.monotonic() < deadline, "store task did not complete"
        wait_fd(adapter.get_store_event_fd(), 1.0)
        got.update(adapter.pop_completed_store_tasks())
    return got[tid]


def lookup(adapter, keys, timeout: float = 20.0):
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    deadline = time.monotonic() + timeout
    while True:
        bm = adapter.query_lookup_and_lock_result(tid)
        if bm is not None:
            return bm
        assert time.monotonic() < deadline, "lookup task did not complete"
        wait_fd(adapter.get_lookup_and_lock_event_fd(), 1.0)


def load(adapter, keys, objs, timeout: float = 20.0):
    tid = adapter.submit_load_task(keys, objs)
    deadline = time.monotonic() + timeout
    while True:
        bm = adapter.query_load_result(tid)
        if bm is not None:
            return bm
        assert time.monotonic() < deadline, "load task did not complete"
        wait_fd(adapter.get_load_event_fd(), 1.0)


def bits(bm) -> list[int]:
    return [1 if bm.test(i) else 0 for i in range(len(bm))]


def gateway_stats(port: int) -> dict:
    from adpkv_gateway.control import request

    reply = request(port, {"op": "STATS"}, timeout_s=5.0)
    assert reply is not None, "gateway did not answer STATS"
    return reply["stats"]
