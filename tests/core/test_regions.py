"""Registered regions: a rank's own /dev/shm buffer read and written by a real gateway directly."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import uuid

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.regions import shared_file_of
from adpkv_core.ring import ring_path
from adpkv_core.settings import ClientConfig
from adpkv_gateway import control

from .rankproc import make_keys

OBJ = 256 * 1024 + 512          # deliberately not page aligned


@pytest.fixture
def shm_buffer():
    """A /dev/shm file mapped shared in this process, like LMCache's L1 pool (removed at the end)."""
    path = f"/dev/shm/adpkv-test-region-{uuid.uuid4().hex[:8]}"
    size = 8 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
    os.close(fd)
    yield path, mm
    mm.close()
    os.unlink(path)


def _address(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _client(port, name):
    return GatewayClient(ClientConfig(port=port, timeout_s=5.0, busy_wait_s=0), name, 0, 1)


def _stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


def test_finds_the_shm_file_behind_an_address(shm_buffer):
    path, arr = shm_buffer
    base = _address(arr)
    assert shared_file_of(base + 4096 * 3, 4096) == (path, 4096 * 3)
    assert shared_file_of(base, len(arr) + 1) is None               # runs past the mapping
    anon = bytearray(1 << 20)
    assert shared_file_of(_address(anon), len(anon)) is None        # anonymous memory


def test_get_into_and_put_from_a_region_are_byte_exact(gateway, shm_buffer):
    path, arr = shm_buffer
    keys = make_keys(12)
    rng = random.Random(1)
    src_at = [i * OBJ for i in range(12)]
    for at in src_at:
        arr[at:at + OBJ] = rng.randbytes(OBJ)
    expect = [arr[at:at + OBJ] for at in src_at]
    c = _client(gateway.port, "region-writer")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert region == 0
        stored = c.put_from(region, src_at[:10], keys[:10], OBJ).result(10)
        assert list(stored) == [True] * 10
        # read back into other places of the region, with two keys never stored
        dst_at = [4 << 20 | i * OBJ for i in range(12)]
        arr[4 << 20:] = bytes(len(arr) - (4 << 20))
        hits = c.get_into(region, dst_at, keys, OBJ).result(10)
        assert hits == [True] * 10 + [False] * 2
        for i in range(10):
            assert arr[dst_at[i]:dst_at[i] + OBJ] == expect[i], f"object {i} differs"
        s = _stats(gateway.port)
        assert s["counters"]["get_region_requests"] == 1 and s["counters"]["put_region_requests"] == 1
        assert s["regions"] == 1
        # the ring path sees the same objects (same keys, same bytes)
        out = {}

        def copy_out(b):
            for j in range(b.count):
                if b.hits[j]:
                    out[b.first + j] = bytes(c.ring[b.offset + j * b.stride:b.offset + j * b.stride + OBJ])
        assert c.get(keys[:10], OBJ, copy_out).result(10) == [True] * 10
        assert all(out[i] == expect[i] for i in range(10))
    finally:
        c.close()
    assert _stats(gateway.port)["regions"] == 0      # gone with the rank


def test_a_corrupt_object_read_into_a_region_is_a_miss(gateway, shm_buffer, tmp_path):
    path, arr = shm_buffer
    keys = make_keys(3)
    arr[:3 * OBJ] = b"\x07" * (3 * OBJ)
    c = _client(gateway.port, "region-corrupt")
    try:
        region = c.register_region(path, 0, len(arr)).result(5)
        assert list(c.put_from(region, [0, OBJ, 2 * OBJ], keys, OBJ).result(10)) == [True] * 3
        files = sorted(p for p in (tmp_path / "card0").rglob("*") if p.is_file() and p.name != "adpkv-card.json")
        victim = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        hits = c.get_into(region, [4 << 20, (4 << 20) + OBJ, (4 << 20) + 2 * OBJ], keys, OBJ).result(10)
        assert hits.count(False) == 1 and hits.count(True) == 2
    finally:
        c.close()


@pytest.mark.parametrize("bad, code", [
    (lambda p, n: {"path": "/etc/passwd", "offset": 0, "size": 10}, "BAD_REGION"),
    (lambda p, n: {"path": "/dev/shm/../etc/passwd", "offset": 0, "size": 10}, "BAD_REGION"),
    (lambda p, n: {"path": "/dev/shm/adpkv-no-such-file", "offset": 0, "size": 10}, "BAD_REGION"),
    (lambda p, n: {"path": p, "offset": 0, "size": n + 1}, "BAD_REGION"),
    (lambda p, n: {"path": p, "offset": -1, "size": 10}, "BAD_REGION"),
    (lambda p, n: {"path": p, "offset": 0, "size": "10"}, "BAD_MESSAGE"),
], ids=["outside-shm", "dotdot", "missing", "too-long", "negative", "mistyped"])
def test_bad_regions_are_refused_clearly(gateway, shm_buffer, bad, code):
    path, arr = shm_buffer
    c = _client(gateway.port, "region-bad")
    try:
        reply = c._call({"op": "REGION", **bad(path, len(arr))}, lambda r: r, raw_errors=True).result(5)
        assert reply["op"] == "ERROR" and reply["code"] == code, reply
        assert c.enabled                       # a refused request changes nothing
        assert c.register_region(path, 0, len(arr)).result(5) == 0
    finally:
        c.close()


def test_the_ring_and_foreign_ranges_are_refused(gateway, shm_buffer):
    path, arr = shm_buffer
    c = _client(gateway.port, "region-ring")
    try:
        reply = c._call({"op": "REGION", "path": ring_path(gateway.port), "offset": 0, "size": 4096},
                        lambda r: r, raw_errors=True).result(5)
        assert reply["code"] == "BAD_REGION"
        region = c.register_region(path, 0, 1 << 20).result(5)
        keys = make_keys(2)
        for at, reg in (([0, (1 << 20) - OBJ + 1], region), ([0, 0], region + 1)):
            reply = c._call({"op": "GET", "keys": keys, "obj": OBJ, "region": reg, "at": at},
                            lambda r: r, raw_errors=True).result(5)
            assert reply["code"] == "BAD_REGION", reply
        reply = c._call({"op": "PUT", "keys": keys, "obj": OBJ, "region": region, "at": [0]},
                        lambda r: r, raw_errors=True).result(5)
        assert reply["code"] == "BAD_MESSAGE"
        assert _stats(gateway.port)["objects"].get("stored", 0) == 0
    finally:
        c.close()
