"""The fs card's index structures measured side by side: bytes an object and lookup time.

In one process, for ``--n`` single-fragment objects (28-byte keys), each structure filled
as the card fills it (reserve + commit per object), then looked up: one key at a time
(``locate``) and 16,384 at a time (``contains_many`` + ``object_sizes``, what an EXIST
costs the card). Memory is the growth of the process's anonymous memory (``RssAnon``)
while it is filled, an object. Structures:

- ``numpy``: ``FsIndex`` as the card has it (a table of numpy columns, open addressing);
- ``dicts``: the index before it (``--old``: a copy of the earlier ``fs_index.py``: an
  ``OrderedDict`` of objects, a dict of fragments each, a ``TenantBook`` LRU);
- ``dict``: the least a Python mapping costs: ``{key: (db, size, gen)}`` alone, no LRU;
- ``lmdb`` / ``rocksdict``: an embedded store on disk (under ``--dir``) holding each object's
  row ``(db, size, gen)`` packed (20 bytes) under its key, filled in transactions / write
  batches of 1,000; a lookup is one ``get`` each (a 16k-key EXIST: 16,384 C calls). Their
  memory is the store's own: its file's pages in the page cache (lmdb maps its file; ``RssFile``
  growth and the file's size are reported too) and its caches, not counted in ``RssAnon``. No
  LRU, no namespaces (those would be another table kept beside). Not project dependencies:
  ``pip install lmdb rocksdict`` to measure them.

    python benchmarks/index_alternatives.py --n 1000000 [--old /tmp/old_fs_index.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from typing import Optional

from adpkv_core.keys import KeyBuilder
from adpkv_gateway.cards.base import FirstExtent
from adpkv_gateway.cards.fragments import fragment_key


def rss(kind: str = "RssAnon") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_anon() -> int:
    return rss("RssAnon")


ROW = struct.Struct("<HQQ")       # db, size on disk, generation: an embedded store's value


class EmbeddedStore:
    """An lmdb environment or a RocksDB (``rocksdict``) under ``where``: key -> ``ROW``."""

    def __init__(self, kind: str, where: str):
        self.kind = kind
        self.where = where
        if kind == "lmdb":
            import lmdb
            self.env = lmdb.open(where, map_size=1 << 40, writemap=False, sync=False, metasync=False,
                                 readahead=False, lock=True)
        else:
            from rocksdict import Options, Rdict
            self.db = Rdict(where, Options(raw_mode=True))

    def fill(self, fkeys: list[bytes]) -> None:
        for at in range(0, len(fkeys), 1000):
            part = fkeys[at:at + 1000]
            if self.kind == "lmdb":
                with self.env.begin(write=True) as txn:
                    for i, f in enumerate(part, at):
                        txn.put(f, ROW.pack(0, 5120, i))
            else:
                from rocksdict import WriteBatch
                wb = WriteBatch(raw_mode=True)
                for i, f in enumerate(part, at):
                    wb.put(f, ROW.pack(0, 5120, i))
                self.db.write(wb)

    def get_many(self, fkeys: list[bytes]) -> list[Optional[bytes]]:
        if self.kind == "lmdb":
            with self.env.begin() as txn:
                return [txn.get(f) for f in fkeys]
        return [self.db.get(f) for f in fkeys]

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.where) for f in fs)


def measure_embedded(kind: str, n: int, keys: list[bytes], where: str) -> dict:
    fkeys = [fragment_key(k, 0) for k in keys]
    before, before_file = rss_anon(), rss("RssFile")
    store = EmbeddedStore(kind, where)
    t = time.perf_counter()
    store.fill(fkeys)
    fill_us = (time.perf_counter() - t) / n * 1e6
    per_object = (rss_anon() - before) / n
    probe = fkeys[:: max(1, n // 20000)][:20000]
    t = time.perf_counter()
    for f in probe:
        store.get_many([f])
    locate_ns = (time.perf_counter() - t) / len(probe) * 1e9
    batch = fkeys[: min(n, 16384)]
    t = time.perf_counter()
    for _ in range(5):
        if not all(v is not None for v in store.get_many(batch)):
            raise RuntimeError(f"{kind}: a stored key was not found")
    batch_ns = (time.perf_counter() - t) / 5 / len(batch) * 1e9
    return {"structure": kind, "objects": n, "bytes_per_object": round(per_object, 1),
            "rss_file_bytes_per_object": round((rss("RssFile") - before_file) / n, 1),
            "disk_bytes_per_object": round(store.disk_bytes() / n, 1),
            "fill_us": round(fill_us, 2), "locate_ns": round(locate_ns), "exist16k_ns_per_key": round(batch_ns)}


def measure(name: str, make, n: int, keys: list[bytes]) -> dict:
    fkeys = [fragment_key(k, 0) for k in keys]
    before = rss_anon()
    index = make()
    t = time.perf_counter()
    if name == "dict":
        for i, f in enumerate(fkeys):
            index[f] = (0, 5120, i)
    else:
        for k, f in zip(keys, fkeys):
            index.reserve(k, f, 5120)
            index.commit(f, 0, 1024, 5120, 1024) if name == "numpy" else index.commit(f, 0, 5120, 1024)
    fill_us = (time.perf_counter() - t) / n * 1e6
    per_object = (rss_anon() - before) / n
    probe = fkeys[:: max(1, n // 20000)][:20000]
    t = time.perf_counter()
    for f in probe:
        index.get(f) if name == "dict" else index.locate(f)
    locate_ns = (time.perf_counter() - t) / len(probe) * 1e9
    batch = fkeys[: min(n, 16384)]
    okeys = keys[: min(n, 16384)]
    t = time.perf_counter()
    for _ in range(5):
        if name == "dict":
            [f in index for f in batch]
        elif name == "numpy":            # what the fs card asks for an EXIST: one batch lookup
            index.heads_found(okeys, FirstExtent(None, 0))
        else:
            index.contains_many(batch, [1024] * len(batch))
            index.object_sizes(batch)
    batch_ns = (time.perf_counter() - t) / 5 / len(batch) * 1e9
    return {"structure": name, "objects": n, "bytes_per_object": round(per_object, 1),
            "fill_us": round(fill_us, 2), "locate_ns": round(locate_ns), "exist16k_ns_per_key": round(batch_ns)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--structure", default="numpy", choices=["numpy", "dicts", "dict", "lmdb", "rocksdict"])
    ap.add_argument("--old", default="", help="the earlier fs_index.py (for --structure dicts)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where lmdb / rocksdict keep their files")
    args = ap.parse_args()
    keys = KeyBuilder("alt").keys([i.to_bytes(8, "big") for i in range(args.n)])
    if args.structure in ("lmdb", "rocksdict"):
        where = tempfile.mkdtemp(dir=args.dir, prefix=f"index-{args.structure}-")
        try:
            print(json.dumps(measure_embedded(args.structure, args.n, keys, where)))
        finally:
            shutil.rmtree(where, ignore_errors=True)
        return
    if args.structure == "numpy":
        from adpkv_gateway.cards.fs.index import FsIndex
        make = lambda: FsIndex("/x", lambda db, f: "/x", capacity_bytes=1 << 50)   # noqa: E731
    elif args.structure == "dicts":
        spec = importlib.util.spec_from_file_location("adpkv_gateway.cards.old_fs_index", args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old
        spec.loader.exec_module(old)
        make = lambda: old.FsIndex("/x", lambda db, f: "/x", capacity_bytes=1 << 50)   # noqa: E731
    else:
        make = dict
    print(json.dumps(measure(args.structure, make, args.n, keys)))


if __name__ == "__main__":
    main()
