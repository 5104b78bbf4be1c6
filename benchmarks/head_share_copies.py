"""The ring <-> KV-block copies of a restore across TP sizes (issue 27), on CPU or one GPU:
byte-for-byte checks and timings, without vLLM (only torch and the connector's copy code).

A ring (pinned on CUDA) holds ``--objects`` canonical objects of one layer (a TP=1 engine's:
``--blocks`` pages of ``[H, N, 2·head]`` each). Timed, per restore of all objects:

- ``tp1``: the TP=1 copy (``PagedLayer.scatter`` of whole objects, as before issue 27);
- ``tp2 rank r``: rank r of TP=2 copies its half of the heads (``PagedLayer.scatter_share``);
- ``tp2 per-TP slice``: the per-TP layout's copy of a contiguous half object (what a TP=2
  rank did before issue 27 on its own objects), for comparison.

- ``tp2 put rank r``: rank r of TP=2 writes its heads into the shared slots (``gather_share``,
  a collective PUT's copy), against ``tp1_put`` (``PagedLayer.gather`` of whole objects).

On CUDA the head-share copies are 2-D DMAs (``copy.dma_plan``: ``dma_copies`` per restore;
``dma_2d_driver`` false would mean the torch fallback through a host copy ran instead).
Checks, byte for byte: every rank's blocks equal the matching heads of the TP=1 blocks; TP=2
ranks' PUTs into one slot read back by TP=1 equal both ranks' blocks, and the slots' bytes
outside the objects stay untouched.

    python benchmarks/head_share_copies.py [--device cuda] [--objects 256] [--heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod        # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


PLUGIN = os.path.join(HERE, "..", "plugins", "vllm")
copy_mod = _load("adpkv_vllm_copy", os.path.join(PLUGIN, "copy.py"))
heads_mod = _load("adpkv_vllm_heads", os.path.join(PLUGIN, "heads.py"))
PagedLayer, HeadShare = copy_mod.PagedLayer, heads_mod.HeadShare


def timed(fn, device, repeat=7) -> float:
    out = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def check_padded_slots(kv1: torch.Tensor, dt, H: int, D: int, bpc: int, dev) -> dict:
    """Both ranks of TP=2 read and write their heads of objects in slots with padding after each
    (the objects are not back to back: ``dma_plan``'s per-object and per-row copies), byte for
    byte against the TP=1 objects; the padding stays untouched. Returns the copies per plan."""
    one = PagedLayer("l", kv1, kv1.shape[0])
    obj = one.page_bytes * bpc
    stride = -(-obj // 4096) * 4096 + 4096
    plans = {}
    for n in (2, min(64, (kv1.shape[0] - 1) // bpc)):     # fewer objects than rows per object; more
        ring = torch.full((4096 + n * stride,), 0x5A, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        ids = torch.arange(1, n * bpc + 1, dtype=torch.long)
        one.gather(ring, 4096, stride, n, 0, obj, ids, bpc)
        want = ring.clone()
        for r in range(2):
            kv2 = torch.zeros(kv1.shape[0], H // 2, *kv1.shape[2:], dtype=dt, device=dev)
            two = PagedLayer("l", kv2, kv1.shape[0])
            share = HeadShare.of(two.page_shape, dt, H // 2, D, 2, r)
            view = share.view(ring, 4096, stride, n, bpc)
            plans[f"{n}_objects"] = len(copy_mod.dma_plan(torch.empty(view.shape, dtype=dt, device=dev), view))
            two.scatter_share(view, ids.flip(0), None)
            assert torch.equal(kv2[ids.flip(0)], kv1[ids][:, r * H // 2:(r + 1) * H // 2]), (n, r)
            view.zero_()
            two.gather_share(view, ids.flip(0))
        assert torch.equal(ring, want), n
    return plans


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per object")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    n, bpc, H, N, D = args.objects, args.blocks, args.heads, args.block_size, args.head_dim
    nb = n * bpc + 1
    g = torch.Generator(device="cpu").manual_seed(0)
    kv1 = torch.randn(nb, H, N, 2 * D, generator=g).to(dt).to(dev)
    one = PagedLayer("l", kv1, nb)
    stride = -(-one.page_bytes * bpc // 4096) * 4096
    ring = torch.zeros(4096 + n * stride, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    ids = torch.arange(1, nb, dtype=torch.long)
    one.gather(ring, 4096, stride, n, 0, one.page_bytes * bpc, ids, bpc)       # what a TP=1 engine stores
    perm = ids[torch.randperm(len(ids), generator=g)]
    results = {"device": str(dev), "objects": n, "object_bytes": one.page_bytes * bpc,
               "restore_bytes": n * one.page_bytes * bpc}
    # TP=1: whole objects
    kv1b = torch.zeros_like(kv1)
    one_b = PagedLayer("l", kv1b, nb)
    results["tp1_s"] = timed(lambda: one_b.scatter(ring, 4096, stride, n, 0, one.page_bytes * bpc, perm, None, bpc), dev)
    results["tp1_put_s"] = timed(lambda: one.gather(ring, 4096, stride, n, 0, one.page_bytes * bpc, ids, bpc), dev)
    assert torch.equal(kv1b[perm], kv1[ids])
    # TP=2: each rank its heads of the same objects
    for r in range(2):
        kv2 = torch.zeros(nb, H // 2, N, 2 * D, dtype=dt, device=dev)
        two = PagedLayer("l", kv2, nb)
        share = HeadShare.of(two.page_shape, dt, H // 2, D, 2, r)
        view = share.view(ring, 4096, stride, n, bpc)
        results[f"tp2_rank{r}_s"] = timed(lambda: two.scatter_share(view, perm, None), dev)
        results["dma_copies"] = len(copy_mod.dma_plan(torch.empty(view.shape, dtype=dt, device=dev), view))
        assert torch.equal(kv2[perm], kv1[ids][:, r * H // 2:(r + 1) * H // 2]), r
        # the per-TP layout's copy of a contiguous half object (before issue 27), same bytes
        results[f"tp2_slice_rank{r}_s"] = timed(
            lambda: two.scatter(ring, 4096, stride, n, r * two.page_bytes * bpc, two.page_bytes * bpc, perm, None, bpc), dev)
    # TP=2 ranks write one slot (a collective PUT), TP=1 reads it
    ring2 = torch.full_like(ring, 0x5A)
    if dev.type == "cuda":
        ring2 = ring2.pin_memory()
    halves = []
    for r in range(2):
        kv2 = kv1[:, r * H // 2:(r + 1) * H // 2].contiguous()
        two = PagedLayer("l", kv2, nb)
        share = HeadShare.of(two.page_shape, dt, H // 2, D, 2, r)
        results[f"tp2_put_rank{r}_s"] = timed(lambda: two.gather_share(share.view(ring2, 4096, stride, n, bpc), ids), dev)
        halves.append(kv2)
    outside = torch.ones_like(ring2, dtype=torch.bool)
    for j in range(n):
        outside[4096 + j * stride:4096 + j * stride + one.page_bytes * bpc] = False
    assert bool((ring2[outside] == 0x5A).all())
    back = torch.zeros_like(kv1)
    PagedLayer("l", back, nb).scatter(ring2, 4096, stride, n, 0, one.page_bytes * bpc, ids, None, bpc)
    assert torch.equal(back[ids], torch.cat([h[ids] for h in halves], dim=1))
    results["padded_slot_plans"] = check_padded_slots(kv1, dt, H, D, bpc, dev)
    if dev.type == "cuda":
        results["dma_2d_driver"] = isinstance(copy_mod._driver, copy_mod._Driver)
    results["checks"] = "byte-exact"
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
