"""Block <-> ring copies of adpkv_vllm.common.copy on the layouts vLLM 0.29-0.33 hand a connector.

Pure tensor tests (no gateway, no engine); the CUDA cases run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from adpkv_vllm.common.copy import PagedLayer, block_major_view

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NB = 64


def layouts(device):
    g = torch.Generator().manual_seed(0)
    yield "BHNC", torch.randn(NB, 2, 32, 128, generator=g).to(device)            # 0.32 standardized
    yield "2xNB", torch.randn(2, NB, 32, 2, 64, generator=g).to(device)           # FlashAttention (K/V outer)
    yield "kernel-split", torch.randn(NB * 2, 2, 16, 128, generator=g).to(device)  # B = blocks * 2
    yield "bf16", torch.randn(NB, 2, 32, 128, generator=g).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stride_pad", [0, 4096])          # slots back to back, or padded
@pytest.mark.parametrize("ranks", [1, 2])                  # TP: each rank owns a slice of an object
def test_gather_then_scatter_roundtrip(device, stride_pad, ranks):
    for name, kv in layouts(device):
        layer = PagedLayer(name, kv, NB)
        bpc, count = 4, 5
        part = layer.page_bytes * bpc
        stride = part * ranks + stride_pad
        ring = torch.zeros(64 + count * stride, dtype=torch.uint8)
        ids = torch.randperm(NB)[: count * bpc]
        for rank in range(ranks):
            layer.gather(ring, 64, stride, count, rank * part, part, ids, bpc)
        # every object holds its blocks' pages back to back, in this rank's slice
        for j in range(count):
            for rank in range(ranks):
                o = 64 + j * stride + rank * part
                got = ring[o:o + part].view(layer.dtype).view(bpc, *layer.page_shape)
                want = layer.view.index_select(0, ids[j * bpc:(j + 1) * bpc].to(device)).cpu()
                assert torch.equal(got, want), name
        # scatter into other blocks of a zeroed cache, skipping the first block of object 0
        target = PagedLayer(name, torch.zeros_like(kv), NB)
        dst_all = torch.randperm(NB)[: count * bpc]
        pos = torch.arange(1, count * bpc)
        target.scatter(ring, 64, stride, count, 0, part, dst_all[pos], pos, bpc)
        for q in range(1, count * bpc):
            assert torch.equal(target.view[dst_all[q]].cpu(), layer.view[ids[q]].cpu()), name
        assert not target.view[dst_all[0]].any()


def test_block_dim_is_found_or_refused():
    assert block_major_view(torch.zeros(NB, 2, 3), NB).shape[0] == NB
    assert block_major_view(torch.zeros(2, NB, 3), NB).shape == (NB, 2, 3)
    assert block_major_view(torch.zeros(NB * 4, 3), NB).shape == (NB, 4, 3)
    with pytest.raises(ValueError):
        block_major_view(torch.zeros(7, 5), NB)


def test_rows_of_strided_ring_parts():
    from adpkv_vllm.common.copy import rows_of
    ring = torch.zeros(10_000, dtype=torch.uint8)
    parts = ring.as_strided((5, 300), (1000, 1), 64)          # a rank's slice of 5 ring slots
    assert rows_of(parts) == (300, 5, 1000)
    assert rows_of(torch.zeros(5, 300, dtype=torch.uint8)) == (300, 5, 300)
    assert rows_of(torch.zeros(4, 6).t()) is None               # rows not contiguous
    assert rows_of(ring.as_strided((5, 300), (100, 1), 0)) is None   # rows overlap


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 2-D DMA needs a CUDA GPU")
def test_strided_parts_go_by_one_2d_dma_not_a_host_copy():
    """A TP rank's slices, strided in a pinned ring, are copied by cuMemcpy2DAsync (the driver
    path is taken and stays on), byte for byte, both ways."""
    from adpkv_vllm.common import copy as copy_mod
    from adpkv_vllm.common.cuda_ring import pin_ring, unpin_ring
    ring = torch.zeros(64 << 20, dtype=torch.uint8)
    assert pin_ring(ring)
    try:
        g = torch.Generator().manual_seed(1)
        for part, stride, count in ((1 << 20, 2 << 20, 7), (4096 * 3, 4096 * 8, 33), (1000, 1536, 3)):
            src = ring.as_strided((count, part), (stride, 1), 128)
            src.copy_(torch.randint(0, 256, (count, part), dtype=torch.uint8, generator=g))
            dev = torch.full((count, part), 7, dtype=torch.uint8, device="cuda")
            copy_mod.copy_parts(dev, src)
            torch.cuda.synchronize()
            assert torch.equal(dev.cpu(), src)
            back = ring.as_strided((count, part), (stride, 1), 256 + count * stride)   # other slots
            back.zero_()
            copy_mod.copy_parts(back, dev)
            torch.cuda.synchronize()
            assert torch.equal(back, src)
            assert isinstance(copy_mod._driver, copy_mod._Driver)
    finally:
        unpin_ring(ring)
