"""Host pools in shared memory (SGLang's ``"allocator": "shm"``): the gateway reads and writes
their pages in place through region GET/PUT (``adpkv_sglang.shm``), against real SGLang host
pools built with SGLang's own ``ShmHostTensorAllocator`` and real gateway processes."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch

from sgl_pools import (LAYOUTS, fill_random, mha_pool, mla_pool, object_files, page_bytes, page_hashes,
                       storage_config)

from adpkv_gateway.ops import control

POOLS = {"mha": mha_pool, "mla": mla_pool}
N = 10


def stats(port):
    return control.request(port, {"op": "STATS"})["stats"]


def cfg_for(gw, kind, layout, **extra):
    return storage_config({"port": gw.port, "model_id": "tiny-llama", "interface_v1": 1, "allocator": "shm",
                           **extra}, mla=kind == "mla", layout=layout)


def page_list(pool, indices):
    return [page_bytes(pool, int(indices[i * pool.page_size])) for i in range(len(indices) // pool.page_size)]


def stored_pages(gw, kind="mha", layout="page_first", n=N, salt="x", backends=None, **extra):
    """A source pool in shared memory and ``n`` of its pages stored through the region path."""
    src = POOLS[kind](layout, allocator="shm")
    fill_random(src, seed=len(salt))
    keys = page_hashes(n, salt=salt)
    idx = src.alloc(n * src.page_size)
    w = backends(cfg_for(gw, kind, layout, **extra), src)
    assert w.batch_set_v1(keys, idx) == [True] * n
    w.close()
    return src, idx, keys, w


def scattered(pool, n):
    pool.alloc(3 * pool.page_size)
    idx = pool.alloc(n * pool.page_size)
    pages = idx.reshape(n, pool.page_size)
    return pages[torch.randperm(n, generator=torch.Generator().manual_seed(n))].reshape(-1)


@pytest.mark.parametrize("kind,layout", [(k, lay) for k in ("mha", "mla") for lay in LAYOUTS] + [("mha", "page_head")])
def test_region_set_and_get_restore_identical_pages(gateway, backends, kind, layout):
    src = POOLS[kind](layout, allocator="shm")
    fill_random(src, seed=3)
    keys = page_hashes(N, salt=f"shm-{kind}-{layout}")
    src_idx = src.alloc(N * src.page_size)
    writer = backends(cfg_for(gateway, kind, layout), src)
    assert writer.batch_set_v1(keys, src_idx) == [True] * N
    assert writer.counters["pages_written_in_place"] == N
    writer.close()
    dst = POOLS[kind](layout, allocator="shm")
    dst_idx = scattered(dst, N)
    reader = backends(cfg_for(gateway, kind, layout), dst)
    assert reader.attached
    assert reader.batch_get_v1(keys, dst_idx) == [True] * N
    assert reader.counters["pages_read_in_place"] == N
    assert page_list(dst, dst_idx) == page_list(src, src_idx)
    c = stats(gateway.port)["counters"]
    assert c["get_region_requests"] == 1 and c["put_region_requests"] == 1


@pytest.mark.parametrize("write_shm", [False, True], ids=["ring-region", "region-ring"])
@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first")])
def test_ring_and_region_paths_read_each_others_pages(gateway, backends, kind, layout, write_shm):
    src = POOLS[kind](layout, allocator="shm" if write_shm else "default")
    fill_random(src, seed=11)
    keys = page_hashes(N, salt=f"cross-{kind}-{layout}-{write_shm}")
    src_idx = src.alloc(N * src.page_size)
    w = backends(cfg_for(gateway, kind, layout), src)
    assert w.batch_set_v1(keys, src_idx) == [True] * N
    assert w.counters["pages_written_in_place"] == (N if write_shm else 0)
    w.close()
    dst = POOLS[kind](layout, allocator="default" if write_shm else "shm")
    dst_idx = scattered(dst, N)
    r = backends(cfg_for(gateway, kind, layout), dst)
    assert r.attached
    assert r.batch_get_v1(keys, dst_idx) == [True] * N
    assert r.counters["pages_read_in_place"] == (0 if write_shm else N)
    assert page_list(dst, dst_idx) == page_list(src, src_idx)


# ---------------------------------------------------------------------------- v2: hybrid pools
from test_sgl_v2 import MODELS, attach, backup, controller, make_pools, pages_of, prefetch, tokens_for  # noqa: E402


def v2_cfg(gw, model, shm):
    return storage_config({"port": gw.port, "model_id": f"tiny-{model}", "interface_v1": 1,
                           **({"allocator": "shm"} if shm else {})}, mla=MODELS[model]["mla"])


@pytest.mark.parametrize("write_shm,read_shm", [(True, True), (False, True), (True, False)],
                         ids=["region-region", "ring-region", "region-ring"])
@pytest.mark.parametrize("model", list(MODELS))
def test_hybrid_groups_in_shared_memory_restore_byte_exact_either_path(gateway, backends, model,
                                                                       write_shm, read_shm):
    src = make_pools(model, "page_first", seed=5, allocator="shm" if write_shm else "default")
    w, group = attach(backends, v2_cfg(gateway, model, write_shm), src)
    n = 12
    tokens = tokens_for(n, src["kv"].page_size, salt=3)
    stored = backup(controller(w, group), src, tokens)
    assert (w.counters["pages_written_in_place"] > 0) == write_shm
    w.close()

    dst = make_pools(model, "page_first", seed=6, allocator="shm" if read_shm else "default")
    r, group = attach(backends, v2_cfg(gateway, model, read_shm), dst)
    got = prefetch(controller(r, group), dst, tokens)
    assert got.hit_pages == n and got.completed_pages == n
    assert (r.counters["pages_read_in_place"] > 0) == read_shm
    assert pages_of(dst["kv"], got.kv_idx) == pages_of(src["kv"], stored.kv_idx)
    for name in MODELS[model]["aux"]:
        if name in ("mamba", "swa"):
            assert pages_of(dst[name], got.aux_idx[name]) == pages_of(src[name], stored.aux_idx[name]), name
        else:
            assert pages_of(dst[name], got.kv_idx) == pages_of(src[name], stored.kv_idx), name


# ---------------------------------------------------------------------------- failures never land
def _pages(pool):
    return [page_bytes(pool, p * pool.page_size) for p in range(pool.size // pool.page_size)]


@pytest.mark.parametrize("kind,damage", [("mha", "corrupt"), ("mha", "truncate"), ("mha", "missing"),
                                         ("mla", "corrupt")])
def test_damaged_object_misses_and_leaves_its_pool_page_untouched(gateway, backends, kind, damage):
    # the page cache holds the damaged file (just written): the copy would stream it straight out
    src, src_idx, keys, w = stored_pages(gateway, kind, salt=f"damage-{kind}-{damage}", backends=backends)
    bad = 3
    files = object_files(gateway.card_dirs[0], w.kv.storage_keys([keys[bad]])[0])
    assert files, "the page's object file"
    for f in files:
        size = os.path.getsize(f)
        if damage == "missing":
            os.unlink(f)
        elif damage == "truncate":
            os.truncate(f, size - 100)
        else:                                   # a flipped run of bytes in the V half of the page
            with open(f, "r+b") as fh:
                fh.seek(size - 60)
                fh.write(b"\xa5" * 8)
    dst = POOLS[kind]("page_first", allocator="shm")
    fill_random(dst, seed=99)                   # bytes that must stay where nothing was loaded
    before = _pages(dst)
    dst_idx = scattered(dst, N)
    r = backends(cfg_for(gateway, kind, "page_first"), dst)
    assert r.attached
    hits = r.batch_get_v1(keys, dst_idx)
    assert hits == [i != bad for i in range(N)]
    got, want = page_list(dst, dst_idx), page_list(src, src_idx)
    P = dst.page_size
    for i in range(N):
        if i == bad:
            page = int(dst_idx[i * P]) // P
            assert got[i] == before[page], "a damaged object wrote into its pool page"
        else:
            assert got[i] == want[i]


def _get_latency_count(port) -> int:
    lat = stats(port).get("request_latency", {}).get("get", {})
    return int(lat.get("count", 0)) if isinstance(lat, dict) else 0


def test_gateway_stalled_past_write_by_writes_nothing_into_the_pool(start_gateway, backends):
    gw = start_gateway()
    src, src_idx, keys, _ = stored_pages(gw, salt="stall", backends=backends)
    dst = mha_pool("page_first", allocator="shm")
    fill_random(dst, seed=98)
    before = dst.kv_buffer.clone()
    dst_idx = scattered(dst, N)
    r = backends(cfg_for(gw, "mha", "page_first", timeout_s=1.5, reconnect_s=0.2), dst)
    assert r.attached
    gw.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        hits = r.batch_get_v1(keys, dst_idx)
        assert time.monotonic() - t0 < 15, "a stalled gateway held the engine"
        assert hits == [False] * N
    finally:
        gw.proc.send_signal(signal.SIGCONT)
    # the gateway goes on with the request it had taken: wait until it has (its STATS say so)
    deadline = time.monotonic() + 30
    while True:
        try:
            c = stats(gw.port)["counters"]
            if c.get("get_region_requests", 0) >= 1 and stats(gw.port)["objects"].get("hits", 0) + \
                    stats(gw.port)["objects"].get("misses", 0) >= N:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the gateway did not take the request after SIGCONT"
        time.sleep(0.05)                     # polling with a deadline
    ok = threading.Event()
    ok.wait(0.5)                             # its copies (if any) run on the gateway's pool right after the lookup
    assert torch.equal(dst.kv_buffer.view(torch.int16), before.view(torch.int16)), \
        "the gateway wrote into the pool after the client gave up"


@pytest.mark.parametrize("stopped_first", [False, True], ids=["running", "stopped"])
def test_gateway_killed_mid_get_never_reports_a_wrong_page(start_gateway, backends, stopped_first):
    """kill -9 of the gateway while a get is in flight: running (it may be anywhere in the
    request), or stopped first (SIGSTOP: the request is surely in flight and nothing was copied)."""
    gw = start_gateway()
    n = 20
    src = mha_pool("page_first", pages=48, allocator="shm")
    fill_random(src, seed=7)
    keys = page_hashes(n, salt="kill")
    src_idx = src.alloc(n * src.page_size)
    w = backends(cfg_for(gw, "mha", "page_first"), src)
    assert w.batch_set_v1(keys, src_idx) == [True] * n
    w.close()                                    # one engine a gateway: the reader attaches after
    dst = mha_pool("page_first", pages=48, allocator="shm")
    dst_idx = dst.alloc(n * dst.page_size)
    r = backends(cfg_for(gw, "mha", "page_first", timeout_s=2, reconnect_s=0.2), dst)
    assert r.attached
    before = dst.kv_buffer.clone()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("hits", r.batch_get_v1(keys, dst_idx)))
    if stopped_first:
        gw.proc.send_signal(signal.SIGSTOP)
    t.start()
    if stopped_first:
        t.join(0.5)                               # the request reaches the stopped gateway's socket
        assert t.is_alive(), "a get answered by a stopped gateway"
    gw.kill()
    t.join(30)
    assert not t.is_alive(), "the get did not come back after the gateway died"
    if stopped_first:
        assert out["hits"] == [False] * n
        assert torch.equal(dst.kv_buffer.view(torch.int16), before.view(torch.int16))
    got, want = page_list(dst, dst_idx), page_list(src, src_idx)
    for i, h in enumerate(out["hits"]):
        if h:
            assert got[i] == want[i], f"page {i} reported loaded with wrong bytes"


# ---------------------------------------------------------------------------- attach, re-attach, fallback
def test_regions_registered_again_after_the_gateway_restarts(start_gateway, backends):
    gw = start_gateway(engine_timeout_s=1)
    src, src_idx, keys, _ = stored_pages(gw, salt="reattach", backends=backends)
    dst = mha_pool("page_first", allocator="shm")
    dst_idx = scattered(dst, N)
    r = backends(cfg_for(gw, "mha", "page_first", timeout_s=1.5, reconnect_s=0.2, connect_timeout_s=1.0), dst)
    assert r.attached
    gw.restart(hard=True)
    deadline = time.monotonic() + 20
    while r.batch_exists(keys) != N:
        assert time.monotonic() < deadline, "the backend did not re-attach"
        time.sleep(0.1)                       # polling with a deadline
    assert r.batch_get_v1(keys, dst_idx) == [True] * N
    assert r.counters["pages_read_in_place"] == N, "the new session moves pages in place again"
    assert page_list(dst, dst_idx) == page_list(src, src_idx)
    assert stats(gw.port)["counters"]["get_region_requests"] == 1


def test_pool_not_in_shared_memory_uses_the_ring_and_says_so_once(gateway, backends, caplog):
    src = mha_pool("page_first")                 # the default allocator: private memory
    fill_random(src, seed=4)
    keys = page_hashes(N, salt="private")
    idx = src.alloc(N * src.page_size)
    with caplog.at_level(logging.INFO, logger="adpkv.sglang"):
        b = backends(cfg_for(gateway, "mha", "page_first"), src)
        assert b.batch_set_v1(keys, idx) == [True] * N
        dst_idx = scattered(src, N)
        assert b.batch_get_v1(keys, dst_idx) == [True] * N
        assert b.batch_get_v1(keys, dst_idx) == [True] * N
    assert page_list(src, dst_idx) == page_list(src, idx)
    assert b.counters["pages_read_in_place"] == 0 and b.counters["pages_written_in_place"] == 0
    said = [r for r in caplog.records if "not in shared memory" in r.getMessage()]
    assert len(said) == 1
    assert stats(gateway.port)["counters"].get("get_region_requests", 0) == 0


# ---------------------------------------------------------------------------- the gateway checks every piece
def test_scattered_requests_outside_a_region_are_refused_and_change_nothing(gateway):
    from adpkv_core.client import ClientConfig, GatewayClient

    fd = os.memfd_create("adpkv_test_region", os.MFD_CLOEXEC)
    os.ftruncate(fd, 8192)
    os.pwrite(fd, b"\x11" * 8192, 0)
    c = GatewayClient(ClientConfig(port=gateway.port, timeout_s=5.0, busy_wait_s=0), "scatter-test", 0, 1)
    try:
        rid = c.register_region(f"/proc/self/fd/{fd}", 0, 8192).result()
        assert rid is not None
        keys = [bytes([i + 1]) * 28 for i in range(2)]
        pieces = [(rid, 1000), (rid, 24)]
        assert list(c.put_scattered(pieces, [0, 4096, 1024, 5000], keys).result().stored) == [True, True]
        # a piece past the region's end, a piece in a region never registered: refused, nothing moves
        assert c.get_scattered(pieces, [0, 8180, 1024, 5000], keys).result().hits == [False, False]
        assert c.get_scattered([(rid, 1000), (rid + 5, 24)], [0, 0, 0, 0], keys).result().hits == [False, False]
        assert os.pread(fd, 8192, 0) == b"\x11" * 8192
        os.pwrite(fd, b"\x00" * 8192, 0)
        assert c.get_scattered(pieces, [2000, 7000, 3000, 7100], keys).result().hits == [True, True]
        want = bytearray(8192)
        for off, length in ((2000, 1000), (7000, 24), (3000, 1000), (7100, 24)):
            want[off:off + length] = b"\x11" * length
        assert os.pread(fd, 8192, 0) == bytes(want)
    finally:
        c.close()
        os.close(fd)


def test_scattered_requests_are_checked_where_they_are_decoded():
    """Pieces that do not add up to the object, offsets that are not one a piece of every key,
    a region or tag beside pieces: refused by ``decode_request`` (BAD_MESSAGE), before any work."""
    from adpkv_core.wire import protocol as P

    keys = [b"\x01" * 28, b"\x02" * 28]
    good = dict(id=1, keys=keys, obj=10, pieces=[P.Piece(0, 4), P.Piece(1, 6)], at=[0, 16, 32, 48])
    assert isinstance(P.decode_request(P.encode(P.Get(**good))), P.Get)
    assert isinstance(P.decode_request(P.encode(P.Put(**good))), P.Put)
    for bad in (dict(obj=11), dict(at=[0, 16, 32]), dict(region=0), dict(tag="t"),
                dict(pieces=[P.Piece(0, 10)] * (P.MAX_PIECES + 1), obj=10 * (P.MAX_PIECES + 1))):
        fields = {**good, **bad}
        frame = P._encoder.encode({"v": P.PROTOCOL_VERSION, "op": "GET", **{
            k: ([[p.region, p.length] for p in v] if k == "pieces" else v) for k, v in fields.items()}})
        with pytest.raises(P.ProtocolError) as exc:
            P.decode_request(frame)
        assert exc.value.code == P.BAD_MESSAGE, bad
    zero = P._encoder.encode({"v": P.PROTOCOL_VERSION, "op": "GET", "id": 1, "keys": keys, "obj": 10,
                              "pieces": [[0, 0], [1, 10]], "at": [0, 0, 0, 0]})
    with pytest.raises(P.ProtocolError):
        P.decode_request(zero)                   # an empty piece
