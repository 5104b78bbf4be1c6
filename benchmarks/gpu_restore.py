"""GPU restore benchmark: card -> gateway -> ring -> paged GPU KV cache, against prefill.

Runs on one GPU with PyTorch (and transformers for the prefill), no vLLM:

* pinned H2D / D2H bandwidth (1 MiB and 1 GiB copies): the physical limit;
* a real gateway process on an fs card on this machine's disk, the ring registered with
  CUDA (``adpkv_vllm.common.cuda_ring.pin_ring``), and the vLLM connector's own copy code
  (``adpkv_vllm.common.copy.PagedLayer``) scattering ring batches into a FlashAttention-layout
  paged KV cache ``(2, num_blocks, block_size, kv_heads, head_dim)``;
* store, then restore with the page cache hot and cold (``drop_caches``), one GET per
  layer; every used block of every layer is compared byte for byte with what was stored
  (``torch.equal`` on the GPU of the restored blocks' int16 view against the source,
  made again from its per-layer seed: no second copy of the KV cache is kept);
* prefill of the same prompt by a transformers Llama of that geometry, random bf16
  weights, SDPA;
* a per-layer overlap run: layer i computes (one decoder layer over the prompt's tail)
  as soon as its own load is done while later layers still load; timeline PNG.

    python benchmarks/gpu_restore.py --out OUTDIR [--geometries llama3-8b,qwen2.5-32b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops.spawn import GatewayProcess
from adpkv_vllm.common.copy import PagedLayer, ring_tensor
from adpkv_vllm.common.cuda_ring import pin_ring, unpin_ring

GiB, MiB = 1 << 30, 1 << 20

GEOMETRIES = {
    "llama3-8b": dict(layers=32, kv_heads=8, head_dim=128, hidden=4096, heads=32, inter=14336, vocab=128256),
    "qwen2.5-32b": dict(layers=64, kv_heads=8, head_dim=128, hidden=5120, heads=40, inter=27648, vocab=152064),
    "tiny": dict(layers=4, kv_heads=2, head_dim=64, hidden=256, heads=4, inter=512, vocab=1000),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- physical limit
def pinned_bandwidth() -> dict:
    out = {}
    dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    for size, reps in ((MiB, 2000), (64 * MiB, 40), (GiB, 6)):
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            d, s = dst[:size], src[:size]
            for _ in range(3):
                d.copy_(s, non_blocking=True)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                d.copy_(s, non_blocking=True)
            sync()
            out[f"{name}_{size // MiB}MiB_GBs"] = size * reps / (time.perf_counter() - t0) / 1e9
    del dev, host
    return out


# ---------------------------------------------------------------------------- the paged cache
class PagedCache:
    """One FlashAttention-layout KV tensor per layer, blocks of a prompt in shuffled order."""

    def __init__(self, g: dict, tokens: int, block: int, chunk: int, device: str):
        self.g, self.block, self.chunk = g, block, chunk
        self.nb = chunk // block                       # blocks per stored chunk
        self.chunks = tokens // chunk
        self.num_blocks = self.chunks * self.nb + 64
        self.kv = [torch.empty((2, self.num_blocks, block, g["kv_heads"], g["head_dim"]), dtype=torch.bfloat16,
                               device=device) for _ in range(g["layers"])]
        self.layers = [PagedLayer(f"layer.{i}", t, self.num_blocks) for i, t in enumerate(self.kv)]
        gen = torch.Generator().manual_seed(0)
        self.block_ids = torch.randperm(self.num_blocks, generator=gen)[: self.chunks * self.nb]
        self.obj = self.layers[0].page_bytes * self.nb
        self.dev_ids = self.block_ids.to(device)

    def _fill(self, t: torch.Tensor, layer: int) -> None:
        """Layer ``layer``'s source bytes into ``t``: random int16 from the layer's own seed,
        so the same bytes can be made again to compare with."""
        gen = torch.Generator(device=t.device).manual_seed(1000 + layer)
        t.view(torch.int16).random_(-30000, 30000, generator=gen)

    def randomize(self) -> None:
        for i, t in enumerate(self.kv):
            self._fill(t, i)

    def exact(self) -> bool:
        """Whether every used block of every layer holds, byte for byte, what ``randomize``
        wrote: ``torch.equal`` of the blocks' int16 views (bitwise, NaN patterns included)
        against the source made again, one layer at a time on the device."""
        for i, t in enumerate(self.kv):
            src = torch.empty_like(t)
            self._fill(src, i)
            if not torch.equal(t[:, self.dev_ids].view(torch.int16), src[:, self.dev_ids].view(torch.int16)):
                return False
            del src
        return True

    def zero(self) -> None:
        for t in self.kv:
            t.zero_()


def keys_for(cache: PagedCache, kb: KeyBuilder, layer: int) -> list[bytes]:
    return kb.keys([b"chunk-%d" % c for c in range(cache.chunks)], [layer])


# ---------------------------------------------------------------------------- store / restore
def store(client, ring, cache: PagedCache, kb, stream) -> float:
    futs = []
    t0 = time.perf_counter()
    for i, layer in enumerate(cache.layers):
        def fill(b, layer=layer):
            ids = cache.block_ids[b.first * cache.nb:(b.first + b.count) * cache.nb]
            layer.gather(ring, b.offset, b.stride, b.count, 0, cache.obj, ids, cache.nb, stream=stream)
        futs.append(client.put(keys_for(cache, kb, i), cache.obj, fill))
    ok = all(all(f.result().stored) for f in futs)
    t = time.perf_counter() - t0
    if not ok:
        raise RuntimeError("store failed")
    return t


def restore(client, ring, cache: PagedCache, kb, stream, on_layer=None):
    """GET every layer (one request per layer, all in flight); returns (seconds, per-layer done times)."""
    done_at = [0.0] * len(cache.layers)
    futs = []
    t0 = time.perf_counter()
    for i, layer in enumerate(cache.layers):
        def copy(b, layer=layer):
            ids = cache.block_ids[b.first * cache.nb:(b.first + b.count) * cache.nb]
            layer.scatter(ring, b.offset, b.stride, b.count, 0, cache.obj, ids, None, cache.nb, stream=stream)
        f = client.get(keys_for(cache, kb, i), cache.obj, copy)
        f.add_done_callback(lambda _f, i=i: done_at.__setitem__(i, time.perf_counter() - t0))
        futs.append(f)
    compute = on_layer(futs, t0) if on_layer else None
    hits = [f.result().all_ok for f in futs]
    sync()
    t = time.perf_counter() - t0
    if not all(hits):
        raise RuntimeError(f"restore missed layers {[i for i, h in enumerate(hits) if not h]}")
    return t, done_at, compute


def diagnose(client, ring, cache: PagedCache, kb, card: str, threads: int) -> dict:
    """Where restore time goes: raw parallel reads of the card's files into the ring,
    the gateway alone (GETs whose copy does nothing), and ring -> paged GPU copies alone."""
    from concurrent.futures import ThreadPoolExecutor
    out = {}
    files = [os.path.join(d, f) for d, _, fs in os.walk(card) for f in fs if not f.endswith(".json")]
    view = client.ring
    obj = cache.obj

    def read(i):
        fd = os.open(files[i], os.O_RDONLY)
        try:
            slot = (i % 1024) * (obj + 4096)
            os.preadv(fd, [view[slot:slot + obj + 4096]], 0)
        finally:
            os.close(fd)
    for n in (1, threads):
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            list(pool.map(read, range(len(files))))
            out[f"raw_read_{n}threads_GBs"] = len(files) * obj / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    futs = [client.get(keys_for(cache, kb, i), obj, lambda b: None) for i in range(len(cache.layers))]
    assert all(f.result().all_ok for f in futs)
    out["gateway_only_GBs"] = len(files) * obj / (time.perf_counter() - t0) / 1e9
    # the same while the GPU pulls from pinned host memory at full speed (as during a restore):
    # how much the reads lose to the DMA sharing the host's memory
    pull = _H2DPull()
    t0 = time.perf_counter()
    futs = [client.get(keys_for(cache, kb, i), obj, lambda b: None) for i in range(len(cache.layers))]
    assert all(f.result().all_ok for f in futs)
    out["gateway_only_gpu_pulling_GBs"] = len(files) * obj / (time.perf_counter() - t0) / 1e9
    out["gpu_pull_meanwhile_GBs"] = pull.finish()
    stream = torch.cuda.Stream()
    for count in (16, 128):                     # objects per ring batch: 16 MiB and 128 MiB copies
        count = min(count, cache.chunks)
        ids = cache.block_ids[: count * cache.nb]
        moved = 0
        sync()
        t0 = time.perf_counter()
        for _ in range(2):
            for layer in cache.layers:
                layer.scatter(ring, 0, obj, count, 0, obj, ids, None, cache.nb, stream=stream)
                moved += count * obj
        sync()
        out[f"ring_to_gpu_{count}obj_GBs"] = moved / (time.perf_counter() - t0) / 1e9
        # checked: the blocks hold the ring's bytes. The store path's gather (byte-exact in the
        # restore check above) copies them back behind the scattered objects and the two ring
        # ranges are compared byte for byte; None when the ring has no room for the second copy.
        exact = None
        if 2 * count * obj <= ring.numel():
            exact = True
            for layer in cache.layers:
                layer.gather(ring, count * obj, obj, count, 0, obj, ids, cache.nb, stream=stream)
                sync()
                exact = exact and torch.equal(ring[:count * obj], ring[count * obj:2 * count * obj])
        out[f"ring_to_gpu_{count}obj_exact"] = exact
    log("diagnose: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
    return out


class _H2DPull:
    """A thread copying 1 GiB of pinned host memory to the GPU over and over until ``finish``."""

    def __init__(self):
        import threading
        self.host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        self.stop, self.moved, self.t0 = threading.Event(), 0, time.perf_counter()
        self.thread = threading.Thread(target=self._pull)
        self.thread.start()

    def _pull(self) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                self.dev.copy_(self.host, non_blocking=True)
                stream.synchronize()
                self.moved += GiB

    def finish(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.moved / (time.perf_counter() - self.t0) / 1e9


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- prefill
def build_model(g: dict):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=g["hidden"], intermediate_size=g["inter"], num_hidden_layers=g["layers"],
                      num_attention_heads=g["heads"], num_key_value_heads=g["kv_heads"], head_dim=g["head_dim"],
                      vocab_size=g["vocab"], max_position_embeddings=262144, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


@torch.inference_mode()
def prefill_seconds(model, tokens: int, vocab: int) -> float:
    ids = torch.randint(0, vocab, (1, tokens), device="cuda")
    model(input_ids=ids[:, :2048], use_cache=False, logits_to_keep=1)
    sync()
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    sync()
    return time.perf_counter() - t0


def overlap_compute(model, tail: int):
    """on_layer hook: layer i runs one decoder layer over ``tail`` tokens once layer i is loaded."""
    layers = model.model.layers
    hidden = torch.randn(1, tail, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(tail, device="cuda").unsqueeze(0)
    cos_sin = model.model.rotary_emb(hidden, pos)

    @torch.inference_mode()
    def run(futs, t0):
        spans = []
        h = hidden
        for i, f in enumerate(futs):
            f.result()                                   # wait_for_layer_load(i): this layer only
            start = time.perf_counter() - t0
            out = layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
            h = out[0] if isinstance(out, tuple) else out
            sync()
            spans.append((start, time.perf_counter() - t0))
        return spans
    return run


def plot_timeline(path: str, done_at, spans, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(done_at)
    fig, ax = plt.subplots(figsize=(10, max(4, n * 0.18)))
    for i in range(n):
        ax.barh(i, done_at[i], left=0, height=0.35, color="#9ecae1", label="load (GET issued at 0)" if i == 0 else None)
        ax.plot([done_at[i]], [i], "|", color="#08519c", markersize=8)
        s, e = spans[i]
        ax.barh(i + 0.4, e - s, left=s, height=0.35, color="#fd8d3c", label="layer compute" if i == 0 else None)
    ax.set_xlabel("seconds since the restore started")
    ax.set_ylabel("layer")
    ax.invert_yaxis()
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------- main
def run_geometry(name: str, g: dict, token_counts, args, report: dict) -> None:
    log(f"== {name}: {g['layers']} layers, {g['kv_heads']} KV heads, head dim {g['head_dim']}, bf16")
    model = build_model(g) if not args.skip_prefill else None
    for tokens in token_counts:
        row = {"geometry": name, "tokens": tokens}
        if model is not None:
            row["prefill_s"] = prefill_seconds(model, tokens, g["vocab"])
            log(f"prefill {tokens} tokens: {row['prefill_s']:.2f} s")
        card = os.path.join(args.card_root, f"card-{name}-{tokens}")
        shutil.rmtree(card, ignore_errors=True)
        cache = PagedCache(g, tokens, args.block, args.chunk, "cuda")
        kv_bytes = cache.obj * cache.chunks * g["layers"]
        row["kv_GiB"] = kv_bytes / GiB
        gw = GatewayProcess(card, shared_memory_size=args.ring_gib * GiB, thread_pool_size=args.threads,
                            io_processes=args.io_processes,
                            log_path=card + ".log").start(timeout_s=120)
        try:
            client = GatewayClient(ClientConfig(port=gw.port, timeout_s=600), f"gpu-bench-{tokens}")
            ring = ring_tensor(client)
            row["ring_pinned"] = pin_ring(ring)
            stream = torch.cuda.Stream()
            kb = KeyBuilder(f"gpu-bench-{name}-{tokens}")
            cache.randomize()
            row["store_s"] = store(client, ring, cache, kb, stream)
            log(f"store {kv_bytes / GiB:.1f} GiB: {row['store_s']:.2f} s ({kv_bytes / row['store_s'] / 1e9:.1f} GB/s)")
            for regime in ["hot"] * args.hot_repeats + ["cold"]:
                if regime == "cold" and not drop_caches():
                    log("cannot drop the page cache: no cold run")
                    continue
                cache.zero()
                sync()
                t, done_at, _ = restore(client, ring, cache, kb, stream)
                ok = cache.exact()
                row.setdefault(f"restore_{regime}_all_s", []).append(t)
                row[f"restore_{regime}_s"] = sorted(row[f"restore_{regime}_all_s"])[
                    (len(row[f"restore_{regime}_all_s"]) - 1) // 2]          # the median (lower middle)
                row[f"restore_{regime}_exact"] = row.get(f"restore_{regime}_exact", True) and ok
                log(f"restore ({regime} page cache) {kv_bytes / GiB:.1f} GiB: {t:.2f} s "
                    f"({kv_bytes / t / 1e9:.1f} GB/s), bytes exact: {ok}")
            if model is not None and tokens == max(token_counts):
                cache.zero()
                t, done_at, spans = restore(client, ring, cache, kb, stream, overlap_compute(model, args.tail))
                row["overlap_total_s"] = spans[-1][1]
                row["overlap_hidden_layers"] = sum(done_at[i] <= spans[i - 1][1] for i in range(1, len(spans)))
                png = os.path.join(args.out, f"timeline-{name}-{tokens}.png")
                plot_timeline(png, done_at, spans, f"{name}, {tokens} tokens: per-layer load vs compute")
                row["timeline_png"] = os.path.basename(png)
                log(f"overlap: {row['overlap_hidden_layers']} of {len(spans) - 1} layer loads done before the "
                    f"previous layer finished computing; last layer done at {spans[-1][1]:.2f} s")
            if args.diagnose:
                row.update(diagnose(client, ring, cache, kb, card, args.threads))
            unpin_ring(ring)
            del ring
            client.close()
        finally:
            gw.stop(timeout_s=120)
            shutil.copy(card + ".log", os.path.join(args.out, f"gateway-{name}-{tokens}.log"))
            shutil.rmtree(card, ignore_errors=True)
        del cache
        torch.cuda.empty_cache()
        if "prefill_s" in row:
            row["prefill_over_restore_hot"] = row["prefill_s"] / row["restore_hot_s"]
        report["runs"].append(row)
        with open(os.path.join(args.out, "gpu_restore.json"), "w") as fh:
            json.dump(report, fh, indent=1)
    del model
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-bench-out")
    ap.add_argument("--geometries", default="llama3-8b:32768,131072;qwen2.5-32b:32768")
    ap.add_argument("--card-root", default="/tmp/adpkv-gpu-bench")
    ap.add_argument("--ring-gib", type=int, default=8)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--block", type=int, default=16, help="tokens per KV block (FlashAttention layout)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per stored object")
    ap.add_argument("--tail", type=int, default=512, help="new tokens each layer computes in the overlap run")
    ap.add_argument("--io-processes", type=int, default=0, help="gateway io_processes (fs reads in processes)")
    ap.add_argument("--hot-repeats", type=int, default=3, help="restores with the page cache hot (median reported)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="also break the restore time down")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.card_root, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cpus": os.cpu_count(),
              "args": vars(args), "runs": []}
    report["bandwidth"] = pinned_bandwidth()
    log("pinned bandwidth: " + ", ".join(f"{k} {v:.1f}" for k, v in report["bandwidth"].items()))
    for spec in args.geometries.split(";"):
        name, toks = spec.split(":")
        run_geometry(name, GEOMETRIES[name], [int(t) for t in toks.split(",")], args, report)
    with open(os.path.join(args.out, "gpu_restore.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
