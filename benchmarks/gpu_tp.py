"""Tensor-parallel restores on several GPUs: the ring -> GPUs copy stage, pages already in the ring.

One process per GPU (torch.distributed, NCCL), all mapping one ring file in /dev/shm and
registering it with CUDA as the vLLM workers do (``adpkv_vllm.common.cuda_ring.pin_ring``); the
copies are the connector's own (``adpkv_vllm.common.copy.PagedLayer``, ``adpkv_vllm.connector.fanout``).
Every restored layer is checked byte for byte against the ring.

* ``gqa`` (Llama-3-70B-like: 80 layers, 8 KV heads of 128, bf16, FlashAttention layout, TP
  ranks each holding 8/TP heads): each rank's slice of every object sits strided in the ring.
  Per rank, with every rank pulling at once: the 2-D DMA straight from the pinned ring (the
  connector now), the host pass it replaces (strided parts made contiguous on the host, then
  copied: the connector before), and a plain pinned H2D copy of the same bytes (the limit).
  With one GPU it runs rank 0 of a TP=``--tp`` geometry alone.
* ``mla`` (DeepSeek-V3-like: 61 layers, latent 512 + rope 64, bf16, blocks of 64 tokens; needs
  two GPUs or more): every rank needs every page. Fan-out off: each rank copies all of them.
  Fan-out on: an I/O thread per rank copies its share of each layer's ring batch on the copy
  stream, the main thread exchanges each layer over NVLink (``Fanout.exchange``) as it comes,
  as the vLLM worker does (I/O thread / ``wait_for_layer_load``).

* ``mla-restore`` (the same geometry): whole restores through a real gateway on an fs card, page
  cache hot: rank 0 stores every layer once, then every rank restores every layer (one GET per
  layer, all in flight). Fan-out off: each rank its own GET of every object (the worker without
  the setting); on: one collective GET per layer, shares, and the exchange in layer order.

For ``gqa`` and ``mla`` the pages are in the ring before the clock starts (the card -> ring reads are measured by
``gpu_restore.py``); ``--ring-layers`` distinct layer images are cycled over the layers.
The restore plan is the all-hits case of the worker's ``ChunkPlanIndex`` (``FullPlan``
below: that class imports vLLM, which this machine lacks).

    python benchmarks/gpu_tp.py --out OUT --parts gqa,mla,mla-restore --tokens 32768,131072
    python benchmarks/gpu_tp.py --device cpu --gpus 2 --tokens 2048 --ring-layers 2   # smoke test (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adpkv_vllm.common import copy as copy_mod
from adpkv_vllm.common.copy import PagedLayer
from adpkv_vllm.common.cuda_ring import pin_ring, unpin_ring
from adpkv_vllm.connector.fanout import Fanout

GiB, MiB = 1 << 30, 1 << 20
GQA = dict(layers=80, kv_heads=8, head_dim=128, block=16)          # Llama-3-70B
MLA = dict(layers=61, latent=512 + 64, block=64)                    # DeepSeek-V3
CHUNK = 256                                                         # tokens per stored object


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class FullPlan:
    """The worker's ``ChunkPlanIndex`` for a restore where every block of every object is
    loaded and hit: object j's blocks go to ``dst[j*bpc:(j+1)*bpc]``."""

    def __init__(self, dst: torch.Tensor, bpc: int):
        self.dst, self.bpc = dst, bpc
        self.pos = torch.arange(len(dst))
        self.digests = [None] * (len(dst) // bpc)

    def batch_blocks(self, first, count, hits):
        return self.dst[first * self.bpc:(first + count) * self.bpc], None


class Setup:
    """This rank's paged KV (one tensor per layer), the ring, and where each layer's objects are."""

    def __init__(self, kind: str, tokens: int, rank: int, tp: int, ring: torch.Tensor, ring_layers: int,
                 device: torch.device):
        self.kind, self.device = kind, device
        if kind == "gqa":
            g = GQA
            heads = g["kv_heads"] // tp
            self.bpc = CHUNK // g["block"]
            shape = lambda nb: (2, nb, g["block"], heads, g["head_dim"])     # noqa: E731
        else:
            g = MLA
            self.bpc = CHUNK // g["block"]
            shape = lambda nb: (nb, g["block"], g["latent"])                  # noqa: E731
        self.layers_n = g["layers"]
        self.objects = tokens // CHUNK
        self.num_blocks = self.objects * self.bpc + 64
        gen = torch.Generator().manual_seed(11)                              # the same block table on every rank
        self.dst = torch.randperm(self.num_blocks, generator=gen)[: self.objects * self.bpc]
        self.plan = FullPlan(self.dst, self.bpc)
        self.kv = [torch.empty(shape(self.num_blocks), dtype=torch.bfloat16, device=device)
                   for _ in range(self.layers_n)]
        self.layers = [PagedLayer(f"layer.{i}", t, self.num_blocks) for i, t in enumerate(self.kv)]
        self.part = self.layers[0].page_bytes * self.bpc                    # this rank's bytes of an object
        self.obj = self.part * (tp if kind == "gqa" else 1)
        self.slice = (rank * self.part, self.part) if kind == "gqa" else (0, self.part)
        self.layer_bytes = self.objects * self.obj
        self.ring, self.ring_layers = ring, ring_layers
        self.dst_dev = self.dst.to(device)

    def offset(self, layer: int) -> int:
        return (layer % self.ring_layers) * self.layer_bytes

    def poison(self) -> None:
        for t in self.kv:
            t.fill_(-3.0)

    def exact(self) -> bool:
        """Every loaded block of every layer holds its page of the ring, byte for byte."""
        for i, layer in enumerate(self.layers):
            o = self.offset(i)
            want = self.ring[o:o + self.layer_bytes].view(self.objects, self.obj)
            want = want[:, self.slice[0]:self.slice[0] + self.part].contiguous().to(self.device)
            got = layer.view.index_select(0, self.dst_dev).contiguous().view(torch.uint8)
            if not torch.equal(got.view(-1), want.view(-1)):
                return False
        return True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------- GQA: 2-D DMA vs host pass
def run_gqa(s: Setup, rank: int, stream, reps: int) -> dict:
    def restore():
        for i, layer in enumerate(s.layers):        # one ring batch per layer, as the gateway hands them
            layer.scatter(s.ring, s.offset(i), s.obj, s.objects, s.slice[0], s.slice[1], s.dst, None, s.bpc,
                          stream)
    row = {"bytes_per_rank": s.part * s.objects * s.layers_n}
    s.poison()
    row["dma2d_s"] = timed(restore, s.device, reps)
    row["dma2d_exact"] = s.exact()
    driver = copy_mod._driver
    copy_mod._driver = False                         # the host pass the connector made before
    s.poison()
    row["hostpass_s"] = timed(restore, s.device, max(1, reps // 2))
    row["hostpass_exact"] = s.exact()
    copy_mod._driver = driver
    if s.device.type == "cuda":                      # the limit: the same bytes, contiguous, pinned
        dev = torch.empty(s.ring_layers * s.objects * s.part, dtype=torch.uint8, device=s.device)
        src = s.ring[: dev.numel()]

        def h2d():
            with torch.cuda.stream(stream):
                for i in range(s.layers_n):
                    n = s.objects * s.part
                    o = (i % s.ring_layers) * n
                    dev[o:o + n].copy_(src[o:o + n], non_blocking=True)
        row["pinned_h2d_s"] = timed(h2d, s.device, reps)
        del dev
    for k in ("dma2d", "hostpass", "pinned_h2d"):
        if f"{k}_s" in row:
            row[f"{k}_GBs"] = row["bytes_per_rank"] / min(row[f"{k}_s"]) / 1e9
    if "pinned_h2d_GBs" in row:
        row["dma2d_vs_pinned"] = row["dma2d_GBs"] / row["pinned_h2d_GBs"]
    return row


# ---------------------------------------------------------------------------- MLA: fan-out on / off
def run_mla(s: Setup, rank: int, world: int, group, stream, reps: int) -> dict:
    fan = Fanout(group, rank, world, s.device)

    def off():
        for i, layer in enumerate(s.layers):
            layer.scatter(s.ring, s.offset(i), s.obj, s.objects, 0, s.part, s.dst, None, s.bpc, stream)

    def on():
        loads = [fan.begin(s.objects) for _ in s.layers]
        ready = [threading.Event() for _ in s.layers]

        def io_thread():                             # the client's I/O thread: one batch per layer
            for i, layer in enumerate(s.layers):
                batch = _Batch(0, s.objects, s.offset(i), s.obj)
                fan.scatter_share(loads[i], layer, s.ring, batch, (0, s.part), s.plan, s.bpc, stream)
                ready[i].set()
        t = threading.Thread(target=io_thread)
        t.start()
        for i, layer in enumerate(s.layers):         # wait_for_layer_load(i), in layer order
            ready[i].wait()
            fan.exchange(loads[i], layer, s.plan)
        t.join()

    h2d_all = s.part * s.objects * s.layers_n
    row = {"h2d_bytes_per_rank_off": h2d_all}
    lo_hi = [(s.objects * r // world, s.objects * (r + 1) // world) for r in range(world)]
    row["h2d_bytes_per_rank_on"] = (lo_hi[rank][1] - lo_hi[rank][0]) * s.part * s.layers_n
    s.poison()
    row["off_s"] = timed(off, s.device, reps)
    row["off_exact"] = s.exact()
    s.poison()
    row["on_s"] = timed(on, s.device, reps)
    row["on_exact"] = s.exact()
    row["speedup"] = min(row["off_s"]) / min(row["on_s"])
    row["off_GBs_per_rank"] = h2d_all / min(row["off_s"]) / 1e9
    row["on_GBs_per_rank"] = h2d_all / min(row["on_s"]) / 1e9          # pages landed per rank per second
    return row


# ---------------------------------------------------------------------------- MLA: whole restores
def _pages(s: Setup, layer: int) -> torch.Tensor:
    """Layer ``layer``'s stored pages (every loaded block's), the same on every rank: drawn from
    a generator seeded with the layer, on this rank's device."""
    g = torch.Generator(device=s.device).manual_seed(1000 + layer)
    shape = (len(s.dst), *s.layers[0].page_shape)
    return torch.randint(-30000, 30000, shape, dtype=torch.int16, device=s.device, generator=g).view(torch.bfloat16)


def run_mla_restore(s: Setup, rank: int, world: int, group, stream, reps: int, gw_port: int, engine: str,
                    tokens: int) -> dict:
    """Card -> ring -> GPUs through a real gateway, page cache hot: rank 0 stores every layer once
    (MLA: one writer), then each restore GETs every layer at once. Fan-out off: each rank its own
    GET of every object, as the worker does without the setting. Fan-out on: one collective GET
    per layer, each rank copies its share, the main thread exchanges each layer in order."""
    from adpkv_core.client import GatewayClient
    from adpkv_core.keys import KeyBuilder
    from adpkv_core.settings import ClientConfig
    from adpkv_vllm.common.copy import ring_tensor
    client = GatewayClient(ClientConfig(port=gw_port, timeout_s=600), engine, rank, world)
    ring = ring_tensor(client)
    pinned = pin_ring(ring) if s.device.type == "cuda" else False
    fan = Fanout(group, rank, world, s.device)
    kb = KeyBuilder(f"{engine}-{tokens}")
    keys = [kb.keys([b"chunk-%d" % c for c in range(s.objects)], [i]) for i in range(s.layers_n)]
    if rank == 0:
        futs = []
        for i, layer in enumerate(s.layers):
            layer.view.index_copy_(0, s.dst_dev, _pages(s, i))

            def fill(b, layer=layer):
                ids = s.dst[b.first * s.bpc:(b.first + b.count) * s.bpc]
                layer.gather(ring, b.offset, b.stride, b.count, 0, s.part, ids, s.bpc, stream=stream)
            futs.append(client.put(keys[i], s.obj, fill))
        assert all(all(f.result().stored) for f in futs), "store failed"
    dist.barrier()

    def restore(on: bool, tag: str) -> None:
        loads = [fan.begin(s.objects) for _ in s.layers] if on else None
        futs = []
        for i, layer in enumerate(s.layers):
            def copy(b, i=i, layer=layer):
                if on:
                    fan.scatter_share(loads[i], layer, ring, b, (0, s.part), s.plan, s.bpc, stream)
                else:
                    dst, _ = s.plan.batch_blocks(b.first, b.count, None)
                    layer.scatter(ring, b.offset, b.stride, b.count, 0, s.part, dst, None, s.bpc, stream)
            futs.append(client.get(keys[i], s.obj, copy, tag=f"{tag}:{i}" if on else None, slice=(0, s.part)))
        for i, layer in enumerate(s.layers):        # wait_for_layer_load(i), in layer order
            assert futs[i].result().all_ok, f"layer {i} missed"
            if on:
                fan.exchange(loads[i], layer, s.plan)

    def exact() -> bool:
        return all(torch.equal(layer.view.index_select(0, s.dst_dev).view(torch.int16), _pages(s, i).view(torch.int16))
                   for i, layer in enumerate(s.layers))
    row = {"kv_bytes_per_rank": s.part * s.objects * s.layers_n, "ring_pinned": pinned}
    for mode in ("off", "on"):
        times, ok = [], True
        for k in range(reps):
            s.poison()
            times += timed(lambda: restore(mode == "on", f"{mode}{k}"), s.device, 1)
            ok = ok and exact()
        row[f"restore_{mode}_s"] = times
        row[f"restore_{mode}_exact"] = ok
    row["restore_speedup"] = min(row["restore_off_s"]) / min(row["restore_on_s"])
    if pinned:
        unpin_ring(ring)
    del ring
    client.close()
    return row


class _Batch:
    """A ring batch of one layer, all objects found (``adpkv_core.client.RingBatch``'s fields)."""

    def __init__(self, first, count, offset, stride):
        self.first, self.count, self.offset, self.stride, self.hits = first, count, offset, stride, None


def nvlink_probe(rank: int, world: int, group, device, mib: int = 256) -> float:
    """All-gather bandwidth over the group (GB/s received per rank)."""
    x = torch.empty(mib * MiB, dtype=torch.uint8, device=device)
    out = torch.empty(world * mib * MiB, dtype=torch.uint8, device=device)
    for _ in range(3):
        dist.all_gather_into_tensor(out, x, group=group)
    ts = timed(lambda: [dist.all_gather_into_tensor(out, x, group=group) for _ in range(10)], device, 3)
    return (world - 1) * mib * MiB * 10 / min(ts) / 1e9


# ---------------------------------------------------------------------------- main
def worker(rank: int, args, port: int, ring_path: str, ring_bytes: int, gw_port: int) -> None:
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", 0 if args.share_gpu else rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if on_gpu else "gloo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.gpus,
                            **({"device_id": device} if backend == "nccl" else {}))
    group = dist.new_group(list(range(args.gpus)))
    ring = torch.from_file(ring_path, shared=True, size=ring_bytes, dtype=torch.uint8)
    pinned = pin_ring(ring) if on_gpu else False
    stream = torch.cuda.Stream(device=device) if on_gpu else None
    report = {"rank": rank, "ring_pinned": pinned, "runs": []}
    if args.gpus > 1:
        report["allgather_GBs"] = nvlink_probe(rank, args.gpus, group, device)
        log(rank, f"all-gather over the group: {report['allgather_GBs']:.1f} GB/s received per rank")
    for part in args.parts.split(","):
        if part.startswith("mla") and (args.gpus < 2 or args.share_gpu):
            log(rank, "mla: ranks do not have a GPU each: a check of the code on CUDA, no fan-out figure")
        for tokens in [int(t) for t in args.tokens.split(",")]:
            s = Setup("gqa" if part == "gqa" else "mla", tokens, rank, args.tp if part == "gqa" else args.gpus,
                      ring, args.ring_layers, device)
            if s.ring_layers * s.layer_bytes > ring_bytes:
                raise SystemExit(f"ring of {ring_bytes} bytes too small for {part} {tokens}")
            if part == "gqa":
                row = run_gqa(s, rank, stream, args.reps)
            elif part == "mla":
                row = run_mla(s, rank, args.gpus, group, stream, args.reps)
            else:
                row = run_mla_restore(s, rank, args.gpus, group, stream, args.reps, gw_port,
                                      f"gpu-tp-{os.getppid()}", tokens)
            row.update(part=part, tokens=tokens)
            report["runs"].append(row)
            log(rank, f"{part} {tokens}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in row.items() if not k.endswith("_s")))
            del s
            if on_gpu:
                torch.cuda.empty_cache()
    everyone = [None] * args.gpus
    dist.all_gather_object(everyone, report)
    if rank == 0:
        with open(os.path.join(args.out, "gpu_tp.json"), "w") as fh:
            json.dump({"gpus": args.gpus, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
                       "torch": torch.__version__, "args": vars(args), "ranks": everyone}, fh, indent=1)
    if pinned:
        unpin_ring(ring)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-tp-out")
    ap.add_argument("--parts", default="gqa,mla,mla-restore")
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--gpus", type=int, default=0, help="processes, one per GPU (0: every GPU)")
    ap.add_argument("--tp", type=int, default=2, help="GQA: TP size of the geometry (heads per rank = 8/tp)")
    ap.add_argument("--ring-layers", type=int, default=6, help="distinct layer images in the ring")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default=None, help="torch.distributed backend (default: nccl on GPUs, gloo on CPU)")
    ap.add_argument("--card-root", default="/tmp/adpkv-gpu-tp", help="mla-restore: where the fs card goes")
    ap.add_argument("--gateway-ring-gib", type=int, default=8, help="mla-restore: the gateway's ring")
    ap.add_argument("--io-processes", type=int, default=15, help="mla-restore: the gateway's io_processes")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank on GPU 0 (with --backend gloo): checks the code on CUDA with one GPU")
    args = ap.parse_args()
    if args.gpus == 0:
        args.gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    os.makedirs(args.out, exist_ok=True)
    top = max(int(t) for t in args.tokens.split(","))
    per_layer = max(top * 2 * GQA["kv_heads"] * GQA["head_dim"] * 2, top * MLA["latent"] * 2)
    ring_bytes = args.ring_layers * per_layer
    ring_path = f"/dev/shm/adpkv-gpu-tp-{os.getpid()}"
    t0 = time.perf_counter()
    ring = torch.from_file(ring_path, shared=True, size=ring_bytes, dtype=torch.uint8)
    ring.view(torch.int64).random_()                 # random pages, never zeros
    del ring
    print(f"ring {ring_bytes / GiB:.1f} GiB filled in {time.perf_counter() - t0:.1f} s; {args.gpus} ranks", flush=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gw = None
    if "mla-restore" in args.parts.split(","):      # a real gateway on an fs card for the whole restores
        from adpkv_gateway.ops.spawn import GatewayProcess
        card = os.path.join(args.card_root, f"card-{os.getpid()}")
        gw = GatewayProcess(card, shared_memory_size=args.gateway_ring_gib * GiB, thread_pool_size=16,
                            io_processes=args.io_processes, log_path=card + ".log").start(timeout_s=120)
    try:
        mp.start_processes(worker, args=(args, port, ring_path, ring_bytes, gw.port if gw else 0),
                           nprocs=args.gpus, join=True, start_method="spawn")
    finally:
        os.unlink(ring_path)
        if gw is not None:
            gw.stop(timeout_s=120)
            import shutil
            shutil.rmtree(card, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
