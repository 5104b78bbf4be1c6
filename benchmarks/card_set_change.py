"""A change of the card set (issue 29): 4 -> 5 resp cards on real redis-server processes.

1. dialog placement: dialogs stored on 4 cards, the gateway restarted on 5: the share of the
   dialogs that hit before and hit right after the change (and the share that would miss
   without the previous layout: the dialogs whose slot changed owner); the moves on hit.
2. stripe placement: the background sweep moves everything: time and bytes to finish, and an
   engine's GET latency (dialogs stored after the change, so on their card) while the mover
   runs vs once the move is complete (a quiet card).

Run: python benchmarks/card_set_change.py [--dialogs 400] [--kib 64] [--rate-mib 16]
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
from adpkv_gateway import control
from adpkv_gateway.placement import Placement
from adpkv_gateway.spawn import GatewayProcess, RedisServer

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
        hits = c.get(keys, size, check, marks=marks).result(timeout=60)
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


def dialog_placement(tmp: str, servers, n: int, size: int) -> None:
    urls = [s.url for s in servers]
    gw = GatewayProcess(urls[:4], log_path=f"{tmp}/d4.log", storage_backend="resp", shared_memory_size=64 * MiB).start()
    ds = dialogs("bd", n, 1)
    store(gw.port, ds, size)
    before, _ = restore(gw.port, ds, size)
    serials4 = [c["serial"] for c in stats(gw.port)["cards"]]
    gw.stop()
    gw = GatewayProcess(urls, log_path=f"{tmp}/d5.log", storage_backend="resp", shared_memory_size=64 * MiB).start()
    serials5 = [c["serial"] for c in stats(gw.port)["cards"]]
    p4, p5 = Placement(serials4, 16), Placement(serials5, 16)
    changed = sum(serials4[p4.ranking(k[0], m[0])[0]] != serials5[p5.ranking(k[0], m[0])[0]] for k, m in ds)
    after, _ = restore(gw.port, ds, size)
    t = wait(lambda: stats(gw.port)["layout_change"]["moved_objects"] >= changed, 120)
    change = stats(gw.port)["layout_change"]
    again, _ = restore(gw.port, ds, size)
    gw.stop()
    hit_before = sum(before)
    print(f"dialog placement, {n} dialogs of one {size // 1024} KiB object, 4 -> 5 resp cards:")
    print(f"  hit before {hit_before}/{n}; right after the change {sum(a and b for a, b in zip(after, before))}"
          f"/{hit_before} ({100.0 * sum(a and b for a, b in zip(after, before)) / hit_before:.1f} %); "
          f"without the previous layout {hit_before - changed}/{hit_before} "
          f"({100.0 * (hit_before - changed) / hit_before:.1f} %)")
    print(f"  moved on hit: {change['moved_objects']} objects, {change['moved_bytes'] / MiB:.1f} MiB, "
          f"{t:.1f} s after the restore; hits after the moves {sum(again)}/{n}")


def stripe_placement(tmp: str, servers, n: int, size: int, rate: int) -> None:
    urls = [s.url for s in servers]
    gw = GatewayProcess(urls[:4], log_path=f"{tmp}/s4.log", storage_backend="resp", key_placement="stripe",
                        shared_memory_size=64 * MiB).start()
    ds = dialogs("bs", n, 4)
    store(gw.port, ds, size)
    gw.stop()
    gw = GatewayProcess(urls, log_path=f"{tmp}/s5.log", storage_backend="resp", key_placement="stripe",
                        move_rate_bytes=rate, shared_memory_size=64 * MiB).start()
    t0 = time.monotonic()
    hot = dialogs("hot", 50, 4)
    store(gw.port, hot, size)               # after the change: on their cards, read while the mover runs
    busy = []
    while not stats(gw.port)["layout_change"]["complete"] and len(busy) < 4000:
        busy += restore(gw.port, hot, size)[1]
    change = wait(lambda: stats(gw.port)["layout_change"]["complete"], 600) + time.monotonic() - t0
    figures = stats(gw.port)["layout_change"]
    quiet = []
    for _ in range(max(1, len(busy) // len(hot))):
        quiet += restore(gw.port, hot, size)[1]
    hit, _ = restore(gw.port, ds, size)
    gw.stop()

    def ms(xs, q):
        return 1e3 * statistics.quantiles(xs, n=100)[q - 1]
    print(f"stripe placement, {n} dialogs of 4 x {size // 1024} KiB, 4 -> 5 resp cards, move_rate_bytes "
          f"{rate / MiB:.0f} MiB/s:")
    print(f"  the sweep: {figures['moved_objects']} objects, {figures['moved_bytes'] / MiB:.1f} MiB moved in "
          f"{change:.1f} s; every dialog hits after: {sum(hit)}/{n}")
    print(f"  GET of a 4-object dialog: while the mover runs p50 {ms(busy, 50):.2f} ms p90 {ms(busy, 90):.2f} ms "
          f"({len(busy)} GETs); quiet p50 {ms(quiet, 50):.2f} ms p90 {ms(quiet, 90):.2f} ms ({len(quiet)} GETs)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dialogs", type=int, default=400)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--rate-mib", type=float, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        servers = [RedisServer(f"{tmp}/r{i}").start() for i in range(5)]
        try:
            dialog_placement(tmp, servers, args.dialogs, args.kib * 1024)
            for s in servers:
                s.kill()
            servers = [RedisServer(f"{tmp}/q{i}").start() for i in range(5)]
            stripe_placement(tmp, servers, args.dialogs, args.kib * 1024, int(args.rate_mib * MiB))
        finally:
            for s in servers:
                s.kill()


if __name__ == "__main__":
    main()
