"""vLLM's own tiered offloading: its ``fs`` secondary tier vs ``AdpSecondaryTier``, side by side.

Both run under vLLM's real ``TieringOffloadingManager`` (built by vLLM's
``OffloadingSpecFactory`` from the ``kv_connector_extra_config`` JSON of
``TieringOffloadingSpec``) with a real CPU tier (the shared region in /dev/shm),
on the same disk, in one run, alternating which goes first in each round:

- store: rows written into the CPU tier (in place of vLLM's GPU->CPU DMA), then
  ``complete_store`` cascades them to the secondary tier in jobs of ``--job-rows``
  rows (one job per request and step, as the engine makes them); timed from the
  cascade to the last job's end (engine steps: ``on_schedule_end`` polled).
- load: the CPU tier is emptied (``reset_cache``), ``--total-mib`` of rows are looked
  up by ``total/job-rows`` requests at once (one promotion job each, as vLLM batches
  them per request and step); timed from the promotions' submission to the last
  job's end; then every row is compared byte for byte with what was stored.
  Page cache hot (right after the store) and dropped (``sync; echo 1 >
  /proc/sys/vm/drop_caches``, root only: reported as not run otherwise).
- lookup latency of a 16k-token prompt (16384 / tokens per row rows), CPU tier empty:
  from the first ``lookup`` to every row answered (HIT_PENDING), engine steps in a
  tight loop; median of ``--lookups`` prompts.

    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_tiering.py --dir /tmp/tiering-bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid

import numpy as np

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TOKENS_PER_BLOCK = 16


def offloading_config(extra: dict, row_bytes: int, blocks_per_chunk: int):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(32)),
                                      group_id=0),),
        worker_kv_bytes_per_block=row_bytes // blocks_per_chunk, enable_kv_cache_events=False,
        extra_config=extra, engine_id=uuid.uuid4().hex,
        model=OffloadingModelConfig(name="bench/llama-like", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def make_manager(tier: dict, cpu_bytes: int, row_bytes: int, blocks_per_chunk: int):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [tier]}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, row_bytes, blocks_per_chunk))
    return spec.get_manager()


class Rows:
    """What the GPU would have written: a few random patterns, each row stamped with its key."""

    def __init__(self, row_bytes: int, patterns: int = 8):
        rng = np.random.default_rng(0)
        self.patterns = [rng.integers(0, 256, row_bytes, dtype=np.uint8) for _ in range(patterns)]

    def write(self, dst: np.ndarray, key: bytes) -> None:
        dst[:] = self.patterns[key[0] % len(self.patterns)]
        dst[:len(key)] = np.frombuffer(key, dtype=np.uint8)

    def check(self, got: np.ndarray, key: bytes) -> bool:
        k = len(key)
        return bool((got[:k] == np.frombuffer(key, dtype=np.uint8)).all()
                    and (got[k:] == self.patterns[key[0] % len(self.patterns)][k:]).all())


STEP_S = 0.0002     # the pause between two engine steps (--step-ms)


def steps_until(m, done, timeout_s=600.0) -> float:
    from vllm.v1.kv_offload.base import ScheduleEndContext
    step = ScheduleEndContext((), ())
    t0 = time.perf_counter()
    while not done():
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError("timed out")
        m.on_schedule_end(step)
        time.sleep(STEP_S)
    return time.perf_counter() - t0


def view_of(m) -> np.ndarray:
    return np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8)


def do_store(m, keys, job_rows, rows: Rows) -> float:
    from vllm.v1.kv_offload.base import ReqContext
    view = view_of(m)
    jobs = []
    for j in range(0, len(keys), job_rows):
        ctx = ReqContext(f"store-{uuid.uuid4().hex[:8]}")
        m.on_new_request(ctx)
        out = m.prepare_store(keys[j:j + job_rows], ctx)
        assert out is not None and len(out.keys_to_store) == len(keys[j:j + job_rows])
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
            rows.write(view[int(c)], k)
        jobs.append((ctx, out.keys_to_store))
    t0 = time.perf_counter()
    for ctx, ks in jobs:
        m.complete_store(ks, ctx, True)            # the cascades to the secondary tier start
        m.on_request_finished(ctx)
    steps_until(m, lambda: not m.has_pending_work())
    seconds = time.perf_counter() - t0
    return seconds


def lookup_all(m, reqs):
    """One engine step: every request looks up its keys; True when none is RETRY."""
    from vllm.v1.kv_offload.base import LookupResult
    settled = True
    for ctx, ks in reqs:
        for k in ks:
            r = m.lookup(k, ctx)
            if r is LookupResult.RETRY:
                settled = False
            elif r is LookupResult.MISS:
                raise RuntimeError("a stored row was not found")
    return settled


def do_load(m, keys, job_rows, rows: Rows) -> tuple[float, float, int]:
    """(lookup seconds, load seconds, rows checked); CPU tier emptied first."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    m.reset_cache()
    reqs = []
    for j in range(0, len(keys), job_rows):
        ctx = ReqContext(f"load-{uuid.uuid4().hex[:8]}")
        m.on_new_request(ctx)
        reqs.append((ctx, keys[j:j + job_rows]))
    t0 = time.perf_counter()
    while not lookup_all(m, reqs):                 # lookups, one engine step at a time
        m.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(STEP_S)
    t_lookup = time.perf_counter() - t0
    t1 = time.perf_counter()
    m.on_schedule_end(ScheduleEndContext((), ()))  # the promotions are submitted
    steps_until(m, lambda: not m.has_pending_work())
    t_load = time.perf_counter() - t1
    view = view_of(m)
    checked = 0
    for ctx, ks in reqs:
        assert all(m.lookup(k, ctx) is LookupResult.HIT for k in ks), "a promoted row is not in the CPU tier"
        spec = m.prepare_load(ks, ctx)
        for k, c in zip(ks, spec.chunk_ids):
            if not rows.check(view[int(c)], k):
                raise RuntimeError(f"row of key {k.hex()[:16]} differs from the stored row")
            checked += 1
        m.complete_load(ks, ctx)
        m.on_request_finished(ctx)
    m.on_schedule_end(ScheduleEndContext((), ()))
    return t_lookup, t_load, checked


def prompt_lookup(m, keys) -> float:
    """Lookup latency of one prompt's rows with the CPU tier empty."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
    m.reset_cache()
    ctx = ReqContext(f"prompt-{uuid.uuid4().hex[:8]}")
    m.on_new_request(ctx)
    t0 = time.perf_counter()
    while not lookup_all(m, [(ctx, keys)]):
        m.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.0001)
    dt = time.perf_counter() - t0
    m.on_schedule_end(ScheduleEndContext((), ()))
    steps_until(m, lambda: not m.has_pending_work())
    m.on_request_finished(ctx)
    m.on_schedule_end(ScheduleEndContext((), ()))
    return dt


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def physical_limits(directory: str, nbytes: int, row: int, threads: int,
                    cores: int = os.cpu_count() or 2) -> dict[str, float]:
    """GB/s of the same bytes moved by plain system calls, on the same disk, in this run:
    the ceilings the two tiers work under. One file per row, as both tiers store them.

    memcpy: one core copying memory (numpy, both buffers touched first).
    write/read O_DIRECT: ``threads`` threads, one row per call straight from/into memory
      (what vLLM's ``fs`` tier does: the disk's DMA, no CPU copy).
    write/read page cache: ``cores`` threads (one a core), ``os.pwrite`` into new files /
      ``os.preadv`` of cached files: the CPU copy into or out of the page cache.
    read after a drop: ``threads`` threads, page cache dropped first (root only).
    region -> page cache / -> O_DIRECT: what a gateway that never maps the engine's region must
      do at least to store a row: ``os.preadv`` of the row from a /dev/shm file (the CPU tier's
      kind of file) into a per-thread buffer, then a buffered write into a new file (``cores`` threads) /
      an O_DIRECT write (``threads`` threads); no checksum.
    page cache -> region: what such a gateway must do at least to load a cached row: ``os.preadv``
      of a cached file into a per-thread buffer, ``os.pwrite`` into the /dev/shm file (``cores`` threads)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor
    n = nbytes // row
    lim_dir = os.path.join(directory, "limits")
    os.makedirs(lim_dir, exist_ok=True)
    src = mmap.mmap(-1, nbytes)
    dst = mmap.mmap(-1, nbytes)
    a, b = np.frombuffer(src, np.uint8), np.frombuffer(dst, np.uint8)
    a[:] = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    b[:] = 1
    out: dict[str, float] = {}

    def timed(name, fn, workers):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(fn, range(n)))
        out[name] = gbs(nbytes, time.perf_counter() - t0)

    t0 = time.perf_counter()
    b[:] = a
    out["memcpy"] = gbs(nbytes, time.perf_counter() - t0)
    view_src, view_dst = memoryview(src), memoryview(dst)

    def write(i, direct, tag):
        fd = os.open(os.path.join(lim_dir, f"{tag}{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                     | (os.O_DIRECT if direct else 0), 0o600)
        try:
            assert os.pwrite(fd, view_src[i * row:(i + 1) * row], 0) == row
        finally:
            os.close(fd)

    def read(i, direct, tag):
        fd = os.open(os.path.join(lim_dir, f"{tag}{i}"), os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            assert os.preadv(fd, [view_dst[i * row:(i + 1) * row]], 0) == row
        finally:
            os.close(fd)

    timed("write O_DIRECT", lambda i: write(i, True, "d"), threads)
    timed("write page cache", lambda i: write(i, False, "b"), cores)
    timed("read O_DIRECT", lambda i: read(i, True, "d"), threads)
    timed("read page cache", lambda i: read(i, False, "b"), cores)
    region_path = f"/dev/shm/adpkv-tiering-limits-{os.getpid()}"
    region_fd = os.open(region_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    bufs = threading.local()

    def buf() -> memoryview:
        if not hasattr(bufs, "view"):
            bufs.view = memoryview(mmap.mmap(-1, row))
        return bufs.view

    def from_region(i, direct, tag):
        view = buf()
        assert os.preadv(region_fd, [view], i * row) == row
        fd = os.open(os.path.join(lim_dir, f"{tag}{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                     | (os.O_DIRECT if direct else 0), 0o600)
        try:
            assert os.pwrite(fd, view, 0) == row
        finally:
            os.close(fd)

    def to_region(i):
        view = buf()
        fd = os.open(os.path.join(lim_dir, f"r{i}"), os.O_RDONLY)
        try:
            assert os.preadv(fd, [view], 0) == row
        finally:
            os.close(fd)
        assert os.pwrite(region_fd, view, i * row) == row

    try:
        for at in range(0, nbytes, 256 << 20):             # one write is at most 2 GiB - 4 KiB
            assert os.pwrite(region_fd, view_src[at:at + (256 << 20)], at) == min(256 << 20, nbytes - at)
        timed("region -> page cache", lambda i: from_region(i, False, "r"), cores)
        timed("region -> O_DIRECT", lambda i: from_region(i, True, "s"), threads)
        timed("page cache -> region", to_region, cores)
    finally:
        os.close(region_fd)
        os.unlink(region_path)
    if drop_caches():
        timed("read after a drop", lambda i: read(i, False, "b"), threads)
    shutil.rmtree(lim_dir, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/adpkv-tiering-bench", help="both tiers store under it (one disk)")
    ap.add_argument("--row-kib", type=int, default=1024, help="bytes of one CPU-tier row (vLLM chunk)")
    ap.add_argument("--total-mib", type=int, default=384)
    ap.add_argument("--job-rows", type=int, default=16, help="rows per cascade / promotion job")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=20, help="16k-token prompts looked up per tier")
    ap.add_argument("--fs-threads", type=int, default=16, help="vLLM fs tier: read and write threads each")
    ap.add_argument("--gateway", default="", help="extra gateway settings, e.g. o_direct=1,thread_pool_size=8")
    ap.add_argument("--step-ms", type=float, default=0.2,
                    help="pause between engine steps while jobs run (a real engine's step takes milliseconds; "
                         "on a 2-core machine a tight loop takes CPU from a tier that copies)")
    args = ap.parse_args(argv)
    global STEP_S
    STEP_S = args.step_ms / 1e3

    from adpkv_gateway.ops.spawn import GatewayProcess

    row = args.row_kib << 10
    blocks_per_chunk = 16
    tokens_per_row = TOKENS_PER_BLOCK * blocks_per_chunk
    n = (args.total_mib << 20) // row
    prompt_rows = 16384 // tokens_per_row
    cpu_bytes = (n + prompt_rows + 8) * row
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    gw_settings = {"shared_memory_size": 512 << 20}
    for kv in filter(None, args.gateway.split(",")):
        k, v = kv.split("=", 1)
        gw_settings[k] = v
    gw = GatewayProcess([os.path.join(args.dir, "adpkv-card")], log_path=os.path.join(args.dir, "gateway.log"),
                        **gw_settings).start()
    rows = Rows(row)
    managers = {}
    try:
        managers["vllm-fs"] = make_manager({"type": "fs", "root_dir": os.path.join(args.dir, "vllm-fs"),
                                            "n_read_threads": args.fs_threads,
                                            "n_write_threads": args.fs_threads}, cpu_bytes, row, blocks_per_chunk)
        managers["adpkv"] = make_manager({"type": "AdpSecondaryTier", "module_path": "adpkv_vllm",
                                          "port": gw.port, "timeout_s": 60}, cpu_bytes, row, blocks_per_chunk)
        fs_tier = managers["vllm-fs"].secondary_tiers[0]
        print(f"machine: {os.cpu_count()} cores, {args.dir} on {fs_device(args.dir)}; rows of {row >> 10} KiB, "
              f"{n} rows ({n * row >> 20} MiB) per run, jobs of {args.job_rows} rows; vLLM fs tier O_DIRECT="
              f"{getattr(fs_tier, '_use_o_direct', '?')}, {args.fs_threads}+{args.fs_threads} threads; gateway "
              f"{gw_settings}", flush=True)
        limits = physical_limits(args.dir, n * row, row, args.fs_threads)
        print("physical limits, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in limits.items()), flush=True)
        can_drop = drop_caches()
        if not can_drop:
            print("page cache drop refused (not root): the 'dropped' runs are not run", flush=True)
        res = {name: {"store": [], "hot": [], "cold": [], "lookup": []} for name in managers}
        checked = {name: 0 for name in managers}
        names = list(managers)
        for rnd in range(args.repeat):
            order = names if rnd % 2 == 0 else names[::-1]
            keys = {name: [make_key(rnd, name, i) for i in range(n)] for name in names}
            for name in order:
                res[name]["store"].append(do_store(managers[name], keys[name], args.job_rows, rows))
            for name in order:
                _, t, c = do_load(managers[name], keys[name], args.job_rows, rows)
                res[name]["hot"].append(t)
                checked[name] += c
            if can_drop:
                for name in order:
                    drop_caches()
                    _, t, c = do_load(managers[name], keys[name], args.job_rows, rows)
                    res[name]["cold"].append(t)
                    checked[name] += c
            line = " ".join(f"{name}: store {gbs(n * row, res[name]['store'][-1]):.2f} hot {gbs(n * row, res[name]['hot'][-1]):.2f}"
                            + (f" dropped {gbs(n * row, res[name]['cold'][-1]):.2f}" if can_drop else "")
                            for name in names)
            print(f"round {rnd + 1}: GB/s {line}", flush=True)
        # lookup latency of a 16k-token prompt's rows
        for name in names:
            m = managers[name]
            pkeys = [make_key(99, name, i) for i in range(prompt_rows)]
            do_store(m, pkeys, prompt_rows, rows)
            res[name]["lookup"] = [prompt_lookup(m, pkeys) for _ in range(args.lookups)]
            if name == "adpkv":     # what of its lookup is the gateway's EXIST round trip itself
                tier = m.secondary_tiers[0]
                skeys = [tier.storage_key(k) for k in pkeys]
                trips = []
                for _ in range(args.lookups):
                    t0 = time.perf_counter()
                    assert all(tier._session.client.exist(skeys).result(30))
                    trips.append(time.perf_counter() - t0)
                print(f"adpkv: one EXIST of the prompt's {len(skeys)} keys, round trip alone: median "
                      f"{med(trips) * 1e3:.2f} ms", flush=True)
        print()
        print(f"| tier | store GB/s | load GB/s, page cache hot | load GB/s, dropped | lookup of a 16k-token "
              f"prompt ({prompt_rows} rows), median ms | rows checked |")
        print("|---|---|---|---|---|---|")
        for name in names:
            r = res[name]
            print(f"| {name} | {gbs(n * row, med(r['store'])):.2f} | {gbs(n * row, med(r['hot'])):.2f} | "
                  + (f"{gbs(n * row, med(r['cold'])):.2f}" if r["cold"] else "not run")
                  + f" | {med(r['lookup']) * 1e3:.2f} | {checked[name]} |")
        after = physical_limits(args.dir, n * row, row, args.fs_threads)
        print("physical limits after the runs, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in after.items()))
        ceiling = {k: max(v, after.get(k, 0.0)) for k, v in limits.items()}
        print("\nof the limits (best of before/after): store vs write O_DIRECT / page cache / region -> page "
              "cache / region -> O_DIRECT; hot load vs read page cache / page cache -> region; dropped load vs "
              "read O_DIRECT / after a drop")
        for name in names:
            r = res[name]
            store, hot = gbs(n * row, med(r["store"])), gbs(n * row, med(r["hot"]))
            parts = ["store " + " / ".join(f"{store / ceiling[k]:.0%}" for k in (
                        "write O_DIRECT", "write page cache", "region -> page cache", "region -> O_DIRECT")),
                     f"hot {hot / ceiling['read page cache']:.0%} / {hot / ceiling['page cache -> region']:.0%}"]
            if r["cold"] and "read after a drop" in ceiling:
                parts.append(f"dropped {gbs(n * row, med(r['cold'])) / ceiling['read O_DIRECT']:.0%} / "
                             f"{gbs(n * row, med(r['cold'])) / ceiling['read after a drop']:.0%}")
            print(f"  {name}: " + ", ".join(parts))
        a, f = res["adpkv"], res["vllm-fs"]
        ratios = {"store": med(f["store"]) / med(a["store"]), "load_hot": med(f["hot"]) / med(a["hot"])}
        if a["cold"]:
            ratios["load_dropped"] = med(f["cold"]) / med(a["cold"])
        print("\nadpkv / vllm-fs (medians of %d rounds): %s" % (
            args.repeat, " ".join(f"{k}={v:.2f}x" for k, v in ratios.items())))
        return 0
    finally:
        for m in managers.values():
            try:
                m.shutdown()
            except Exception as exc:
                print(f"shutdown: {exc}", file=sys.stderr)
        gw.stop()


def make_key(rnd: int, name: str, i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key
    import hashlib
    return make_offload_key(hashlib.sha256(f"{rnd}/{name}/{i}".encode()).digest(), 0)


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def med(xs):
    return statistics.median(xs)


def fs_device(path: str) -> str:
    try:
        out = subprocess.run(["df", "--output=source,fstype", path], capture_output=True, text=True).stdout
        return " ".join(out.split()[2:4])
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
