"""The fs card's index alone at counts no disk here holds (issue 26: 10M objects).

A card of 10M object files needs about 80 GB on a 4 KiB-block file system (a 1 KiB object
is a 5 KiB file); ``card_scale.py`` measures real cards up to what the disk holds. This
measures what does not need the files: the index (``FsIndex``) of ``n`` single-fragment
objects, taken from a snapshot in the card's own format (``fs_snapshot.write``, as a clean
stop leaves it, with its hash table; the rows as a gateway would have indexed them), in one
process:

- ``load_s``: ``FsIndex.load`` of the snapshot (read, checksum, hash table checked whole):
  what a restart costs before the card serves (its check of the files runs after, in the
  background);
- ``rss_b``: anonymous memory (``RssAnon``) the loaded index adds, per object;
- ``found16k_us``: ``FsIndex.heads_found`` of 16,384 random stored keys (what an EXIST asks
  the fs card), p50 and p99 over ``--rounds``, per key; every key must be found.

    python benchmarks/index_scale.py --counts 1000000,10000000 [--dir /var/tmp] [--json rows.jsonl]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "core"))

from fs_cards import card_keys  # noqa: E402

from adpkv_gateway.cards.fs import snapshot as fs_snapshot  # noqa: E402
from adpkv_gateway.cards.base import FirstExtent  # noqa: E402
from adpkv_gateway.cards.fs.files import FileRef  # noqa: E402
from adpkv_gateway.cards.fs.index import START_TICK, FsIndex  # noqa: E402
from adpkv_gateway.cards.fs.rows import Rows  # noqa: E402
from adpkv_gateway.cards.fragments import head_dbs  # noqa: E402
from adpkv_gateway.cards.quotas import tenant_of  # noqa: E402

SIZE, ON_DISK, NUM_DBS = 1024, 8192, 16


def rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def write_snapshot(where: int, keys: list[bytes]) -> None:
    """A snapshot of ``keys`` as single-fragment objects of ``SIZE`` bytes, in their databases."""
    n = len(keys)
    rows = Rows(capacity=n)
    rows.n = n
    rows.key[:n] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, -1)
    rows.disk[:n], rows.total[:n], rows.flen[:n], rows.nfrag[:n] = ON_DISK, SIZE, SIZE, 1
    rows.db0[:n], rows.dbmod[:n] = head_dbs(keys, NUM_DBS), 0
    rows.gen[:n] = np.arange(1, n + 1)
    rows.wid[:n] = np.random.default_rng(0).integers(1, 1 << 62, n, dtype=np.uint64)
    rows.tick[:n] = START_TICK - 1
    rows.ns[:n] = 0
    snap = fs_snapshot.Snapshot(rows, [tenant_of(keys[0])], n, START_TICK, 12345, time.time())
    fs_snapshot.write(where, "index", "SERIAL", {}, NUM_DBS, snap, lambda fd: None)


def one(n: int, base: str, rounds: int) -> dict:
    keys = card_keys(n)
    d = tempfile.mkdtemp(dir=base, prefix="index-scale-")
    where = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_snapshot(where, keys)            # rows only: the index hashes them once here
        built = FsIndex(d, lambda db, fkey: FileRef(where, fkey.hex()), num_dbs=NUM_DBS)
        if built.load(where, "index", "SERIAL", {}) is not None:
            raise RuntimeError("the rows' snapshot was not taken")
        built.save(where, "index", "SERIAL", {}, lambda fd: None)      # as a clean stop writes it
        del built
        gc.collect()
        before = rss_anon()
        index = FsIndex(d, lambda db, fkey: FileRef(where, fkey.hex()), num_dbs=NUM_DBS)
        t = time.perf_counter()
        why = index.load(where, "index", "SERIAL", {})
        load_s = time.perf_counter() - t
        if why is not None:
            raise RuntimeError(f"the snapshot was not taken: {why}")
        gc.collect()
        grown = rss_anon() - before
        rng = np.random.default_rng(1)
        first = FirstExtent(None, 0)
        times = []
        for _ in range(rounds):
            ask = [keys[i] for i in rng.integers(0, n, 16384)]
            t = time.perf_counter()
            found = index.heads_found(ask, first)
            times.append((time.perf_counter() - t) / len(ask))
            if not found.found.all():
                raise RuntimeError("a stored key was not found")
        return {"objects": n, "load_s": round(load_s, 2), "rss_b": round(grown / n, 1),
                "found16k_us_p50": round(float(np.percentile(times, 50)) * 1e6, 3),
                "found16k_us_p99": round(float(np.percentile(times, 99)) * 1e6, 3)}
    finally:
        os.close(where)
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1000000,10000000")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", help="also append the rows as JSON lines here")
    args = ap.parse_args()
    for n in [int(c) for c in args.counts.split(",")]:
        row = one(n, args.dir, args.rounds)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
