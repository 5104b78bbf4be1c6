"""A change of the card set (issue 29): 4 -> 5 resp cards on real redis-server processes,
with each placement (``--placement dialog`` (the default placement), ``stripe`` or ``both``).

Dialogs stored on 4 cards, the gateway restarted on 5 with ``move_rate_bytes``; the mover's
sweep moves every object whose card changed (with ``dialog`` placement by the slot tag its
head records). Printed: the dialogs that hit before the change, right after it (the sweep just
began), and after it is complete (every hit byte-compared); with ``dialog``, those that would
hit without the previous layout (their slot kept its owner); the objects and bytes moved, the
time to complete and the rate against ``move_rate_bytes``; and an engine's GET latency (50
dialogs stored after the change, so on their cards) while the mover runs vs once it is done.

Run: python benchmarks/card_set_change.py [--dialogs 400] [--kib 64] [--rate-mib 16] [--placement both]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time

from adpkv_core.affinity import dialog_marks
from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.store.placement import Placement
from adpkv_gateway.ops.spawn import GatewayProcess, RedisServer

MiB = 1 << 20


def dialogs(namespace: str, n: int, chunks: int) -> list[tuple[list[bytes], list[int]]]:
    kb, out = KeyBuilder(namespace), []
    for d in range(n):
        hashes, parent = [], b""
        for c in range(chunks):
            parent = hashlib.sha256(parent + f"{namespace}{d}/{c}".encode()).digest()
            hashes.append(parent)
        out.append((kb.keys(hashes), dialog_marks(hashes, 1)))
    return out


def payload(key: bytes, size: int) -> bytes:
    return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]


def store(port: int, ds, size: int) -> None:
    c = GatewayClient(ClientConfig(port=port, busy_wait_s=5), "bench-writer")
    for keys, marks in ds:
        def fill(b, keys=keys):
            for j in range(b.count):
                o = b.offset + j * b.stride
                c.ring[o:o + size] = payload(keys[b.first + j], size)
        assert all(c.put(keys, size, fill, marks=marks).result(timeout=60).stored)
    c.close()


def restore(port: int, ds, size: int) -> tuple[list[bool], list[float]]:
    """Per dialog whether all of it hit (every hit byte-compared), and each GET's seconds."""
    c = GatewayClient(ClientConfig(port=port, busy_wait_s=5), "bench-reader")
    hit, seconds = [], []
    for keys, marks in ds:
        wrong = []

        def check(b, keys=keys):
            for j in range(b.count):
                if b.hits[j]:
                    o = b.offset + j * b.stride
                    if bytes(c.ring[o:o + size]) != payload(keys[b.first + j], size):
                        wrong.append(j)
        t = time.perf_counter()
        hits = c.get(keys, size, check, marks=marks).result(timeout=60).hits
        seconds.append(time.perf_counter() - t)
        assert not wrong, "wrong bytes restored"
        hit.append(all(hits))
    c.close()
    return hit, seconds


def stats(port: int) -> dict:
    return control.request(port, {"op": "STATS"})["stats"]


def wait(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError


def change(tmp: str, servers, placement: str, n: int, size: int, rate: int) -> None:
    urls = [s.url for s in servers]
    chunks = 4
    opts = dict(storage_backend="resp", key_placement=placement, shared_memory_size=64 * MiB)
    gw = GatewayProcess(urls[:4], log_path=f"{tmp}/{placement}4.log", **opts).start()
    ds = dialogs("b" + placement, n, chunks)
    store(gw.port, ds, size)
    before, _ = restore(gw.port, ds, size)
    serials4 = [c["serial"] for c in stats(gw.port)["cards"]]
    gw.stop()
    gw = GatewayProcess(urls, log_path=f"{tmp}/{placement}5.log", move_rate_bytes=rate, **opts).start()
    t0 = time.monotonic()
    right_after, _ = restore(gw.port, ds, size)          # the sweep has just begun
    serials5 = [c["serial"] for c in stats(gw.port)["cards"]]
    p4, p5 = Placement(serials4, 16, placement), Placement(serials5, 16, placement)
    kept = sum(all(serials4[p4.ranking(k, m)[0]] == serials5[p5.ranking(k, m)[0]] for k, m in zip(keys, marks))
               for keys, marks in ds)
    hot = dialogs("hot" + placement, 50, 4)
    store(gw.port, hot, size)               # after the change: on their cards, read while the mover runs
    busy = []
    while not stats(gw.port)["layout_change"]["complete"] and len(busy) < 4000:
        busy += restore(gw.port, hot, size)[1]
    took = wait(lambda: stats(gw.port)["layout_change"]["complete"], 600) + time.monotonic() - t0
    figures = stats(gw.port)["layout_change"]
    quiet = []
    for _ in range(max(1, len(busy) // len(hot))):
        quiet += restore(gw.port, hot, size)[1]
    after, _ = restore(gw.port, ds, size)
    gw.stop()

    def ms(xs, q):
        return 1e3 * statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else float("nan")
    hit = sum(before)
    both = sum(a and b for a, b in zip(right_after, before))
    print(f"{placement} placement, {n} dialogs of {chunks} x {size // 1024} KiB, 4 -> 5 resp cards, "
          f"move_rate_bytes {rate / MiB:g} MiB/s:")
    print(f"  dialogs that hit: before {hit}/{n}; right after the change {both}/{hit} ({100.0 * both / hit:.1f} %); "
          f"after the move {sum(after)}/{n}" + (f"; without the previous layout {kept}/{n} ({100.0 * kept / n:.1f} %)"
                                               if placement == "dialog" else ""))
    print(f"  moved: {figures['moved_objects']} objects, {figures['moved_bytes'] / MiB:.1f} MiB, complete "
          f"{took:.1f} s after the start; {figures['moved_bytes'] / MiB / took:.1f} MiB/s "
          f"(move_rate_bytes {rate / MiB:g} MiB/s)")
    print(f"  GET of a 4-object dialog: while the mover runs p50 {ms(busy, 50):.2f} ms p90 {ms(busy, 90):.2f} ms "
          f"({len(busy)} GETs); quiet p50 {ms(quiet, 50):.2f} ms p90 {ms(quiet, 90):.2f} ms ({len(quiet)} GETs)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dialogs", type=int, default=400)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--rate-mib", type=float, default=16)
    ap.add_argument("--placement", choices=("dialog", "stripe", "both"), default="both")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for placement in (("dialog", "stripe") if args.placement == "both" else (args.placement,)):
            servers = [RedisServer(f"{tmp}/{placement}{i}").start() for i in range(5)]
            try:
                change(tmp, servers, placement, args.dialogs, args.kib * 1024, int(args.rate_mib * MiB))
            finally:
                for s in servers:
                    s.kill()


if __name__ == "__main__":
    main()
