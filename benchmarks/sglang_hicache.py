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

    def __init__(self, pool, port, cfg_factory):
        from adpkv_sglang import AdpHiCacheStorage
        self.backend = AdpHiCacheStorage(cfg_factory({"port": port, "model_id": "llama-3-8b",
                                                      "interface_v1": 1, "timeout_s": 120}), {})
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("sglang", "adpkv"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from sgl_pools import mha_pool, storage_config
    from adpkv_gateway.spawn import GatewayProcess

    root = os.path.abspath(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    card, fdir = os.path.join(root, "card"), os.path.join(root, "hicache-file")
    os.makedirs(fdir)

    pool = mha_pool("page_first", layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                    page=args.page_size, pages=2 * args.pages + 2)
    P = pool.page_size
    page_bytes = 2 * args.layers * args.heads * args.head_dim * 2 * P
    src = torch.arange(0, args.pages * P, dtype=torch.int64)
    dst = torch.arange(args.pages * P, 2 * args.pages * P, dtype=torch.int64)
    kv = pool.kv_buffer                      # (2, tokens, layers, heads, dim)
    raw = kv.view(torch.int16)               # compare bits (random bf16 holds NaNs)
    kv.view(torch.int16)[:, : args.pages * P].random_(-32768, 32767)
    nbytes = args.pages * page_bytes

    def cfg(extra):
        return storage_config(extra, model_name="meta-llama/Meta-Llama-3-8B", layout="page_first")

    settings = {"shared_memory_size": args.ring_mib << 20, "o_direct": bool(args.o_direct)}
    gw = GatewayProcess([card], log_path=os.path.join(root, "gateway.log"), **settings).start()
    results = {"adpkv": {"set": [], "hot": [], "cold": []}, "HiCacheFile": {"set": [], "hot": [], "cold": []}}
    drop_how = "-"
    try:
        drivers = [OursDriver(pool, gw.port, cfg), FileDriver(pool, fdir, cfg)]
        print(f"pool: page_first, {args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, "
              f"page {P} = {page_bytes / 2**20:.0f} MiB; {args.pages} pages ({nbytes / 2**30:.2f} GiB) a run, "
              f"batches of {args.batch}; gateway ring {args.ring_mib} MiB, o_direct={bool(args.o_direct)}")
        print(f"reference: memcpy {memcpy_gbs():.2f} GB/s, disk O_DIRECT read "
              f"{disk_odirect_read_gbs(root):.2f} GB/s")
        for rep in range(args.reps):
            order = drivers if rep % 2 == 0 else drivers[::-1]
            for d in order:
                keys = [uuid.uuid4().hex * 2 for _ in range(args.pages)]   # fresh page hashes
                t = time.perf_counter()
                run_batches(d.set, keys, src, P, args.batch)
                t_set = time.perf_counter() - t
                for regime in ("hot", "cold"):
                    if regime == "cold":
                        if args.no_cold:
                            continue
                        drop_how = drop_page_cache([card, fdir])
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
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nmedian GB/s over {args.reps} runs [min-max]   (cold: page cache dropped by {drop_how})")
    summary = {}
    for op in ("set", "hot", "cold"):
        a, f = results["adpkv"][op], results["HiCacheFile"][op]
        if not a:
            continue
        ma, mf = statistics.median(a), statistics.median(f)
        summary[op] = {"adpkv": ma, "HiCacheFile": mf, "ratio": ma / mf}
        label = {"set": "batch set", "hot": "get, hot", "cold": "get, cold"}[op]
        print(f"{label:10s} adpkv {ma:6.2f} [{min(a):.2f}-{max(a):.2f}]   HiCacheFile {mf:6.2f} "
              f"[{min(f):.2f}-{max(f):.2f}]   ratio {ma / mf:5.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "runs": results, "median": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
