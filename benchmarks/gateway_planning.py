"""The gateway's per-object cost of a GET (its control loop's planning) against plain reads.

A hot restore from an fs card is one page-cache copy per byte, done in the gateway's I/O
processes; what the gateway adds is per object: the lookup, the read plan, the card's index
lookups, handing the reads out and accounting for the results, much of it on its one control
loop. This measures that cost through a real gateway process (fs card, ``io_processes``), in
two regimes, each against plain reads of the same files measured in the same run:

* ``small``: many small objects (4 KiB): the reads cost little, so the gateway's time per object
  is its planning. Limit: the same files read by ``open`` + ``preadv`` + ``close`` in as many
  processes as the gateway has I/O processes (the work an I/O process does per object).
* ``large``: 1 MiB objects, the page cache hot: GB/s of the gateway against the same preads.

Each GET is one "layer" request of ``--per-request`` objects, all of them in flight at once (as a
restore asks). ``--profile FILE`` runs the gateway under cProfile (its control loop is the main
thread) and prints the loop's top functions.

    python benchmarks/gateway_planning.py --io-processes 2 --objects 16384 --large-mib 1024
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pstats
import shutil
import statistics
import sys
import time

from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops.spawn import GatewayProcess

MiB = 1 << 20
HEADER = 4096


class ProfiledGateway(GatewayProcess):
    """The gateway under cProfile (written at its clean stop)."""

    def __init__(self, *args, profile_path: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.profile_path = profile_path

    def command(self) -> list[str]:
        cmd = super().command()
        return [cmd[0], "-m", "cProfile", "-o", self.profile_path] + cmd[1:]


_buf = None
TICK = os.sysconf("SC_CLK_TCK")


def _read_files(paths: list[str]) -> float:
    """open + preadv (header and payload, as the gateway's read) + close of each file; the
    CPU seconds it took."""
    global _buf
    if _buf is None:
        _buf = bytearray(HEADER + 64 * MiB)
    view = memoryview(_buf)
    c0 = time.process_time()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [view[:os.fstat(fd).st_size]], 0)
        finally:
            os.close(fd)
    return time.process_time() - c0


def raw_reads(pool, files: list[str], procs: int) -> tuple[float, float]:
    """Seconds to read every file once, split over the pool's processes (chunks of 64), and
    the CPU seconds the readers spent."""
    chunks = [files[k:k + 64] for k in range(0, len(files), 64)]
    t0 = time.perf_counter()
    cpu = sum(pool.map(_read_files, chunks, chunksize=max(1, len(chunks) // (4 * procs))))
    return time.perf_counter() - t0, cpu


def cpu_seconds(pid: int, tid: int = 0) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def gateway_gets(client, keys: list[list[bytes]], obj: int, pid: int) -> tuple[float, float, float]:
    """Seconds for every GET (one per layer, all in flight) to be answered, every object a hit;
    and the CPU seconds the gateway process spent meanwhile: all its threads, and its control
    loop (the main thread) alone. Its I/O processes are other processes: not counted."""
    c0, l0 = cpu_seconds(pid), cpu_seconds(pid, pid)
    t0 = time.perf_counter()
    futs = [client.get(layer_keys, obj, lambda b: None) for layer_keys in keys]
    hits = [f.result().hits for f in futs]
    t = time.perf_counter() - t0
    if not all(all(h) for h in hits):
        raise RuntimeError("a GET missed objects it had stored")
    return t, cpu_seconds(pid) - c0, cpu_seconds(pid, pid) - l0


def regime(name: str, obj: int, n_objects: int, args, pool) -> dict:
    card = os.path.join(args.dir, f"card-{name}")
    shutil.rmtree(card, ignore_errors=True)
    layers = max(1, n_objects // args.per_request)
    settings = dict(shared_memory_size=args.ring_mib * MiB, io_processes=args.io_processes,
                    log_path=card + ".log")
    if args.threads:
        settings["thread_pool_size"] = args.threads
    gw = (ProfiledGateway(card, profile_path=f"{args.profile}.{name}", **settings) if args.profile
          else GatewayProcess(card, **settings)).start(timeout_s=120)
    row = {"regime": name, "object_bytes": obj, "objects": layers * args.per_request, "per_request": args.per_request}
    try:
        client = GatewayClient(ClientConfig(port=gw.port, timeout_s=600), f"planning-{name}")
        kb = KeyBuilder(f"planning-{name}")
        keys = [kb.keys([b"chunk-%d" % c for c in range(args.per_request)], [layer]) for layer in range(layers)]
        futs = [client.put(layer_keys, obj, lambda b: None) for layer_keys in keys]
        if not all(all(f.result().stored) for f in futs):
            raise RuntimeError("store failed")
        files = [os.path.join(d, f) for d, _, fs in os.walk(card)
                 if os.path.basename(os.path.dirname(d)).startswith("db")     # databases' object subdirectories
                 for f in fs if not f.startswith(".")]
        if len(files) != row["objects"]:
            raise RuntimeError(f"{len(files)} object files for {row['objects']} objects")
        pid = gw.proc.pid                           # under cProfile too (runpy: the same process)
        gateway_gets(client, keys, obj, pid)        # page cache hot, readers warm
        raw_reads(pool, files, args.io_processes)
        gw_runs, raw_runs = [], []
        for _ in range(args.reps):                  # alternating, median of each
            gw_runs.append(gateway_gets(client, keys, obj, pid))
            raw_runs.append(raw_reads(pool, files, args.io_processes))
        client.close()
    finally:
        gw.stop(timeout_s=120)
        shutil.rmtree(card, ignore_errors=True)
    n = row["objects"]
    g, gcpu, lcpu = (statistics.median(run[k] for run in gw_runs) for k in range(3))
    r, rcpu = (statistics.median(run[k] for run in raw_runs) for k in range(2))
    row.update(gateway_runs=gw_runs, raw_runs=raw_runs, gateway_us_per_object=g / n * 1e6,
               raw_us_per_object=r / n * 1e6, gateway_GBs=n * obj / g / 1e9, raw_GBs=n * obj / r / 1e9,
               gateway_over_raw=r / g, gateway_cpu_us_per_object=gcpu / n * 1e6,
               loop_cpu_us_per_object=lcpu / n * 1e6, raw_cpu_us_per_object=rcpu / n * 1e6)
    print(f"{name}: {n} objects of {obj} B in {layers} GETs of {args.per_request}, medians of {args.reps}:\n"
          f"  wall: gateway {row['gateway_us_per_object']:.1f} us/object ({row['gateway_GBs']:.2f} GB/s), plain "
          f"preads in {args.io_processes} processes {row['raw_us_per_object']:.1f} us/object "
          f"({row['raw_GBs']:.2f} GB/s): gateway / raw {row['gateway_over_raw']:.2f}\n"
          f"  CPU per object: gateway process {row['gateway_cpu_us_per_object']:.1f} us (its control loop "
          f"{row['loop_cpu_us_per_object']:.1f} us; its I/O processes not counted), a plain read "
          f"{row['raw_cpu_us_per_object']:.1f} us", flush=True)
    if args.profile:
        stats = pstats.Stats(f"{args.profile}.{name}")
        stats.sort_stats("tottime").print_stats(18)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/adpkv-planning-bench")
    ap.add_argument("--io-processes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="gateway I/O threads (0: its default)")
    ap.add_argument("--objects", type=int, default=16384, help="small objects (4 KiB)")
    ap.add_argument("--small-bytes", type=int, default=4096)
    ap.add_argument("--large-mib", type=int, default=1024, help="MiB of 1 MiB objects (0: no large regime)")
    ap.add_argument("--per-request", type=int, default=512, help="objects per GET (one layer of a restore)")
    ap.add_argument("--ring-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", default="", help="run the gateway under cProfile, stats to FILE.<regime>")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    with mp.get_context("spawn").Pool(args.io_processes) as pool:
        rows.append(regime("small", args.small_bytes, args.objects, args, pool))
        if args.large_mib:
            rows.append(regime("large", MiB, args.large_mib, args, pool))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv, "cpus": os.cpu_count(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
