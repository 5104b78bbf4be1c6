"""Copy-free restores (issue 31): the GPU copies KV straight from the card's page-cache pages,
next to the ring path and pinned H2D, in one call.

For each prompt length (Llama-3-8B geometry by default: 32 layers, 8 KV heads, head dim 128,
bf16; FlashAttention layout ``(2, num_blocks, 16, 8, 128)``, the prompt's blocks shuffled):

* pinned H2D of 1 GiB (the physical limit);
* on CUDA, prefill of each prompt by a transformers Llama of that geometry (random bf16
  weights, SDPA attention: ``gpu_restore.prefill_seconds``), the peer a restore replaces;
* a real gateway process (fs card under ``--card-root``, ``io_processes``), the KV stored once;
* ``ring_hot``: one GET per layer through the CUDA-registered ring, the vLLM connector's
  scatter (``PagedLayer.scatter``);
* ``direct_cold_reg``: page cache hot, no mapping held: MAP (the gateway checks every object in
  place), ``mmap`` + ``cudaHostRegister(..., ReadOnly)`` of each, then the copies;
* ``direct_warm``: the mappings held and registered (``DirectMaps``): copies only — each layer's
  objects were fetched together, so they are one span (one registration) and one H2D DMA into a
  staging tensor, then one ``index_copy_`` into the paged blocks (``copy.PagedLayer.load_objects``);
  the time of each layer's copies is recorded for a timeline (``--timeline``, a PNG);
* ``ring_cold`` and ``direct_cold``: every object file dropped from the page cache
  (``posix_fadvise(DONTNEED)``; mappings closed first), then a restore each way;
* the eviction race (``--evict-rounds``): direct restores of a prompt while a second client's
  stores evict it from a card of 1.3x its KV: restored blocks equal their source, the rest
  untouched (misses).

Every restore is checked on the GPU: ``torch.equal`` of every restored block against the source
KV. Prints one line per measurement and a JSON report (``--out``/gpu_direct_restore.json).

    python benchmarks/gpu_direct_restore.py --out OUT [--tokens 32768,131072] [--chunk 256]
    python benchmarks/gpu_direct_restore.py --device cpu --geometry tiny --tokens 2048   # a CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

import torch

from adpkv_core.client import GatewayClient
from adpkv_core.direct_map import DirectMaps, cuda_registrar
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops.spawn import GatewayProcess
from adpkv_vllm.common.copy import PagedLayer, ring_tensor
from gpu_restore import GEOMETRIES, build_model, log, pinned_bandwidth, prefill_seconds   # a sibling: benchmarks/ is on sys.path when run as a script

GiB = 1 << 30


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Cache:
    """The paged KV of one prompt (one tensor per layer) and the source it must equal."""

    def __init__(self, g: dict, tokens: int, block: int, chunk: int, device: str):
        self.nb = chunk // block
        self.chunks = tokens // chunk
        self.num_blocks = self.chunks * self.nb + 64
        shape = (2, self.num_blocks, block, g["kv_heads"], g["head_dim"])
        self.kv = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(g["layers"])]
        self.layers = [PagedLayer(f"layer.{i}", t, self.num_blocks) for i, t in enumerate(self.kv)]
        gen = torch.Generator().manual_seed(0)
        self.block_ids = torch.randperm(self.num_blocks, generator=gen)[: self.chunks * self.nb]
        self.dev_ids = self.block_ids.to(device)
        self.obj = self.layers[0].page_bytes * self.nb
        for t in self.kv:
            t.view(torch.int16).random_(-30000, 30000)
        self.source = [t[:, self.dev_ids].clone() for t in self.kv]      # what every restore must give back

    def refill(self) -> None:
        """The source back into the blocks (what a store must take)."""
        for t, s in zip(self.kv, self.source):
            t[:, self.dev_ids] = s

    def zero(self) -> None:
        for t in self.kv:
            t.zero_()

    def exact(self) -> bool:
        """Every restored block equal to the source, bit for bit (as int16: random bf16 bits hold
        NaNs, which no float comparison calls equal), compared on the device."""
        return all(torch.equal(t.view(torch.int16)[:, self.dev_ids], s.view(torch.int16))
                   for t, s in zip(self.kv, self.source))

    @property
    def nbytes(self) -> int:
        return self.obj * self.chunks * len(self.kv)


@contextlib.contextmanager
def gateway_on(card: str, args, log_name: str, **settings):
    """A real gateway process on a fresh fs card at ``card`` (the bench's ring, pool and I/O
    processes, plus ``settings``); stopped, its log kept under ``--out`` and the card removed
    after."""
    shutil.rmtree(card, ignore_errors=True)
    gw = GatewayProcess(card, shared_memory_size=args.ring_gib * GiB, thread_pool_size=args.threads,
                        io_processes=args.io_processes, log_path=card + ".log", **settings).start(timeout_s=120)
    try:
        yield gw
    finally:
        gw.stop(timeout_s=120)
        shutil.copy(card + ".log", os.path.join(args.out, log_name))
        shutil.rmtree(card, ignore_errors=True)


def keys_of(cache: Cache, kb: KeyBuilder, layer: int) -> list[bytes]:
    return kb.keys([b"chunk-%d" % c for c in range(cache.chunks)], [layer])


def store(client, ring, cache: Cache, kb, stream) -> None:
    futs = []
    for i, layer in enumerate(cache.layers):
        def fill(b, layer=layer):
            ids = cache.block_ids[b.first * cache.nb:(b.first + b.count) * cache.nb]
            layer.gather(ring, b.offset, b.stride, b.count, 0, cache.obj, ids, cache.nb, stream=stream)
        futs.append(client.put(keys_of(cache, kb, i), cache.obj, fill))
    if not all(all(f.result().stored) for f in futs):
        raise RuntimeError("store failed")


def ring_scatter(cache: Cache, ring, layer: PagedLayer, stream):
    """A GET's batch callback: the batch's objects scattered from the ring into ``layer``'s blocks."""
    def copy(b):
        ids = cache.block_ids[b.first * cache.nb:(b.first + b.count) * cache.nb]
        layer.scatter(ring, b.offset, b.stride, b.count, 0, cache.obj, ids, None, cache.nb, stream=stream)
    return copy


def ring_restore(client, ring, cache: Cache, kb, stream, device: str) -> float:
    futs = []
    t0 = time.perf_counter()
    for i, layer in enumerate(cache.layers):
        futs.append(client.get(keys_of(cache, kb, i), cache.obj, ring_scatter(cache, ring, layer, stream)))
    hits = [f.result().all_ok for f in futs]
    sync(device)
    t = time.perf_counter() - t0
    if not all(hits):
        raise RuntimeError("ring restore missed")
    return t


def direct_restore(client, maps: DirectMaps, cache: Cache, kb, stream, device: str) -> tuple[float, float]:
    """Every layer from its mappings, as the connector's worker does it (``_get_layer``): the
    layer's keys, ``acquire``; where a layer's objects are not all held they are MAPped first
    (``fetch``, timed apart: ``fetch_s``; the connector would take the ring then), then that
    layer's copies (asynchronous; each layer's mappings released once its copies' event has
    passed). (total seconds, of which fetching)."""
    t0 = time.perf_counter()
    fetch_s = 0.0
    held, dones, starts = [], [], []
    for i, layer in enumerate(cache.layers):
        keys = keys_of(cache, kb, i)
        got = maps.acquire(keys)
        if any(m is None for m in got):
            maps.release(got)
            t1 = time.perf_counter()
            if maps.fetch(client, keys, cache.obj) != len(keys):
                raise RuntimeError("MAP did not hand every object")
            fetch_s += time.perf_counter() - t1
            got = maps.acquire(keys)
        held.append(got)
        if stream is not None:
            starts.append(torch.cuda.Event(enable_timing=True))
            starts[-1].record(stream)
        dones.append(layer.load_objects(got, cache.dev_ids, cache.nb, stream=stream))
    sync(device)
    t = time.perf_counter() - t0
    for got in held:
        maps.release(got)
    if starts:      # each layer's copies (DMA on the stream, then its scatter), ms from the first's start
        LAST_LAYER_SPANS[:] = [(starts[0].elapsed_time(a), starts[0].elapsed_time(b)) for a, b in zip(starts, dones)]
    return t, fetch_s


def policy_restore(client, ring, maps: DirectMaps, cache: Cache, kb, stream, device: str) -> tuple[float, int]:
    """The connector's choice per layer (``worker._get_layer``): a layer whose objects are all
    held goes from the mappings, any other through the ring, its objects then mapped in the
    background (``prefetch``). (seconds until every layer is restored, layers from mappings);
    the background mapping goes on after."""
    t0 = time.perf_counter()
    futs, held, direct = [], [], 0
    for i, layer in enumerate(cache.layers):
        keys = keys_of(cache, kb, i)
        got = maps.acquire(keys)
        if all(m is not None for m in got):
            held.append(got)
            layer.load_objects(got, cache.dev_ids, cache.nb, stream=stream)
            direct += 1
            continue
        maps.release(got)

        fut = client.get(keys, cache.obj, ring_scatter(cache, ring, layer, stream))
        fut.add_done_callback(lambda _, keys=keys: maps.prefetch(client, keys, cache.obj))
        futs.append(fut)
    hits = [f.result().all_ok for f in futs]
    sync(device)
    t = time.perf_counter() - t0
    for got in held:
        maps.release(got)
    if not all(hits):
        raise RuntimeError("ring restore missed")
    return t, direct


LAST_LAYER_SPANS: list[tuple[float, float]] = []      # direct_restore's last per-layer stream times (ms)


def plot_timeline(spans: list[tuple[float, float]], title: str, path: str) -> None:
    """One bar per layer: when its copies ran on the connector's stream."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (a, b) in enumerate(spans):
        ax.barh(i, b - a, left=a, height=0.8, color="tab:blue")
    ax.set_xlabel("ms since the first layer's copies began (CUDA events on the copy stream)")
    ax.set_ylabel("layer")
    ax.set_title(title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def partial_direct_restore(client, maps: DirectMaps, cache: Cache, kb, stream, device: str) -> list[torch.Tensor]:
    """A direct restore that takes what MAP hands and leaves the rest (an eviction racing it):
    per layer, a bool tensor (one per object) of the objects copied."""
    held_of = []
    for i, layer in enumerate(cache.layers):
        keys = keys_of(cache, kb, i)
        maps.fetch(client, keys, cache.obj)
        got = maps.acquire(keys)
        present = [m for m in got if m is not None]
        if present:
            ids = torch.cat([cache.dev_ids[j * cache.nb:(j + 1) * cache.nb] for j, m in enumerate(got) if m is not None])
            layer.load_objects(present, ids, cache.nb, stream=stream)
        sync(device)
        maps.release(got)
        held_of.append(torch.tensor([m is not None for m in got], device=device))
    return held_of


def check_partial(cache: Cache, held_of: list[torch.Tensor]) -> tuple[int, int, bool]:
    """(objects restored, objects missed, every restored block equal to its source and every
    missed block still zero), compared bit for bit on the device."""
    ok = True
    for t, src, held in zip(cache.kv, cache.source, held_of):
        got = t.view(torch.int16)[:, cache.dev_ids]
        same = (got == src.view(torch.int16)).reshape(2, cache.chunks, -1).all(-1).all(0)
        untouched = (got == 0).reshape(2, cache.chunks, -1).all(-1).all(0)
        ok = ok and bool(torch.where(held, same, untouched).all())
    restored = int(sum(int(h.sum()) for h in held_of))
    return restored, sum(h.numel() for h in held_of) - restored, ok


def eviction_race(tokens: int, args, report: dict) -> None:
    """Direct restores while the card evicts the prompt: a card of 1.3x the prompt's KV, other
    objects stored (0.6x the KV a round, in flight on the same client: one engine a gateway)
    while the restore maps and copies.
    What MAP hands stays the bytes stored (a mapping holds its file's inode; eviction unlinks
    names); what it no longer finds is a miss. Every restored block compared with its source,
    every missed block checked untouched."""
    g = GEOMETRIES[args.geometry]
    device = args.device
    card = os.path.join(args.card_root, f"card-evict-{tokens}")
    cache = Cache(g, tokens, args.block, args.chunk, device)
    row: dict = {"tokens": tokens, "kv_GiB": cache.nbytes / GiB, "rounds": []}
    registrar = cuda_registrar() if device == "cuda" else None
    with gateway_on(card, args, f"gateway-evict-{tokens}.log", capacity_bytes=int(cache.nbytes * 1.3)) as gw:
        client = GatewayClient(ClientConfig(port=gw.port, timeout_s=600), f"direct-evict-{tokens}")
        ring = ring_tensor(client)
        stream = torch.cuda.Stream() if device == "cuda" else None
        kb = KeyBuilder(f"direct-evict-{tokens}")
        churn_kb = KeyBuilder(f"direct-evict-churn-{tokens}")
        per_round = int(cache.nbytes * 0.6) // cache.obj
        for rnd in range(args.evict_rounds):
            cache.refill()
            store(client, ring, cache, kb, stream)
            cache.zero()
            sync(device)
            churn_keys = churn_kb.keys([b"r%d-%d" % (rnd, i) for i in range(per_round)], [0])
            futs = [client.put(churn_keys[at:at + 256], cache.obj, lambda b: None)
                    for at in range(0, len(churn_keys), 256)]
            maps = DirectMaps(int(cache.nbytes * 1.25) + GiB, registrar, require_registration=device == "cuda")
            t0 = time.perf_counter()
            held_of = partial_direct_restore(client, maps, cache, kb, stream, device)
            t = time.perf_counter() - t0
            churned = sum(sum(f.result().stored) for f in futs)
            maps.close()
            restored, missed, ok = check_partial(cache, held_of)
            row["rounds"].append({"restored": restored, "missed": missed, "exact": ok, "s": t, "churned": churned})
            log(f"{tokens} tokens eviction race {rnd}: {restored} objects restored, {missed} missed (evicted), "
                f"{churned} objects stored meanwhile, {t:.3f} s; restored bytes equal and missed blocks "
                f"untouched: {ok}")
            if not ok:
                raise RuntimeError("eviction race: a restored block differs from its source")
        del ring
        client.close()
    report.setdefault("eviction_race", []).append(row)
    del cache
    if device == "cuda":
        torch.cuda.empty_cache()


def drop_files(card: str) -> int:
    """posix_fadvise(DONTNEED) on every object file of the card: out of the page cache."""
    n = 0
    os.sync()
    for d, _, names in os.walk(card):
        for name in names:
            if name.endswith(".json") or name.startswith("."):
                continue
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def run(tokens: int, args, report: dict) -> None:
    g = GEOMETRIES[args.geometry]
    device = args.device
    row: dict = {"tokens": tokens, "geometry": args.geometry, "chunk": args.chunk}
    card = os.path.join(args.card_root, f"card-{tokens}-{args.chunk}")
    cache = Cache(g, tokens, args.block, args.chunk, device)
    gb = cache.nbytes / 1e9
    row["kv_GiB"] = cache.nbytes / GiB
    row["object_bytes"] = cache.obj
    registrar = cuda_registrar() if device == "cuda" else None
    with gateway_on(card, args, f"gateway-direct-{tokens}.log") as gw:
        client = GatewayClient(ClientConfig(port=gw.port, timeout_s=600), f"direct-bench-{tokens}")
        ring = ring_tensor(client)
        if device == "cuda":
            from adpkv_vllm.common.cuda_ring import pin_ring
            row["ring_pinned"] = pin_ring(ring)
        stream = torch.cuda.Stream() if device == "cuda" else None
        kb = KeyBuilder(f"direct-bench-{tokens}-{args.chunk}")
        store(client, ring, cache, kb, stream)

        def measure(name: str, fn) -> None:
            cache.zero()
            sync(device)
            out = fn()
            t, fetch_s = out if isinstance(out, tuple) else (out, None)
            ok = cache.exact()
            row.setdefault(f"{name}_all_s", []).append(t)
            row[f"{name}_s"] = sorted(row[f"{name}_all_s"])[(len(row[f"{name}_all_s"]) - 1) // 2]
            row[f"{name}_exact"] = row.get(f"{name}_exact", True) and ok
            if fetch_s is not None:
                row[f"{name}_fetch_s"] = fetch_s
            log(f"{tokens} tokens {name}: {t:.3f} s ({gb / t:.1f} GB/s)"
                + (f", of which MAP+mmap+register {fetch_s:.3f} s" if fetch_s is not None else "")
                + f", every byte equal: {ok}")
            if not ok:
                raise RuntimeError(f"{name}: restored bytes differ from the source")

        limit = int(cache.nbytes * 1.25) + GiB
        for _ in range(args.repeats):
            measure("ring_hot", lambda: ring_restore(client, ring, cache, kb, stream, device))
        for _ in range(args.repeats):
            maps = DirectMaps(limit, registrar, require_registration=device == "cuda")
            measure("direct_cold_reg", lambda: direct_restore(client, maps, cache, kb, stream, device))
            if _ == args.repeats - 1:
                break
            maps.close()
        for _ in range(args.repeats):
            measure("direct_warm", lambda: direct_restore(client, maps, cache, kb, stream, device))
        if LAST_LAYER_SPANS:
            row["direct_warm_layers_ms"] = list(LAST_LAYER_SPANS)
            if args.timeline:
                path = os.path.join(args.out, f"timeline-direct-{tokens}.png")
                plot_timeline(LAST_LAYER_SPANS, f"copy-free restore, {tokens} tokens ({gb:.1f} GB): "
                              f"{row['direct_warm_all_s'][-1]:.3f} s", path)
                log(f"timeline: {path}")
        row["direct_stats"] = maps.stats()
        log(f"{tokens} tokens direct maps: {row['direct_stats']}")
        maps.close()
        row["dropped_files"] = drop_files(card)
        measure("ring_cold", lambda: ring_restore(client, ring, cache, kb, stream, device))
        drop_files(card)
        maps = DirectMaps(limit, registrar, require_registration=device == "cuda")
        measure("direct_cold", lambda: direct_restore(client, maps, cache, kb, stream, device))
        maps.close()
        # the connector's choice per layer, cold: every layer through the ring, mapped after it
        drop_files(card)
        maps = DirectMaps(limit, registrar, require_registration=device == "cuda")
        cache.zero()
        sync(device)
        t, direct = policy_restore(client, ring, maps, cache, kb, stream, device)
        t1 = time.perf_counter()
        maps.drain(600)
        row["policy_cold_s"], row["policy_cold_direct_layers"] = t, direct
        row["policy_cold_mapping_after_s"] = t + time.perf_counter() - t1
        row["policy_cold_exact"] = cache.exact()
        cache.zero()
        sync(device)
        t, direct = policy_restore(client, ring, maps, cache, kb, stream, device)
        row["policy_next_s"], row["policy_next_direct_layers"] = t, direct
        row["policy_next_exact"] = cache.exact()
        log(f"{tokens} tokens connector's choice, cold: {row['policy_cold_s']:.3f} s ({row['policy_cold_direct_layers']}"
            f" layers from mappings; mapped in the background {row['policy_cold_mapping_after_s']:.3f} s after the start); "
            f"the next restore {row['policy_next_s']:.3f} s ({row['policy_next_direct_layers']} layers from mappings); "
            f"every byte equal: {row['policy_cold_exact'] and row['policy_next_exact']}")
        maps.close()
        if not (row["policy_cold_exact"] and row["policy_next_exact"]):
            raise RuntimeError("connector's choice: restored bytes differ from the source")
        if device == "cuda":
            from adpkv_vllm.common.cuda_ring import unpin_ring
            unpin_ring(ring)
        del ring
        client.close()
    if report.get("pinned_h2d_GBs"):
        row["direct_warm_vs_pinned"] = gb / row["direct_warm_s"] / report["pinned_h2d_GBs"]
    row["direct_warm_vs_ring_hot"] = row["ring_hot_s"] / row["direct_warm_s"]
    if tokens in report.get("prefill_s", {}):
        row["prefill_s"] = report["prefill_s"][tokens]
        row["prefill_over_direct_warm"] = row["prefill_s"] / row["direct_warm_s"]
        row["prefill_over_ring_hot"] = row["prefill_s"] / row["ring_hot_s"]
    report["runs"].append(row)
    del cache
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-direct-out")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--geometry", default="llama3-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--card-root", default="/tmp/adpkv-direct-bench")
    ap.add_argument("--ring-gib", type=int, default=8)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--io-processes", type=int, default=15)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256, help="tokens per stored object (256: 1 MiB a layer)")
    ap.add_argument("--repeats", type=int, default=3, help="hot restores of each kind (median reported)")
    ap.add_argument("--evict-rounds", type=int, default=3,
                    help="rounds of direct restores racing an eviction of the prompt (0: none)")
    ap.add_argument("--evict-tokens", type=int, default=32768, help="the prompt length of the eviction race")
    ap.add_argument("--skip-prefill", action="store_true", help="no prefill peer (it needs transformers)")
    ap.add_argument("--timeline", action="store_true", help="a PNG of the last warm direct restore's layers")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.card_root, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "cpus": os.cpu_count(), "args": vars(args), "runs": []}
    if args.device == "cuda":
        report["pinned_h2d_GBs"] = pinned_bandwidth()["h2d_1024MiB_GBs"]
        log(f"pinned H2D (1 GiB copies): {report['pinned_h2d_GBs']:.1f} GB/s")
    counts = [int(t) for t in args.tokens.split(",")]
    if args.device == "cuda" and not args.skip_prefill:
        g = GEOMETRIES[args.geometry]
        model = build_model(g)
        report["prefill_s"] = {}
        for tokens in counts:
            report["prefill_s"][tokens] = prefill_seconds(model, tokens, g["vocab"])
            log(f"prefill {tokens} tokens: {report['prefill_s'][tokens]:.2f} s")
        del model
        torch.cuda.empty_cache()
    for tokens in counts:
        run(tokens, args, report)
        with open(os.path.join(args.out, "gpu_direct_restore.json"), "w") as fh:
            json.dump(report, fh, indent=1)
    if args.evict_rounds:
        eviction_race(args.evict_tokens, args, report)
        with open(os.path.join(args.out, "gpu_direct_restore.json"), "w") as fh:
            json.dump(report, fh, indent=1)
    for r in report["runs"]:
        log(f"SUMMARY {r['tokens']} tokens ({r['kv_GiB']:.0f} GiB, objects {r['object_bytes'] >> 10} KiB): "
            + ", ".join(f"{k[:-2]} {r[k]:.3f} s" for k in ("ring_hot_s", "direct_cold_reg_s", "direct_warm_s",
                                                           "ring_cold_s", "direct_cold_s"))
            + (f"; direct warm = {r['direct_warm_vs_pinned']:.2f} of pinned H2D" if "direct_warm_vs_pinned" in r
               else "") + f", {r['direct_warm_vs_ring_hot']:.2f}x the ring"
            + f"; connector's choice cold {r['policy_cold_s']:.3f} s (ring cold {r['ring_cold_s']:.3f} s)"
        + (f"; prefill {r['prefill_s']:.2f} s = {r['prefill_over_direct_warm']:.1f}x direct warm, "
               f"{r['prefill_over_ring_hot']:.1f}x ring hot" if "prefill_s" in r else ""))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
