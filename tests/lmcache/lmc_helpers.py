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


def _result(query, tid, fd: int, what: str, timeout: float):
    """Poll ``query(tid)`` until it answers, waiting on ``fd`` in between."""
    deadline = time.monotonic() + timeout
    while True:
        bm = query(tid)
        if bm is not None:
            return bm
        assert time.monotonic() < deadline, f"{what} task did not complete"
        wait_fd(fd, 1.0)


def lookup(adapter, keys, timeout: float = 20.0):
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    return _result(adapter.query_lookup_and_lock_result, tid, adapter.get_lookup_and_lock_event_fd(),
                   "lookup", timeout)


def load(adapter, keys, objs, timeout: float = 20.0):
    tid = adapter.submit_load_task(keys, objs)
    return _result(adapter.query_load_result, tid, adapter.get_load_event_fd(), "load", timeout)


def bits(bm) -> list[int]:
    return [1 if bm.test(i) else 0 for i in range(len(bm))]


def gateway_stats(port: int) -> dict:
    from adpkv_gateway.ops.control import request

    reply = request(port, {"op": "STATS"}, timeout_s=5.0)
    assert reply is not None, "gateway did not answer STATS"
    return reply["stats"]


class LMCacheServerProcess:
    """A real ``lmcache server`` (multiprocess mode) with the given L2 adapter specs."""

    def __init__(self, l2_adapters: list[dict], log_path: str, l1_size_gb: float = 0.25,
                 port: int | None = None, http_port: int | None = None, extra: tuple = ()):
        from adpkv_gateway.ops.spawn import free_port

        self.l2_adapters = l2_adapters
        self.log_path = log_path
        self.l1_size_gb = l1_size_gb
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        self.extra = tuple(extra)
        self.proc = None

    @property
    def rpc_url(self) -> str:
        return f"tcp://localhost:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://localhost:{self.http_port}"

    def command(self) -> list[str]:
        import json
        import sys

        lmcache_cli = os.path.join(os.path.dirname(sys.executable), "lmcache")
        cmd = [lmcache_cli, "server", "--port", str(self.port), "--http-port", str(self.http_port),
               "--l1-size-gb", str(self.l1_size_gb), "--no-l1-use-lazy", "--eviction-policy", "LRU",
               *self.extra]
        for spec in self.l2_adapters:
            cmd += ["--l2-adapter", json.dumps(spec)]
        return cmd

    def start(self, timeout_s: float = 120.0) -> "LMCacheServerProcess":
        import subprocess

        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1",
               "PYTHONUNBUFFERED": "1"}
        start_at = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            with open(self.log_path, "rb") as f:
                f.seek(start_at)
                text = f.read().decode("utf-8", "replace")
            if "Application startup complete" in text and "cache server is running" in text:
                return self
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"lmcache server did not come up in {timeout_s} s:\n{self.log()[-4000:]}")

    def stop(self, timeout_s: float = 60.0) -> int:
        import signal

        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except Exception:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""
