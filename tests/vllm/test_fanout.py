"""NVLink fan-out of MLA restores (adpkv_vllm.fanout): which rank copies which share of a
ring batch, how the ranks agree on sources and misses, the exchange, and when fan-out turns
itself off.

The exchange runs between two real processes over torch.distributed with the gloo backend
on CPU tensors (the code path NCCL takes on GPUs, with the GPU-only stream handling left
out): a real ring file both map, the connector's real ``PagedLayer`` and ``ChunkPlanIndex``.
NVLink itself and NCCL need two GPUs; ``benchmarks/gpu_fanout.py`` runs the same code there.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adpkv_core.client import RingBatch
from adpkv_vllm.copy import PagedLayer
from adpkv_vllm.fanout import Fanout, nvlink_between, share, sources, why_not
from adpkv_vllm.metadata import ChunkPlan
from adpkv_vllm.worker import ChunkPlanIndex

NB = 96                 # blocks in each rank's paged cache
PAGE = (4, 72)          # one block's latent page (float32: 1152 bytes)
BPC = 2                 # blocks per stored object
OBJECTS = 13
POISON = -7.0


# ----------------------------------------------------------------------------- shares and sources
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shares_cover_every_object_of_a_batch_once_and_evenly(world):
    for first in (0, 5):
        for count in range(0, 40):
            parts = [share(first, count, r, world) for r in range(world)]
            assert parts[0][0] == first and parts[-1][1] == first + count
            assert all(parts[r][1] == parts[r + 1][0] for r in range(world - 1))   # back to back
            sizes = [hi - lo for lo, hi in parts]
            assert max(sizes) - min(sizes) <= 1, (first, count, sizes)


def test_sources_pick_the_lowest_writer_and_mark_misses():
    wrote = torch.tensor([[1, 0, 0, 1, 0],
                          [0, 1, 0, 1, 0],
                          [0, 0, 0, 0, 1]], dtype=torch.uint8)
    assert sources(wrote).tolist() == [0, 1, -1, 0, 2]


def test_fanout_turns_itself_off_where_it_cannot_apply():
    assert why_not(True, True, 2, "cuda") is None
    assert "not asked" in why_not(False, True, 2, "cuda")
    assert "not MLA" in why_not(True, False, 2, "cuda")
    assert "tensor_parallel_size is 1" in why_not(True, True, 1, "cuda")
    assert "not on CUDA" in why_not(True, True, 2, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without GPUs")
def test_no_nvlink_without_nvml_or_gpus():
    linked, why = nvlink_between(["0", "1"])
    assert not linked and why


# ----------------------------------------------------------------------------- the exchange, two ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source_pages() -> torch.Tensor:
    """Object j's pages (BPC of them): what the card holds, the same for every rank."""
    return torch.randn(OBJECTS * BPC, *PAGE, generator=torch.Generator().manual_seed(7))


def _scenario(name: str):
    """(batches as (first, count), per-rank hit overrides {rank: {object: False}}, ranks with
    no gateway, positions or None, staging bytes)."""
    page_bytes = 4 * PAGE[0] * PAGE[1]
    return {
        "all-hits": ([(0, 5), (5, 1), (6, 7)], {}, (), None, 1 << 20),
        "misses": ([(0, 13)], {0: {1: False}, 1: {1: False, 9: False}}, (), None, 1 << 20),
        "disagreeing-hits": ([(0, 6), (6, 7)], {1: {4: False}}, (), None, 1 << 20),
        "rank-without-gateway": ([(0, 13)], {}, (1,), None, 1 << 20),
        "partial-positions": ([(0, 7), (7, 6)], {}, (), [q for q in range(OBJECTS * BPC) if q % 3], 1 << 20),
        "rounds": ([(0, 13)], {}, (), None, 3 * 3 * page_bytes),     # 3 pages a round
    }[name]


SCENARIOS = ["all-hits", "misses", "disagreeing-hits", "rank-without-gateway", "partial-positions", "rounds"]


def _rank(rank: int, world: int, port: int, ring_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)), backend="gloo", use_local_synchronization=True)
        for name in SCENARIOS:
            _run_scenario(rank, world, group, ring_path, out, name)
    finally:
        dist.destroy_process_group()


def _run_scenario(rank: int, world: int, group, ring_path: str, out: str, name: str) -> None:
    batches, overrides, gone, positions, staging = _scenario(name)
    pages = _source_pages()
    part = pages[0].numel() * 4 * BPC
    stride = part + 4096                                    # ring slots padded: parts strided
    ring = torch.from_file(ring_path, shared=True, size=64 + OBJECTS * stride, dtype=torch.uint8)
    kv = torch.full((NB, *PAGE), POISON)
    layer = PagedLayer("layer.0", kv, NB)
    dst_all = torch.randperm(NB, generator=torch.Generator().manual_seed(3))[: OBJECTS * BPC].tolist()
    if positions is None:
        plan = ChunkPlan("r", [b"d%02d" % j for j in range(OBJECTS)], [0] * OBJECTS, dst_all)
    else:
        plan = ChunkPlan("r", [b"d%02d" % j for j in range(OBJECTS)], [0] * OBJECTS,
                         [dst_all[q] for q in positions], positions)
    index = ChunkPlanIndex([plan], BPC)
    fan = Fanout(group, rank, world, torch.device("cpu"), staging_bytes=staging)
    load = None
    if rank not in gone:
        load = fan.begin(OBJECTS)
        for first, count in batches:
            hits = [overrides.get(rank, {}).get(j, True) for j in range(first, first + count)]
            b = RingBatch(first, count, 64 + first * stride, stride, part, 0, part, hits)
            fan.scatter_share(load, layer, ring, b, (0, part), index, BPC)
    before = (kv != POISON).flatten(1).any(1).nonzero().flatten().tolist()
    ok = fan.exchange(load, layer, index)
    torch.save({"before": before, "ok": ok.tolist(), "kv": kv, "dst": index.dst, "pos": index.pos},
               os.path.join(out, f"{name}-rank{rank}.pt"))


WORLD = 2


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory):
    """Both ranks run every scenario, in one pair of processes (spawning them is the slow part)."""
    tmp = tmp_path_factory.mktemp("fanout")
    pages = _source_pages()
    part = pages[0].numel() * 4 * BPC
    stride = part + 4096
    ring = torch.from_file(str(tmp / "ring"), shared=True, size=64 + OBJECTS * stride, dtype=torch.uint8)
    for j in range(OBJECTS):          # the card's objects, read into the ring once for the group
        ring[64 + j * stride:64 + j * stride + part] = pages[j * BPC:(j + 1) * BPC].reshape(-1).view(torch.uint8)
    mp.start_processes(_rank, args=(WORLD, _free_port(), str(tmp / "ring"), str(tmp)),
                       nprocs=WORLD, join=True, start_method="spawn")
    return tmp


@pytest.mark.parametrize("name", SCENARIOS)
def test_exchange_between_two_ranks(exchanged, name):
    world = WORLD
    pages = _source_pages()
    batches, overrides, gone, positions, _ = _scenario(name)
    res = [torch.load(exchanged / f"{name}-rank{r}.pt") for r in range(world)]

    # every rank derived the same outcome per object: a hit only where the rank whose share it
    # was read it (a rank without its gateway sources nothing)
    want_ok = []
    for j in range(OBJECTS):
        first, count = next((f, c) for f, c in batches if f <= j < f + c)
        owner = next(r for r in range(world) if share(first, count, r, world)[0] <= j < share(first, count, r, world)[1])
        want_ok.append(owner not in gone and overrides.get(owner, {}).get(j, True))
    assert res[0]["ok"] == res[1]["ok"] == want_ok
    assert not all(want_ok) or name in ("all-hits", "partial-positions", "rounds")

    for r in range(world):
        dst, pos, kv = res[r]["dst"], res[r]["pos"], res[r]["kv"]
        obj = pos // BPC
        # before the exchange a rank held only pages of its own share of each batch
        own = {int(d) for d, o in zip(dst, obj)
               if r not in gone and any(share(f, c, r, world)[0] <= o < share(f, c, r, world)[1]
                                        for f, c in batches)}
        assert set(res[r]["before"]) <= own
        # after it, every block of an agreed hit holds its page, byte for byte; nothing else was written
        for d, p, o in zip(dst.tolist(), pos.tolist(), obj.tolist()):
            if want_ok[o]:
                assert torch.equal(kv[d], pages[p]), (name, r, d, p)
            else:
                assert (kv[d] == POISON).all(), (name, r, d)
        untouched = sorted(set(range(NB)) - set(dst.tolist()))
        assert (kv[untouched] == POISON).all()
