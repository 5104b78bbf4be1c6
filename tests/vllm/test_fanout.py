"""NVLink fan-out of MLA restores (adpkv_vllm.connector.fanout): which rank copies which share of a
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
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adpkv_core.client import RingBatch
from adpkv_vllm.common.copy import PagedLayer
from adpkv_vllm.connector.fanout import Fanout, nvlink_between, share, sources, why_not
from adpkv_vllm.connector.metadata import ChunkPlan
from adpkv_vllm.connector.worker import ChunkPlanIndex

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


# ----------------------------------------------------------------------------- the worker, two ranks, a real gateway
W_BLOCK, W_HEAD, W_BLOCKS, W_CHUNK, W_CHUNKS = 16, 96, 128, 32, 6     # MLA latent pages of 96 floats
W_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _worker_rank(rank: int, port: int, gw_port: int, model_dir: str, engine_id: str, out: str) -> None:
    """One TP rank: the connector's worker role (``AdpKVConnector``) with MLA latent pages on CPU,
    fan-out over gloo. Stand-ins, because vLLM's distributed state and NCCL need GPUs: the TP rank
    comes from a patched ``get_tensor_model_parallel_rank``, the communicator is gloo's."""
    import vllm.distributed.parallel_state as ps
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             VllmConfig)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from adpkv_core.client import GatewayClient
    from adpkv_core.settings import ClientConfig
    from adpkv_vllm.connector.connector import AdpKVConnector
    from adpkv_vllm.connector.metadata import AdpConnectorMetadata

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.get_tensor_model_parallel_rank = lambda: rank
    try:
        group = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)
        spec = MLAAttentionSpec(block_size=W_BLOCK, num_kv_heads=1, head_size=W_HEAD, dtype=torch.float32)
        conf = {"adpkv.port": gw_port, "adpkv.load_choice": "always", "adpkv.namespace": "fanout", "adpkv.chunk_size": W_CHUNK,
                "adpkv.timeout_s": 5.0, "adpkv.nvlink_fanout": True}
        vcfg = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                                     max_model_len=4096, seed=0),
            cache_config=CacheConfig(block_size=W_BLOCK, enable_prefix_caching=True),
            parallel_config=ParallelConfig(tensor_parallel_size=2),
            kv_transfer_config=KVTransferConfig(kv_connector="AdpKVConnector", kv_connector_module_path="adpkv_vllm",
                                                kv_role="kv_both", engine_id=engine_id,
                                                kv_connector_extra_config=conf),
            device_config=DeviceConfig("cpu"))
        kcfg = KVCacheConfig(num_blocks=W_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(W_LAYERS), spec)])
        conn = AdpKVConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        kv = {n: torch.full((W_BLOCKS, W_BLOCK, W_HEAD), POISON) for n in W_LAYERS}
        conn.register_kv_caches(kv)
        worker = conn.connector_worker
        off_on_cpu = worker.fanout is None                 # for_vllm: the KV cache is not on CUDA
        worker.fanout = Fanout(group, rank, 2, torch.device("cpu"))
        copied = []
        share_copy = worker.fanout.scatter_share
        worker.fanout.scatter_share = lambda load, layer, ring, b, *a, **k: (
            copied.append(share(b.first, b.count, rank, 2)), share_copy(load, layer, ring, b, *a, **k))[1]
        bpc = W_CHUNK // W_BLOCK
        src = torch.randn(len(W_LAYERS), W_CHUNKS * bpc, W_BLOCK, W_HEAD, generator=torch.Generator().manual_seed(5))
        digests = [b"chunk-%010d" % c for c in range(W_CHUNKS)]
        marks = [0] * W_CHUNKS
        save_blocks = list(range(1, 1 + W_CHUNKS * bpc))
        # rank 0 stores the chunks (MLA: one writer for the group), all but chunk 3
        stored = [c for c in range(W_CHUNKS) if c != 3]
        if rank == 0:
            for li, n in enumerate(W_LAYERS):
                kv[n][save_blocks] = src[li]
            plan = ChunkPlan("w", [digests[c] for c in stored], [0] * len(stored),
                             [save_blocks[c * bpc + b] for c in stored for b in range(bpc)])
            meta = AdpConnectorMetadata(step=1, saves=[plan])
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
            for n in W_LAYERS:
                conn.wait_for_layer_load(n)
                conn.save_kv_layer(n, kv[n], None)
            conn.wait_for_save()
            conn.clear_connector_metadata()
            keys = [k for li in range(len(W_LAYERS)) for k in worker.cfg.keys.keys(
                [digests[c] for c in stored], (li,), kind=0)]
            probe = GatewayClient(ClientConfig(port=gw_port, namespace="fanout"), worker.cfg.engine_id, None, 2)
            deadline = time.monotonic() + 60
            while not all(probe.exist(keys).result()):
                assert time.monotonic() < deadline, "the chunks were not stored"
                time.sleep(0.05)
            probe.close()
        dist.barrier(group)
        # both ranks restore every chunk into other blocks: chunk 3 is missing
        load_blocks = list(range(64, 64 + W_CHUNKS * bpc))
        plan = ChunkPlan("r", digests, marks, load_blocks)
        meta = AdpConnectorMetadata(step=2, loads=[plan])
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        for n in W_LAYERS:
            conn.wait_for_layer_load(n)
        conn.wait_for_save()
        errors = conn.get_block_ids_with_load_errors()
        conn.clear_connector_metadata()
        torch.save({"kv": kv, "errors": sorted(errors), "src": src, "load_blocks": load_blocks,
                    "copied": copied, "off_on_cpu": off_on_cpu}, os.path.join(out, f"worker{rank}.pt"))
        conn.shutdown()
    finally:
        dist.destroy_process_group()


def test_worker_restores_mla_pages_through_the_fanout(start_gateway, model_dir, tmp_path):
    """Two TP ranks' real worker roles on a real gateway: rank 0 stores an MLA model's chunks,
    both restore them with one collective GET per layer, each copying half of every ring batch
    and the rest arriving by the exchange; every page right on both ranks, the missing chunk an
    error on both, its blocks untouched."""
    import uuid
    gw = start_gateway()
    mp.start_processes(_worker_rank, args=(_free_port(), gw.port, model_dir, str(uuid.uuid4()), str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    bpc = W_CHUNK // W_BLOCK
    for r in range(2):
        res = torch.load(tmp_path / f"worker{r}.pt")
        assert res["off_on_cpu"]
        missing = res["load_blocks"][3 * bpc:4 * bpc]
        assert res["errors"] == sorted(missing)
        for li, n in enumerate(W_LAYERS):
            kv = res["kv"][n]
            for q, b in enumerate(res["load_blocks"]):
                if b in missing:
                    assert (kv[b] == POISON).all(), (r, n, b)
                else:
                    assert torch.equal(kv[b], res["src"][li][q]), (r, n, b)
        # per layer one ring batch here: this rank copied its half of it, the other half came by NVLink's stand-in
        assert res["copied"] and all(hi - lo == W_CHUNKS // 2 for lo, hi in res["copied"]), res["copied"]
