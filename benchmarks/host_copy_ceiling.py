"""How fast can this host move bytes into the ring? The ceilings under a restore from page cache.

A restore from an fs card whose files are in the page cache is one CPU copy per byte (page
cache -> ring), with the checksum computed on each piece right after its read while the piece
is still in the CPU cache; the GPU then DMAs from the ring. This script measures, in P worker
processes that each map a /dev/shm ring like the gateway's I/O processes do:

* ``memcpy``        anonymous memory -> ring (the host's copy ceiling, no kernel in the way);
* ``pread``         object files in the page cache -> ring (``preadv`` of header + 1 MiB payload);
* ``pread+xxh3``    the same and the xxh3 of the whole payload afterwards (a second pass over
  the bytes: the gateway's earlier read path, kept for comparison);
* ``pread+xxh3/chunked``  read in pieces, each hashed right after its read, while in cache (the
  gateway's read path today: ``_read_hashed`` in gateway/cards/objfile.py); ``...:N`` reads
  pieces of N KiB instead of 256;
* ``mmap+memcpy``   the file mapped (MAP_POPULATE) and copied to the ring by memmove;

and, where the kernel allows it, the same with the ring on transparent huge pages. With
``--dma-probe`` (needs torch with CUDA) it also tries the copy-free alternative: registering
mappings of the page-cached files with CUDA (``cudaHostRegister``) and DMAing from them, timing
the registration and the copy. With ``--with-h2d`` (torch with CUDA) every read run also has
the GPU pulling from the ring (pinned, ``cudaHostRegister``) at full speed meanwhile, as in a
restore: both rates are printed, since the two share the host's memory bandwidth.

    python benchmarks/host_copy_ceiling.py --dir /tmp/ceiling --gib 4 --procs 1,8,15
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import shutil
import time

MiB = 1 << 20
HEADER = 4096
OBJ = MiB
PIECE = 256 << 10

_ring = None
_ring_addr = 0
_src = None
_lib = None
_xx = None


def _init(ring_path: str, ring_size: int, huge: bool) -> None:
    global _ring, _ring_addr, _src, _lib, _xx
    fd = os.open(ring_path, os.O_RDWR)
    _ring = mmap.mmap(fd, ring_size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        _ring.madvise(mmap.MADV_HUGEPAGE)
    _ring_addr = ctypes.addressof(ctypes.c_char.from_buffer(_ring))
    _src = mmap.mmap(-1, 64 * MiB)
    _src.write(os.urandom(64 * MiB))
    _lib = ctypes.CDLL(None)
    _lib.memmove.restype = ctypes.c_void_p
    _lib.memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    import xxhash
    _xx = ctypes.CDLL(xxhash._xxhash.__file__)
    _xx.XXH3_64bits.restype = ctypes.c_uint64
    _xx.XXH3_64bits.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    _xx.XXH3_createState.restype = ctypes.c_void_p
    _xx.XXH3_64bits_reset.argtypes = (ctypes.c_void_p,)
    _xx.XXH3_64bits_update.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _xx.XXH3_64bits_digest.restype = ctypes.c_uint64
    _xx.XXH3_64bits_digest.argtypes = (ctypes.c_void_p,)


def _slot(i: int, slots: int) -> int:
    return (i % slots) * (OBJ + HEADER)


def _work(job) -> int:
    kind, items, slots = job
    view = memoryview(_ring)
    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(_src))
    kind, _, piece_kib = kind.partition(":")          # "pread+xxh3/chunked:1024": pieces of 1 MiB
    piece = int(piece_kib) << 10 if piece_kib else PIECE
    state = _xx.XXH3_createState() if kind == "pread+xxh3/chunked" else None
    moved = 0
    for i, path in items:
        off = _slot(i, slots)
        if kind == "memcpy":
            _lib.memmove(_ring_addr + off, src_addr + (i % 63) * MiB, OBJ)
        elif kind == "mmap+memcpy":
            fd = os.open(path, os.O_RDONLY)
            m = mmap.mmap(fd, OBJ + HEADER, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                          mmap.PROT_READ)
            os.close(fd)
            view[off:off + OBJ + HEADER] = m      # buffer-protocol copy (one memcpy)
            m.close()
        elif kind == "pread+xxh3/chunked":
            fd = os.open(path, os.O_RDONLY)
            _xx.XXH3_64bits_reset(state)
            os.preadv(fd, [view[off:off + HEADER]], 0)
            pos = 0
            while pos < OBJ:
                n = os.preadv(fd, [view[off + HEADER + pos:off + HEADER + pos + piece]], HEADER + pos)
                _xx.XXH3_64bits_update(state, _ring_addr + off + HEADER + pos, n)
                pos += n
            _xx.XXH3_64bits_digest(state)
            os.close(fd)
        else:
            fd = os.open(path, os.O_RDONLY)
            os.preadv(fd, [view[off:off + OBJ + HEADER]], 0)
            os.close(fd)
            if kind == "pread+xxh3":
                _xx.XXH3_64bits(_ring_addr + off + HEADER, OBJ)
        moved += OBJ
    return moved


def make_files(root: str, n: int) -> list[str]:
    os.makedirs(root, exist_ok=True)
    blob = os.urandom(OBJ + HEADER)
    paths = []
    for i in range(n):
        p = os.path.join(root, f"obj{i:06d}")
        if not os.path.exists(p):
            with open(p, "wb") as fh:
                fh.write(blob[i % 97:] + blob[:i % 97])
        paths.append(p)
    for p in paths:                      # warm the page cache
        with open(p, "rb") as fh:
            while fh.read(8 * MiB):
                pass
    return paths


class H2DPull:
    """A thread copying the (pinned) ring to the GPU in 256 MiB pieces while it runs."""

    def __init__(self, ring_path: str, ring_size: int):
        import threading

        import torch
        fd = os.open(ring_path, os.O_RDWR)
        self.mm = mmap.mmap(fd, ring_size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        os.close(fd)
        self.host = torch.frombuffer(self.mm, dtype=torch.uint8)
        assert int(torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), ring_size, 0)) == 0
        self.dev = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        self.torch, self.threading = torch, threading
        self.moved = 0
        self.stop = threading.Event()

    def start(self) -> None:
        self.stop.clear()
        self.moved = 0
        self.t0 = time.perf_counter()
        self.thread = self.threading.Thread(target=self._pull)
        self.thread.start()

    def _pull(self):
        piece = 256 * MiB
        stream = self.torch.cuda.Stream()
        with self.torch.cuda.stream(stream):
            k = 0
            while not self.stop.is_set():
                off = (k * piece) % (self.host.numel() - piece)
                self.dev.copy_(self.host[off:off + piece], non_blocking=True)
                stream.synchronize()
                self.moved += piece
                k += 1

    def finish(self) -> float:
        """Stop pulling; the GB/s pulled since ``start``."""
        self.stop.set()
        self.thread.join()
        return self.moved / (time.perf_counter() - self.t0) / 1e9


def run(kind: str, procs: int, paths: list[str], ring_path: str, ring_size: int, huge: bool, reps: int,
        h2d: "H2DPull | None" = None) -> tuple[float, float]:
    """Best aggregate GB/s of ``kind`` over ``reps`` passes (and the H2D rate meanwhile)."""
    slots = ring_size // (OBJ + HEADER)
    items = list(enumerate(paths))
    jobs = [(kind, items[k::procs], slots) for k in range(procs)]
    ctx = mp.get_context("spawn")
    best = (0.0, 0.0)
    with ctx.Pool(procs, initializer=_init, initargs=(ring_path, ring_size, huge)) as pool:
        pool.map(_work, [(kind, items[:procs], slots)] * procs)          # warm up every worker
        for _ in range(reps):
            if h2d is not None:
                h2d.start()
            t0 = time.perf_counter()
            moved = sum(pool.map(_work, jobs, chunksize=1))
            rate = moved / (time.perf_counter() - t0) / 1e9
            h2d_rate = h2d.finish() if h2d is not None else 0.0
            if rate > best[0]:
                best = (rate, h2d_rate)
    return best


def dma_probe(paths: list[str], gib: float = 1.0) -> dict:
    """Register 1 MiB mappings of page-cached object files with CUDA and copy them to the GPU."""
    import torch
    rt = torch.cuda.cudart()
    n = min(len(paths), int(gib * 1024))
    out: dict = {}
    dst = torch.empty(n * OBJ, dtype=torch.uint8, device="cuda")
    for flags, name in ((0x08, "read-only"), (0x00, "default")):
        maps, regs = [], []
        t0 = time.perf_counter()
        err = None
        for p in paths[:n]:
            fd = os.open(p, os.O_RDWR)
            m = mmap.mmap(fd, OBJ + HEADER, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.close(fd)
            t = torch.frombuffer(m, dtype=torch.uint8)
            rc = int(rt.cudaHostRegister(t.data_ptr(), t.numel(), flags))
            maps.append((m, t))
            if rc != 0:
                err = f"cudaHostRegister({name}) returned {rc}"
                break
            regs.append(t)
        reg_s = time.perf_counter() - t0
        entry = {"registered": len(regs), "register_GBs": len(regs) * OBJ / reg_s / 1e9 if regs else 0.0}
        if err:
            entry["error"] = err
        if regs and not err:
            torch.cuda.synchronize()
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                for k, t in enumerate(regs):
                    dst[k * OBJ:(k + 1) * OBJ].copy_(t[HEADER:], non_blocking=True)
                torch.cuda.synchronize()
                best = max(best, len(regs) * OBJ / (time.perf_counter() - t0) / 1e9)
            entry["h2d_GBs"] = best
            entry["exact"] = bool(torch.equal(dst[:OBJ].cpu(), regs[0][HEADER:]))
        t0 = time.perf_counter()
        for t in regs:
            rt.cudaHostUnregister(t.data_ptr())
        entry["unregister_s"] = time.perf_counter() - t0
        del regs
        maps.clear()
        out[name] = entry
        print(f"dma probe ({name}): {entry}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/adpkv-ceiling")
    ap.add_argument("--gib", type=float, default=4.0, help="object files to read (1 MiB each)")
    ap.add_argument("--ring-gib", type=float, default=2.0)
    ap.add_argument("--procs", default="1,8,15")
    ap.add_argument("--kinds", default="memcpy,pread,pread+xxh3,pread+xxh3/chunked,mmap+memcpy")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dma-probe", action="store_true", help="also try DMA from registered file mappings")
    ap.add_argument("--with-h2d", action="store_true", help="the GPU pulls from the ring during the reads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    paths = make_files(os.path.join(args.dir, "files"), int(args.gib * 1024))
    ring_size = int(args.ring_gib * (1 << 30)) // (OBJ + HEADER) * (OBJ + HEADER)
    ring_path = f"/dev/shm/adpkv-ceiling-{os.getpid()}"
    with open(ring_path, "wb") as fh:
        fh.truncate(ring_size)
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip()
    except OSError:
        thp = "unknown"
    hugeable = "[advise]" in thp or "[within_size]" in thp or "[always]" in thp
    print(f"cpus {os.cpu_count()}, shmem THP: {thp}", flush=True)
    results = {}
    h2d = H2DPull(ring_path, ring_size) if args.with_h2d else None
    try:
        for huge in ([False, True] if hugeable else [False]):
            for kind in args.kinds.split(","):
                for p in (int(x) for x in args.procs.split(",")):
                    gbs, h2d_gbs = run(kind, p, paths, ring_path, ring_size, huge, args.reps, h2d)
                    name = f"{kind}{' (THP ring)' if huge else ''}"
                    results.setdefault(name, {})[p] = gbs
                    extra = f"   H2D meanwhile {h2d_gbs:5.1f} GB/s" if h2d is not None else ""
                    if h2d is not None:
                        results.setdefault(name + " | H2D meanwhile", {})[p] = h2d_gbs
                    print(f"{name:32s} {p:3d} procs  {gbs:6.1f} GB/s{extra}", flush=True)
    finally:
        os.unlink(ring_path)
    if args.dma_probe:
        results["dma_probe"] = dma_probe(paths)
    print("\n" + " " * 34 + "".join(f"{p:>8d}p" for p in (int(x) for x in args.procs.split(","))))
    for name, row in results.items():
        if name == "dma_probe":
            continue
        print(f"{name:34s}" + "".join(f"{v:9.1f}" for v in row.values()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shmem_thp": thp, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
