"""``adpkv bench``: store and restore through a live gateway vs raw file I/O on the same disk.

For each object size and regime, R simulated ranks (processes) attach as one
engine and PUT then GET ``count`` objects with collective requests (each rank
owns a slice of every object, as tensor-parallel ranks do); every restored byte
is checked. In the same run the same bytes are written to and read from plain
files in the same directory with the same number of threads: the raw baseline.

Regimes: ``cold`` (fs card with O_DIRECT; the raw baseline with O_DIRECT into an
aligned buffer: the disk is the limit) and ``hot`` (page cache).

Without ``port`` each (regime, size) gets a gateway of its own on a fresh card under the
directory (``o_direct`` as the regime says), removed afterwards. With ``port`` (a live gateway)
one regime is measured, the one that gateway runs (``cold`` with ``o_direct: true``, else
``hot``: the caller says which), so the raw baseline does the same kind of I/O; every object a
run stored is deleted again through the gateway once it is checked.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from adpkv_core.keys import KeyBuilder
from adpkv_core.memory.ring import align_up

from adpkv_gateway.observe import progress
from adpkv_gateway.ops.spawn import GatewayProcess

MiB = 1 << 20


@dataclass
class Result:
    regime: str
    size: int
    count: int
    ranks: int
    store_gbs: float
    restore_gbs: float
    raw_write_gbs: float
    raw_read_gbs: float

    @property
    def store_vs_raw(self) -> float:
        return self.store_gbs / self.raw_write_gbs if self.raw_write_gbs else 0.0

    @property
    def restore_vs_raw(self) -> float:
        return self.restore_gbs / self.raw_read_gbs if self.raw_read_gbs else 0.0


# ---------------------------------------------------------------------- gateway side
def _rank_main(port, rank, ranks, size, count, per_request, engine_id, barrier, results, namespace):
    try:
        _rank_run(port, rank, ranks, size, count, per_request, engine_id, barrier, results, namespace)
    except BaseException:
        barrier.abort()  # let the driver fail at once instead of waiting out its timeouts
        raise


def _rank_run(port, rank, ranks, size, count, per_request, engine_id, barrier, results, namespace):
    from adpkv_core.client import GatewayClient
    from adpkv_core.settings import ClientConfig
    sl = size // ranks
    src = memoryview(os.urandom(sl * count))
    dst = bytearray(sl * count)
    dstv = memoryview(dst)
    client = GatewayClient(ClientConfig(port=port, namespace=namespace, timeout_s=120.0), engine_id,
                           rank=rank, world_size=ranks)
    ring = client.ring
    keys = KeyBuilder(namespace).keys([i.to_bytes(8, "big") for i in range(count)], layers=[0])
    groups = [(g, keys[g:g + per_request]) for g in range(0, count, per_request)]

    def filler(base):
        def fill(b):
            first = base + b.first
            if ranks == 1 and b.stride == size:
                ring[b.offset:b.offset + b.count * size] = src[first * size:(first + b.count) * size]
                return
            for j in range(b.count):
                o = b.offset + j * b.stride + b.slice_offset
                ring[o:o + sl] = src[(first + j) * sl:(first + j + 1) * sl]
        return fill

    def copier(base):
        def copy(b):
            first = base + b.first
            if ranks == 1 and b.stride == size and all(b.hits):
                dstv[first * size:(first + b.count) * size] = ring[b.offset:b.offset + b.count * size]
                return
            for j in range(b.count):
                if b.hits[j]:
                    o = b.offset + j * b.stride + b.slice_offset
                    dstv[(first + j) * sl:(first + j + 1) * sl] = ring[o:o + sl]
        return copy

    sl_arg = (rank * sl, sl)
    barrier.wait()
    futs = [client.put(k, size, filler(g), tag=f"p{g}", slice=sl_arg) for g, k in groups]
    stored = all(f.result().all_ok for f in futs)
    barrier.wait()
    barrier.wait()
    futs = [client.get(k, size, copier(g), tag=f"g{g}", slice=sl_arg) for g, k in groups]
    hits = all(f.result().all_ok for f in futs)
    barrier.wait()
    exact = xxhash.xxh3_64_intdigest(dst) == xxhash.xxh3_64_intdigest(src)
    # remove what this run wrote (after the timing): a bench against a live gateway leaves its
    # card as it found it. Rank 0 deletes every key (a DELETE is one rank's own request)
    removed = client.delete(keys).result(timeout=120) == len(keys) if rank == 0 else True
    results.put((rank, stored, hits, exact, removed))
    client.close()


def bench_gateway(port: int, size: int, count: int, ranks: int, per_request: int,
                  namespace: str = "adpkv-bench") -> tuple[float, float]:
    """Seconds to store and to restore ``count`` objects through the gateway on ``port``."""
    if size % ranks:
        raise ValueError(f"object size {size} is not divisible by {ranks} ranks")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(ranks + 1)
    results = ctx.Queue()
    engine_id = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_rank_main, args=(port, r, ranks, size, count, per_request, engine_id,
                                                  barrier, results, namespace), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    barrier.wait(timeout=120)
    t0 = time.perf_counter()
    barrier.wait(timeout=600)
    t_store = time.perf_counter() - t0
    barrier.wait(timeout=60)
    t0 = time.perf_counter()
    barrier.wait(timeout=600)
    t_restore = time.perf_counter() - t0
    outcome = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    bad = [o for o in outcome if not all(o[1:])]
    if bad:
        raise RuntimeError(f"bench verification failed (rank, stored, hit, byte-exact, removed): {bad}")
    return t_store, t_restore


# ---------------------------------------------------------------------- raw baseline
def bench_raw(directory: str, size: int, count: int, threads: int, direct: bool) -> tuple[float, float]:
    """Seconds to write and read ``count`` files of ``size`` bytes with plain (or O_DIRECT) I/O."""
    os.makedirs(directory, exist_ok=True)
    padded = align_up(size)
    src = mmap.mmap(-1, padded * count)
    src.write(os.urandom(padded * count))
    dst = mmap.mmap(-1, padded * count)
    dst.write(bytes(padded * count))      # fault the pages in before timing, as the gateway run's buffers are
    srcv, dstv = memoryview(src), memoryview(dst)
    flag = os.O_DIRECT if direct else 0
    n = padded if direct else size
    paths = [os.path.join(directory, f"obj{i}") for i in range(count)]

    def write(i):
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        try:
            os.pwrite(fd, srcv[i * padded:i * padded + n], 0)
        finally:
            os.close(fd)

    def read(i):
        fd = os.open(paths[i], os.O_RDONLY | flag)
        try:
            os.preadv(fd, [dstv[i * padded:i * padded + n]], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(write, range(count)))
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(read, range(count)))
        t_read = time.perf_counter() - t0
    ok = all(srcv[i * padded:i * padded + size] == dstv[i * padded:i * padded + size] for i in range(count))
    srcv.release()
    dstv.release()
    src.close()
    dst.close()
    shutil.rmtree(directory, ignore_errors=True)
    if not ok:
        raise RuntimeError("raw baseline read back different bytes")
    return t_write, t_read


# ---------------------------------------------------------------------- driver
def run(directory: str, sizes: list[int], regimes: list[str], total_bytes: int, ranks: int,
        per_request: int, threads: int, port: int | None = None, repeat: int = 3, out=print) -> list[Result]:
    """Run every (regime, size) ``repeat`` times, alternating gateway and raw runs so the
    noise of a shared machine hits both alike; report the median of each."""
    results = []
    with progress.track("adpkv bench", 2 * repeat * len(regimes) * len(sizes), "runs") as shown:
        for regime in regimes:
            for size in sizes:
                results.append(_measure(directory, regime, size, total_bytes, ranks, per_request, threads, port,
                                        repeat, shown))
                r = results[-1]
                out(f"{regime:4s} {size // 1024:5d} KiB x {r.count:5d} ranks={ranks}: "
                    f"store {r.store_gbs:6.2f} GB/s (raw {r.raw_write_gbs:6.2f}, x{r.store_vs_raw:.2f})  "
                    f"restore {r.restore_gbs:6.2f} GB/s (raw {r.raw_read_gbs:6.2f}, x{r.restore_vs_raw:.2f})  "
                    f"[median of {repeat}]")
    return results


def _measure(directory: str, regime: str, size: int, total_bytes: int, ranks: int, per_request: int,
             threads: int, port, repeat: int, shown: progress.Progress) -> Result:
    """One (regime, size): ``repeat`` gateway runs alternating with raw runs; the medians."""
    count = max(8, total_bytes // size)
    card = os.path.join(directory, f"card-{regime}-{size}")
    shutil.rmtree(card, ignore_errors=True)
    gw = None
    if port is None:
        gw = GatewayProcess(card, o_direct=(regime == "cold"), thread_pool_size=threads,
                            shared_memory_size=max(256 * MiB, 8 * per_request * align_up(size)),
                            log_path=card + ".log").start()
    runs = []
    try:
        for rep in range(repeat):
            shown.note(f"adpkv bench: {regime} {size // 1024} KiB run {rep + 1}/{repeat}, gateway")
            # a fresh namespace each run: the gateway skips keys it has stored already
            t_store, t_restore = bench_gateway(gw.port if gw else port, size, count, ranks, per_request,
                                               namespace=f"adpkv-bench-{os.getpid()}-{rep}")
            shown.advance()
            shown.note(f"adpkv bench: {regime} {size // 1024} KiB run {rep + 1}/{repeat}, raw files")
            t_w, t_r = bench_raw(os.path.join(directory, "raw"), size, count, threads, regime == "cold")
            shown.advance()
            runs.append((t_store, t_restore, t_w, t_r))
    finally:
        if gw is not None:
            gw.stop()
        shutil.rmtree(card, ignore_errors=True)
    t_store, t_restore, t_w, t_r = (statistics.median(col) for col in zip(*runs))
    nbytes = size * count
    return Result(regime, size, count, ranks, nbytes / t_store / 1e9, nbytes / t_restore / 1e9,
                  nbytes / t_w / 1e9, nbytes / t_r / 1e9)


def headline(results: list[Result]) -> Result:
    """The result the last line reports: cold 1 MiB if measured, else the first."""
    for r in results:
        if r.regime == "cold" and r.size == MiB:
            return r
    return results[0]
