"""The fs card at scale: what a gateway costs as its card holds more objects.

For each count, a card of that many objects of ``--size`` bytes is built in the card's own
format (files written straight into its databases with the card's writer,
``tests/core/fs_cards.py``: no gateway, no index), then a real gateway process is started
on it and measured:

- ``rss_b``: the gateway's anonymous memory (``RssAnon``) an object once its scan ended,
  over the same gateway on an empty card;
- ``serve_s``: from the spawn of the process to its first answer (PING); and once, before
  the counts, ``new_card_serve_s``: the same for a gateway on a new, empty card;
- ``scan_s``: from the spawn to the end of the scan of the card's files (STATS ``work``);
- ``snap_s``: from the spawn to the first answer of a restart after a clean stop (the index
  snapshot instead of a scan);
- ``rss_snap_b``: the gateway's memory per object after that restart, once its check of the
  snapshot against the files ended;
- ``exist512_ms`` / ``exist16k_ms``: EXIST of 512 and 16,384 stored keys, p50 and p99 of
  real client round trips (``--rounds``);
- ``store16k_us``: the gateway's share of a 16,384-key EXIST, µs a key (p50): the gateway's
  own store code (``Lookup.exists``, what its pool runs for an EXIST) on the card, opened
  in this process from the snapshot of the gateway's clean stop (put back afterwards: the
  files are unchanged), timed once the card's check of its files ended;
- ``get_obj_s``: GET of 512 hot objects at a time, objects a second;
- ``hit`` / ``lru_hit`` / ``evict`` / ``lru_evict`` (not with ``--trace 0``): a Zipf trace (s=0.9) of ``--trace``
  lookups in batches of 64 (GET, then PUT of the misses) on the gateway restarted with a
  capacity of a tenth of the card, against an exact LRU with the same watermarks simulated on the
  same trace from the same start (the newest objects kept): hit ratio and evictions per
  lookup of each.

    python benchmarks/card_scale.py --counts 10000,100000 [--dir /tmp] [--plot docs/img/card_scale.png] [--json rows.jsonl]
    python benchmarks/card_scale.py --plot-from rows.jsonl,more.jsonl --plot docs/img/card_scale.png
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "core"))

from fs_cards import build_card, card_keys, payload_of  # noqa: E402

from adpkv_core.client import GatewayClient  # noqa: E402
from adpkv_core.settings import ClientConfig  # noqa: E402
from adpkv_gateway.ops import control  # noqa: E402
from adpkv_gateway.cards.fs.card import SNAPSHOT_FILE, FsCard  # noqa: E402
from adpkv_gateway.store.health import CardHealth  # noqa: E402
from adpkv_gateway.store.object_store import ObjectStore  # noqa: E402
from adpkv_gateway.store.pins import Pins  # noqa: E402
from adpkv_gateway.ops.spawn import GatewayProcess  # noqa: E402

HEADER = 4096
WATERMARK, RATIO = 0.95, 0.10


def rss_anon(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def scanning(port: int) -> bool:
    work = control.request(port, {"op": "STATS"}, timeout_s=30)["stats"].get("work", [])
    return any(w in x.get("what", "") for x in work for w in ("indexing", "checking", "trimming"))


def spawn(root: str, log: str, **settings) -> tuple[GatewayProcess, float, float]:
    """A gateway on ``root``; (it, seconds to its first answer, seconds to the scan's end)."""
    gw = GatewayProcess(root, log_path=log, shared_memory_size=256 << 20, **settings)
    t0 = time.monotonic()
    gw.start(wait=False)
    if not control.wait_until_up(gw.port, 600):
        raise RuntimeError(gw.log()[-3000:])
    served = time.monotonic() - t0
    while scanning(gw.port):
        time.sleep(0.05)
    return gw, served, time.monotonic() - t0


def client_of(port: int, name: str) -> GatewayClient:
    return GatewayClient(ClientConfig(port=port, timeout_s=120.0, busy_wait_s=0), name, rank=0, world_size=1)


def pct(values, q):
    return float(np.percentile(values, q)) * 1e3


def zipf_trace(n: int, length: int, s: float = 0.9, seed: int = 3) -> list[int]:
    """``length`` lookups of ``n`` keys, key of popularity rank r with weight 1/r**s."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n + 1) ** s
    ranks = rng.choice(n, size=length, p=weights / weights.sum())
    return rng.permutation(n)[ranks].tolist()


def exact_lru(trace: list[int], start: list[int], capacity: int) -> tuple[int, int]:
    lru = collections.OrderedDict((k, None) for k in start)
    hits = evicted = 0
    high, low = capacity * WATERMARK, capacity * (WATERMARK - RATIO)
    for k in trace:
        if k in lru:
            lru.move_to_end(k)
            hits += 1
            continue
        if len(lru) + 1 > high:
            while len(lru) > low - 1:
                lru.popitem(last=False)
                evicted += 1
        lru[k] = None
    return hits, evicted


def one_count(base: str, n: int, size: int, rounds: int, trace_len: int, empty_rss: int) -> dict:
    root = os.path.join(base, f"card{n}")
    keys = card_keys(n)
    t = time.monotonic()
    build_card(root, keys, size)
    built = time.monotonic() - t
    gw, served, scanned = spawn(root, os.path.join(base, f"gw{n}.log"))
    try:
        return measure(gw, root, keys, n, size, rounds, trace_len, empty_rss, built, served, scanned)
    finally:
        if gw.alive():
            gw.kill()
        shutil.rmtree(root, ignore_errors=True)


def measure(gw, root, keys, n, size, rounds, trace_len, empty_rss, built, served, scanned) -> dict:
    out = {"objects": n, "build_s": round(built, 1), "serve_s": round(served, 2), "scan_s": round(scanned, 1),
           "rss_b": round((rss_anon(gw.proc.pid) - empty_rss) / n, 1)}
    client = client_of(gw.port, "scale")
    rng = np.random.default_rng(1)
    for batch, name in ((512, "exist512"), (16384, "exist16k")):
        times = []
        for _ in range(rounds):
            ask = [keys[i] for i in rng.integers(0, n, min(batch, n))]
            t = time.perf_counter()
            found = client.exist(ask).result()
            times.append(time.perf_counter() - t)
            assert all(found)
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = round(pct(times, 50), 2), round(pct(times, 99), 2)
    hot = keys[:512]
    client.get(hot, size, lambda b: None).result()
    t = time.perf_counter()
    for _ in range(rounds):
        assert client.get(hot, size, lambda b: None).result().all_ok
    out["get_obj_s"] = round(rounds * len(hot) / (time.perf_counter() - t))
    client.close()
    gw.stop()
    out["store16k_us"] = round(store_exist_us(root, keys, rounds), 2)
    t0 = time.monotonic()
    gw.start(wait=False)
    control.wait_until_up(gw.port, 600)
    out["snap_s"] = round(time.monotonic() - t0, 2)
    while scanning(gw.port):                   # its check of the snapshot against the files
        time.sleep(0.05)
    out["rss_snap_b"] = round((rss_anon(gw.proc.pid) - empty_rss) / n, 1)
    gw.stop()
    if not trace_len:
        print(json.dumps(out), flush=True)
        return out

    print(json.dumps(out), flush=True)        # the figures so far
    # the skewed trace, on a tenth of the card's room
    capacity = max(1000, n // 10)
    gw.settings["capacity_bytes"] = capacity * (HEADER + size)
    gw.start(wait=False)
    control.wait_until_up(gw.port, 600)
    while scanning(gw.port):
        time.sleep(0.05)
    before = control.request(gw.port, {"op": "STATS"}, timeout_s=30)["stats"]["cards"][0]
    kept = before["objects"]
    start = list(range(n - kept, n))            # the newest files stay: the LRU of a scan is by age
    evicted0 = evictions(gw.port)
    trace = zipf_trace(n, trace_len)
    client = client_of(gw.port, "trace")
    hits = 0
    for i in range(0, len(trace), 64):
        part = [keys[k] for k in trace[i:i + 64]]
        got = client.get(part, size, lambda b: None).result()
        hits += sum(got.hits)
        missed = [k for k, h in zip(part, got) if not h]
        if missed:
            uniq = list(dict.fromkeys(missed))
            client.put(uniq, size, lambda b, u=uniq: fill(client, b, u, size)).result()
    client.close()
    evicted = evictions(gw.port) - evicted0
    gw.stop()
    lru_hits, lru_evicted = exact_lru(trace, start, capacity)
    out.update(hit=round(hits / len(trace), 4), lru_hit=round(lru_hits / len(trace), 4),
               evict=round(evicted / len(trace), 4), lru_evict=round(lru_evicted / len(trace), 4))
    return out


def store_exist_us(root: str, keys: list[bytes], rounds: int) -> float:
    """µs a key (p50) of ``Lookup.exists`` of 16,384 stored keys on the card at ``root``
    (16 databases, the gateway's default placement), its index from the snapshot there."""
    snapshot = os.path.join(root, SNAPSHOT_FILE)
    with open(snapshot, "rb") as fh:
        saved = fh.read()
    card = FsCard(root, num_dbs=16)
    card.open()                                # takes the snapshot (and removes it)
    try:
        card.scanned.wait(600)                 # its check of the files ended: a gateway's steady state
        store = ObjectStore([card], 16, 16, "dialog", 0, True, 1, CardHealth([card], 0, 3), Pins())
        rng = np.random.default_rng(2)
        times = []
        for _ in range(rounds):
            ask = [keys[i] for i in rng.integers(0, len(keys), min(16384, len(keys)))]
            t = time.perf_counter()
            found = store.lookup.exists(ask, None)
            times.append((time.perf_counter() - t) / len(ask))
            assert all(found)
    finally:
        card.close()
    fd = os.open(snapshot, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(saved)
    return float(np.percentile(times, 50)) * 1e6


def fill(client, b, keys, size):
    for j in range(b.count):
        o = b.offset + j * b.stride
        client.ring[o:o + size] = payload_of(keys[b.first + j], size)


def evictions(port: int) -> int:
    s = control.request(port, {"op": "STATS"}, timeout_s=30)["stats"]
    return sum(t.get("evicted", 0) + t.get("capacity_evicted", 0) for t in s.get("tenants", []))


def plot(rows: list[dict], path: str) -> None:
    """One panel a figure against the count (log scale): memory an object, start-up (first
    start and restart from the snapshot), the scan, EXIST p50/p99 of 16k and of 512 keys
    (the 16k goal: 20 ms), the hit ratio against an exact LRU."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("RssAnon B / object", [("rss_b", "o-", "")], None),
              ("start to serving, s", [("serve_s", "o-", "first start"), ("snap_s", "x--", "restart (snapshot)")], 2.0),
              ("start to end of scan, s", [("scan_s", "o-", "")], None),
              ("EXIST 16k keys, ms", [("exist16k_p50_ms", "o-", "p50"), ("exist16k_p99_ms", "x--", "p99")], 20.0),
              ("EXIST 512 keys, ms", [("exist512_p50_ms", "o-", "p50"), ("exist512_p99_ms", "x--", "p99")], None),
              ("Zipf hit ratio", [("hit", "o-", "card"), ("lru_hit", "x--", "exact LRU")], None)]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (title, lines, goal) in zip(axes.flat, panels):
        for name, style, label in lines:
            have = [r for r in rows if name in r]      # a point whose trace did not run has no hit ratio
            ax.plot([r["objects"] for r in have], [r[name] for r in have], style, label=label or None)
        if goal is not None:
            ax.axhline(goal, color="grey", linewidth=0.8, linestyle=":", label="goal")
        if any(label for _, _, label in lines):
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("objects on the card")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def plot_rows(paths: list[str]) -> list[dict]:
    """The rows of ``--json`` files, the last of each count."""
    by_count: dict[int, dict] = {}
    for p in paths:
        with open(p) as fh:
            for line in fh:
                row = json.loads(line)
                by_count[row["objects"]] = row
    return [by_count[n] for n in sorted(by_count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="10000,100000")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--trace", type=int, default=20000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--plot", default="", help="a PNG of each figure against the count (needs matplotlib)")
    ap.add_argument("--json", default="", help="also write the rows as JSON lines here")
    ap.add_argument("--plot-from", default="", help="comma-separated --json files: only draw --plot from their rows")
    args = ap.parse_args()
    if args.plot_from:
        plot(plot_rows(args.plot_from.split(",")), args.plot)
        return
    base = tempfile.mkdtemp(dir=args.dir, prefix="card-scale-")
    rows = []
    try:
        empty = GatewayProcess(os.path.join(base, "empty"), log_path=os.path.join(base, "empty.log"),
                               shared_memory_size=256 << 20)
        t0 = time.monotonic()
        empty.start(wait=False)
        if not control.wait_until_up(empty.port, 600):
            raise RuntimeError(empty.log()[-3000:])
        print(json.dumps({"new_card_serve_s": round(time.monotonic() - t0, 2)}), flush=True)
        empty_rss = rss_anon(empty.proc.pid)
        empty.stop()
        for n in [int(c) for c in args.counts.split(",")]:
            row = one_count(base, n, args.size, args.rounds, args.trace, empty_rss)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
