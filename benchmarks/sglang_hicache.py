"""adpkv's SGLang HiCache backend vs SGLang's built-in ``HiCacheFile`` on the same disk.

One real SGLang host pool (``MHATokenToKVPoolHost``, CPU) with the Llama-3-8B
geometry (32 layers, 8 KV heads, head dim 128, bf16; page size 64: 8 MiB a page,
layout ``page_first``). Each backend is driven through the calls SGLang's cache
controller makes, in batches of at most 128 pages:

- ours (``interface_v1``): ``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1``
  straight between the pool pages and the gateway's ring;
- ``HiCacheFile`` (generic path, the controller's ``_generic_page_set`` /
  ``_generic_page_get``): ``get_data_page`` per page + ``batch_set``; a dummy flat
  page per key + ``batch_get`` + ``set_from_flat_data_page``.

Per repetition and backend (the order alternates): set of fresh pages, get with the
page cache hot, get cold (page cache dropped: ``echo 3 > /proc/sys/vm/drop_caches``
after ``sync``, or ``posix_fadvise(DONTNEED)`` on every file where that is not
permitted). Every restored page is compared with the original. Reference lines:
the disk's O_DIRECT read and a single-thread memcpy. Medians and ranges over the
repetitions are printed, with the ratios ours / HiCacheFile.

    python benchmarks/sglang_hicache.py [--pages 128] [--reps 3] [--dir /var/tmp/adpkv-bench]

``--hybrid``: a Qwen3-Next-like hybrid through SGLang's storage v2 (one rank of TP 4 of
Qwen3-Next-80B-A3B: 12 full-attention layers' KV pages, page 64 = 0.75 MiB, and one Mamba
state of the 36 linear-attention layers, 18.4 MiB, per page group). Both backends are
driven by SGLang's own ``HybridCacheController`` storage methods (``_page_backup``,
``_storage_hit_query``, ``_page_transfer``; the object is made without its GPU ``__init__``):
ours with ``interface_v1`` (KV pages by ``batch_*_v1``, the state by ``batch_*_v2``),
``HiCacheFile`` (SGLang's v2-capable file backend) as SGLang runs it (KV pages by the
generic path, the state by its ``batch_*_v2``). ``--groups`` page groups (requests) of
``--group-pages`` pages each per repetition; every KV page and state restored is compared.

    python benchmarks/sglang_hicache.py --hybrid [--groups 6] [--group-pages 32] [--reps 3]

Both modes also run ``adpkv-shm`` (unless ``--no-shm``): ours on pools allocated in shared
memory (SGLang's ``ShmHostTensorAllocator``, extra config ``"allocator": "shm"``), whose
pages the gateway reads and writes in place through region GET/PUT (no ring, no copy in
the engine). The ratios are each of ours against each peer, in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import time
import uuid

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "sglang"))

GB = 1e9


def _fadvise_dontneed(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def drop_page_cache(roots) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for r in roots:
            _fadvise_dontneed(r)
        return "fadvise"


def disk_odirect_read_gbs(root: str, size: int = 1 << 30, chunk: int = 8 << 20) -> float:
    path = os.path.join(root, "odirect-probe.bin")
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for _ in range(size // chunk):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        off = 0
        while off < size:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            off += n
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)
    return size / dt / GB


def memcpy_gbs(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(2)
    memmove = ctypes.CDLL(None).memmove
    memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        memmove(b.data_ptr(), a.data_ptr(), nbytes)
        best = max(best, nbytes / (time.perf_counter() - t) / GB)
    return best


# ------------------------------------------------------------------------ drivers
class OursDriver:
    name = "adpkv"

    def __init__(self, pool, port, cfg_factory, shm: bool = False):
        from adpkv_sglang import AdpHiCacheStorage
        extra = {"port": port, "model_id": "llama-3-8b", "interface_v1": 1, "timeout_s": 120}
        if shm:                  # the pool is in shared memory: the gateway moves its pages in place
            self.name = "adpkv-shm"
            extra["allocator"] = "shm"
        self.backend = AdpHiCacheStorage(cfg_factory(extra), {})
        self.backend.register_mem_pool_host(pool)
        self.pool = pool

    def set(self, keys, host_indices):
        return all(self.backend.batch_set_v1(keys, host_indices))

    def get(self, keys, host_indices):
        hit = self.backend.batch_exists(keys)
        if hit != len(keys):
            return hit
        res = self.backend.batch_get_v1(keys, host_indices)
        return res.index(False) if False in res else len(res)

    def close(self):
        self.backend.close()


class FileDriver:
    name = "HiCacheFile"

    def __init__(self, pool, root, cfg_factory):
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
        self.backend = HiCacheFile(cfg_factory({"file_storage_path": root}))
        self.backend.register_mem_pool_host(pool)
        self.pool = pool

    def set(self, keys, host_indices):
        p = self.pool.page_size
        data = [self.pool.get_data_page(host_indices[i * p]) for i in range(len(keys))]
        return self.backend.batch_set(keys, data)

    def get(self, keys, host_indices):
        hit = self.backend.batch_exists(keys)
        if hit != len(keys):
            return hit
        p = self.pool.page_size
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummy)
        n = 0
        for i in range(len(keys)):
            if pages[i] is None:
                break
            self.pool.set_from_flat_data_page(host_indices[i * p], pages[i])
            n += 1
        return n

    def close(self):
        pass


def run_batches(fn, keys, host_indices, page_size, batch):
    done = 0
    for s in range(0, len(keys), batch):
        k = keys[s:s + batch]
        r = fn(k, host_indices[s * page_size:(s + len(k)) * page_size])
        if r is False or (not isinstance(r, bool) and r != len(k)):
            raise RuntimeError(f"batch at page {s} failed ({r})")
        done += len(k)
    return done


# ------------------------------------------------------------------------ hybrid (storage v2)
QWEN3_NEXT = dict(
    # Qwen3-Next-80B-A3B, one rank of TP 4: 12 full-attention layers (1 KV head of 256 per rank,
    # bf16) and 36 Gated-DeltaNet layers, whose recurrent state is a Mamba pool slot: temporal
    # 8 heads x 128 x 128 fp32, conv 2048 channels x 3 bf16 (18.4 MiB a state)
    kv_layers=12, kv_heads=1, head_dim=256, mamba_layers=36, ssm_heads=8, ssm_head_dim=128,
    ssm_state=128, conv_dim=2048, conv_width=3)


class HybridRun:
    """One backend behind SGLang's HybridCacheController storage methods, on its own pools."""

    def __init__(self, name, backend, zero_copy, cfg, pools):
        from sgl_pools import host_group, hybrid_controller
        self.name = name
        self.backend = backend
        self.pools = pools
        group = host_group(**pools)
        backend.register_mem_pool_host(pools["kv"])           # as attach_storage_backend does
        for entry in group.entries:
            backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
        backend.on_host_pools_registered()
        self.c = hybrid_controller(backend, group, zero_copy=zero_copy, config=cfg)

    def backup(self, spans):
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation
        for sp in spans:
            t = PoolTransfer(name=PoolName.MAMBA, host_indices=sp.src_state, keys=[sp.hashes[-1]],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)
            op = StorageOperation(sp.src_kv, sp.tokens, hash_value=sp.hashes, pool_transfers=[t])
            self.c._page_backup(op)
            if op.completed_tokens != len(sp.tokens):
                raise SystemExit(f"{self.name}: backup stored {op.completed_tokens} of {len(sp.tokens)} tokens")

    def prefetch(self, spans):
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation
        for i, sp in enumerate(spans):
            t = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            op = PrefetchOperation(CacheRequestHandle(rid=f"r{i}", attempt_id=0), sp.tokens, pool_transfers=[t])
            hit_hashes, hit_tokens = self.c._storage_hit_query(op)
            if hit_tokens != len(sp.tokens):
                raise SystemExit(f"{self.name}: hit query found {hit_tokens} of {len(sp.tokens)} tokens")
            op.hash_value = hit_hashes
            op.host_indices = sp.dst_kv
            t.host_indices = sp.dst_state
            self.c._page_transfer(op)
            acks = [self.c.prefetch_sync_queue.get_nowait() for _ in range(self.c.prefetch_sync_queue.qsize())]
            done = max((a.completed_tokens or 0) for a in acks)
            state = sum((a.pool_hits or {}).get(PoolName.MAMBA, 0) for a in acks if getattr(a, "pool_hits", None))
            if done != len(sp.tokens) or state != 1:
                raise SystemExit(f"{self.name}: prefetch loaded {done} tokens, {state} states")


def hf3fs_mock(pools, cfg, path: str, pages: int):
    """SGLang's HiCacheHF3FS on its file-backed mock client (``Hf3fsMockClient``: pread/pwrite
    of one local file; the real client needs a 3FS cluster), with the local metadata client,
    sized as SGLang's factory sizes it (``bytes_per_page`` from the KV pool)."""
    from sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server import Hf3fsLocalMetadataClient
    from sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs import HiCacheHF3FS
    kv = pools["kv"]
    bytes_per_page = kv.get_ksize_per_token() * kv.page_size
    os.makedirs(path, exist_ok=True)
    state = pools["mamba"].get_ksize_per_token()
    return HiCacheHF3FS(rank=0, file_path=os.path.join(path, "hicache.0.bin"),
                        file_size=max(2 * pages * bytes_per_page, pages * state), numjobs=4,
                        bytes_per_page=bytes_per_page, entries=8, client_timeout=60, dtype=kv.dtype,
                        metadata_client=Hf3fsLocalMetadataClient(), is_page_first_layout=True,
                        use_mock_client=True)


def run_hybrid(args, root, card, fdir) -> int:
    """KV pages + one Mamba state per page group, through storage v2, adpkv vs HiCacheFile."""
    from types import SimpleNamespace
    from sgl_pools import mamba_pool, mha_pool, storage_config
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from adpkv_gateway.ops.spawn import GatewayProcess
    from adpkv_sglang import AdpHiCacheStorage

    g = QWEN3_NEXT
    P, G, n = args.page_size, args.groups, args.group_pages
    tokens_per_group = n * P

    def make_pools(allocator="default"):
        kv = mha_pool("page_first", layers=g["kv_layers"], heads=g["kv_heads"], head_dim=g["head_dim"], page=P,
                      pages=2 * G * n + 2, allocator=allocator)
        m = mamba_pool(slots=2 * G + 2, layers=g["mamba_layers"], heads=g["ssm_heads"], head_dim=g["ssm_head_dim"],
                       state_dim=g["ssm_state"], conv_dim=g["conv_dim"], conv_width=g["conv_width"],
                       allocator=allocator)
        return {"kv": kv, "mamba": m}

    def cfg(extra):
        return storage_config(extra, model_name="Qwen/Qwen3-Next-80B-A3B", layout="page_first")

    gw = GatewayProcess([card], log_path=os.path.join(root, "gateway.log"),
                        shared_memory_size=args.ring_mib << 20, o_direct=bool(args.o_direct)).start()
    runs = []
    gw_shm = None
    try:
        ours_cfg = cfg({"port": gw.port, "model_id": "qwen3-next", "interface_v1": 1, "timeout_s": 120})
        file_cfg = cfg({"file_storage_path": fdir})
        runs = [HybridRun("adpkv", AdpHiCacheStorage(ours_cfg, {}), True, ours_cfg, make_pools())]
        if not args.no_shm:     # a gateway of its own (one engine a gateway), its card on the same disk
            gw_shm = GatewayProcess([card + "-shm"], log_path=os.path.join(root, "gateway-shm.log"),
                                    shared_memory_size=args.ring_mib << 20, o_direct=bool(args.o_direct)).start()
            shm_cfg = cfg({"port": gw_shm.port, "model_id": "qwen3-next", "interface_v1": 1, "timeout_s": 120,
                           "allocator": "shm"})
            runs.append(HybridRun("adpkv-shm", AdpHiCacheStorage(shm_cfg, {}), True, shm_cfg, make_pools("shm")))
        runs.append(HybridRun("HiCacheFile", HiCacheFile(file_cfg), False, file_cfg, make_pools()))
        if args.hf3fs_mock:
            pools = make_pools()
            hf_cfg = cfg({"use_mock_hf3fs_client": True})
            runs.append(HybridRun("HF3FS-mock", hf3fs_mock(pools, hf_cfg, os.path.join(root, "hf3fs"),
                                                           args.reps * G * (n + 32)), True, hf_cfg, pools))
        kv_page = runs[0].backend.kv.io.page_bytes
        state = runs[0].backend.pools["mamba"].io.page_bytes
        nbytes = G * (n * kv_page + state)
        print(f"hybrid (Qwen3-Next-80B-A3B, TP 4 rank): {g['kv_layers']} KV layers x {g['kv_heads']} head x "
              f"{g['head_dim']} bf16, page {P} = {kv_page / 2**20:.2f} MiB; Mamba state of {g['mamba_layers']} layers "
              f"= {state / 2**20:.2f} MiB; {G} page groups of {n} pages + 1 state = {nbytes / 2**30:.2f} GiB a run")
        print(f"reference: memcpy {memcpy_gbs():.2f} GB/s, disk O_DIRECT read {disk_odirect_read_gbs(root):.2f} GB/s")
        results = {r.name: {"set": [], "hot": [], "cold": []} for r in runs}
        roots = [card, card + "-shm", fdir] + ([os.path.join(root, "hf3fs")] if args.hf3fs_mock else [])
        drop_how = "-"
        for rep in range(args.reps):
            for r in (runs if rep % 2 == 0 else runs[::-1]):
                kv, mam = r.pools["kv"], r.pools["mamba"]
                spans = []
                for i in range(G):
                    tok = [int(x) for x in torch.randint(0, 32000, (tokens_per_group,))]
                    spans.append(SimpleNamespace(
                        tokens=tok, hashes=get_storage_hash_str(tok, None, page_size=P),
                        src_kv=torch.arange(i * n * P, (i + 1) * n * P), dst_kv=torch.arange((G + i) * n * P, (G + i + 1) * n * P),
                        src_state=torch.tensor([i]), dst_state=torch.tensor([G + i])))
                kv.kv_buffer.view(torch.int16)[:, : G * n * P].random_(-32768, 32767)
                for b in (mam.temporal_buffer, *mam.conv_buffer):
                    b.view(torch.int16)[:G].random_(-32768, 32767)
                t = time.perf_counter()
                r.backup(spans)
                results[r.name]["set"].append(nbytes / (time.perf_counter() - t) / GB)
                for regime in ("hot", "cold"):
                    if regime == "cold":
                        if args.no_cold:
                            continue
                        drop_how = drop_page_cache(roots)
                    kv.kv_buffer[:, G * n * P: 2 * G * n * P].zero_()
                    for b in (mam.temporal_buffer, *mam.conv_buffer):
                        b[G: 2 * G].zero_()
                    t = time.perf_counter()
                    r.prefetch(spans)
                    results[r.name][regime].append(nbytes / (time.perf_counter() - t) / GB)
                    raw = kv.kv_buffer.view(torch.int16)
                    same = torch.equal(raw[:, : G * n * P], raw[:, G * n * P: 2 * G * n * P]) and all(
                        torch.equal(b.view(torch.int16)[:G], b.view(torch.int16)[G: 2 * G])
                        for b in (mam.temporal_buffer, *mam.conv_buffer))
                    if not same:
                        raise SystemExit(f"{r.name}: restored pages or states differ from the originals ({regime})")
                res = results[r.name]
                print(f"rep {rep} {r.name:12s} set {res['set'][-1]:6.2f}  hot get {res['hot'][-1]:6.2f}  cold get "
                      f"{res['cold'][-1] if res['cold'] else float('nan'):6.2f} GB/s", flush=True)
    finally:
        for r in runs:
            if hasattr(r.backend, "close"):
                r.backend.close()
        gw.stop()
        if gw_shm is not None:
            gw_shm.stop()
    return summarize(results, args, drop_how)


def summarize(results, args, drop_how) -> int:
    """Medians and ranges; ratios of each of ours (``adpkv``, ``adpkv-shm``) to each peer."""
    names = list(results)
    ours = [n for n in names if n.startswith("adpkv")]
    peers = [n for n in names if n not in ours]
    print(f"\nmedian GB/s over {args.reps} runs [min-max]   (cold: page cache dropped by {drop_how})")
    summary = {}
    for op in ("set", "hot", "cold"):
        if not results[ours[0]][op]:
            continue
        summary[op] = {}
        for mine in ours:
            a = results[mine][op]
            ma = statistics.median(a)
            summary[op][mine] = ma
            line = f"{ {'set': 'batch set', 'hot': 'get, hot', 'cold': 'get, cold'}[op]:10s} {mine:9s} " \
                   f"{ma:6.2f} [{min(a):.2f}-{max(a):.2f}]"
            for peer in peers:
                f = results[peer][op]
                mf = statistics.median(f)
                summary[op][peer] = mf
                summary[op][f"ratio_{mine}_{peer}"] = ma / mf
                line += f"   {peer} {mf:6.2f} [{min(f):.2f}-{max(f):.2f}] ratio {ma / mf:5.2f}x"
            print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "runs": results, "median": summary}, fh, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per repetition (8 MiB each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="pages per storage call (SGLang: 128)")
    ap.add_argument("--dir", default="/var/tmp/adpkv-bench-sglang", help="a directory on the disk to test")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--ring-mib", type=int, default=1024, help="gateway shared_memory_size")
    ap.add_argument("--o-direct", action="store_true", help="the gateway's fs card uses O_DIRECT")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--hybrid", action="store_true",
                    help="Qwen3-Next-like hybrid through storage v2: KV pages + one Mamba state per page group")
    ap.add_argument("--groups", type=int, default=6, help="--hybrid: page groups (requests) a run")
    ap.add_argument("--group-pages", type=int, default=32, help="--hybrid: KV pages per page group")
    ap.add_argument("--no-shm", action="store_true",
                    help="leave out adpkv-shm (host pools in shared memory, \"allocator\": \"shm\": the gateway "
                         "reads and writes the pool pages in place)")
    ap.add_argument("--hf3fs-mock", action="store_true",
                    help="--hybrid: also SGLang's HiCacheHF3FS on its file-backed mock client")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("sglang", "adpkv"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from sgl_pools import mha_pool, storage_config
    from adpkv_gateway.ops.spawn import GatewayProcess

    root = os.path.abspath(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    card, fdir = os.path.join(root, "card"), os.path.join(root, "hicache-file")
    os.makedirs(fdir)
    if args.hybrid:
        try:
            return run_hybrid(args, root, card, fdir)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def make_pool(allocator="default"):
        p = mha_pool("page_first", layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                     page=args.page_size, pages=2 * args.pages + 2, allocator=allocator)
        p.kv_buffer.view(torch.int16)[:, : args.pages * args.page_size].random_(-32768, 32767)
        return p

    pool = make_pool()
    P = pool.page_size
    page_bytes = 2 * args.layers * args.heads * args.head_dim * 2 * P
    src = torch.arange(0, args.pages * P, dtype=torch.int64)
    dst = torch.arange(args.pages * P, 2 * args.pages * P, dtype=torch.int64)
    nbytes = args.pages * page_bytes

    def cfg(extra):
        return storage_config(extra, model_name="meta-llama/Meta-Llama-3-8B", layout="page_first")

    settings = {"shared_memory_size": args.ring_mib << 20, "o_direct": bool(args.o_direct)}
    gw = GatewayProcess([card], log_path=os.path.join(root, "gateway.log"), **settings).start()
    drop_how = "-"
    gw_shm = None
    try:
        drivers = [OursDriver(pool, gw.port, cfg)]
        if not args.no_shm:     # a gateway of its own (one engine a gateway), its card on the same disk
            gw_shm = GatewayProcess([card + "-shm"], log_path=os.path.join(root, "gateway-shm.log"),
                                    **settings).start()
            drivers.append(OursDriver(make_pool("shm"), gw_shm.port, cfg, shm=True))
        drivers.append(FileDriver(pool, fdir, cfg))
        results = {d.name: {"set": [], "hot": [], "cold": []} for d in drivers}
        print(f"pool: page_first, {args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, "
              f"page {P} = {page_bytes / 2**20:.0f} MiB; {args.pages} pages ({nbytes / 2**30:.2f} GiB) a run, "
              f"batches of {args.batch}; gateway ring {args.ring_mib} MiB, o_direct={bool(args.o_direct)}")
        print(f"reference: memcpy {memcpy_gbs():.2f} GB/s, disk O_DIRECT read "
              f"{disk_odirect_read_gbs(root):.2f} GB/s")
        for rep in range(args.reps):
            order = drivers if rep % 2 == 0 else drivers[::-1]
            for d in order:
                kv = d.pool.kv_buffer                # (2, tokens, layers, heads, dim)
                raw = kv.view(torch.int16)           # compare bits (random bf16 holds NaNs)
                keys = [uuid.uuid4().hex * 2 for _ in range(args.pages)]   # fresh page hashes
                t = time.perf_counter()
                run_batches(d.set, keys, src, P, args.batch)
                t_set = time.perf_counter() - t
                for regime in ("hot", "cold"):
                    if regime == "cold":
                        if args.no_cold:
                            continue
                        drop_how = drop_page_cache([card, card + "-shm", fdir])
                    kv[:, args.pages * P: 2 * args.pages * P].zero_()
                    t = time.perf_counter()
                    run_batches(d.get, keys, dst, P, args.batch)
                    dt = time.perf_counter() - t
                    if not torch.equal(raw[:, : args.pages * P], raw[:, args.pages * P: 2 * args.pages * P]):
                        raise SystemExit(f"{d.name}: restored pages differ from the originals ({regime})")
                    results[d.name][regime].append(nbytes / dt / GB)
                results[d.name]["set"].append(nbytes / t_set / GB)
                print(f"rep {rep} {d.name:12s} set {nbytes / t_set / GB:6.2f}  hot get "
                      f"{results[d.name]['hot'][-1]:6.2f}  cold get "
                      f"{results[d.name]['cold'][-1] if results[d.name]['cold'] else float('nan'):6.2f} GB/s",
                      flush=True)
        for d in drivers:
            d.close()
    finally:
        gw.stop()
        if gw_shm is not None:
            gw_shm.stop()
        shutil.rmtree(root, ignore_errors=True)

    return summarize(results, args, drop_how)


if __name__ == "__main__":
    sys.exit(main())
