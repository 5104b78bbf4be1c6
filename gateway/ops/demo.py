"""``adpkv demo``: a gateway on a local fs card, one prompt's KV stored, the gateway
restarted, and the prompt restored byte-exact by a fresh "engine"."""

from __future__ import annotations

import hashlib
import os
import random
import time

import xxhash

from adpkv_core.affinity import dialog_marks
from adpkv_core.client import GatewayClient
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig

from adpkv_gateway.ops.spawn import GatewayProcess

CHUNK = 256            # tokens per stored chunk
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 4, 128, 2


def _chunk_hashes(tokens: list[int]) -> list[bytes]:
    """Chained hashes of the prompt's chunks, as an engine computes them."""
    out, parent = [], b""
    for i in range(0, len(tokens) - CHUNK + 1, CHUNK):
        parent = hashlib.sha256(parent + repr(tokens[i:i + CHUNK]).encode()).digest()
        out.append(parent)
    return out


def _engine(port: int, name: str) -> GatewayClient:
    client = GatewayClient(ClientConfig(port=port, namespace="adpkv-demo"), engine_id=f"{name}-{os.getpid()}")
    if not client.enabled:
        raise SystemExit(f"demo: could not attach to the gateway: {client.attach_error}")
    return client


def run_demo(directory: str, tokens: int, layers: int) -> int:
    obj = CHUNK * KV_HEADS * HEAD_DIM * 2 * DTYPE_BYTES          # one chunk of one layer, K and V
    prompt = [random.Random(1).randrange(32000) for _ in range(tokens)]
    hashes = _chunk_hashes(prompt)
    n = len(hashes)
    kv = [memoryview(random.Random(10 + layer).randbytes(obj * n)) for layer in range(layers)]
    kb = KeyBuilder("adpkv-demo")
    marks = dialog_marks(hashes)
    gw = GatewayProcess(os.path.abspath(directory), log_path=os.path.abspath(directory) + ".gateway.log")
    print(f"adpkv demo: gateway on port {gw.port}, fs card {os.path.abspath(directory)} "
          f"(log {gw.log_path})")
    gw.start()
    try:
        a = _engine(gw.port, "engine-A")
        t0 = time.perf_counter()
        futs = []
        for layer in range(layers):
            def fill(b, layer=layer):
                a.ring[b.offset:b.offset + b.count * obj] = kv[layer][b.first * obj:(b.first + b.count) * obj]
            futs.append(a.put(kb.keys(hashes, [layer]), obj, fill, marks=marks))
        stored = sum(sum(f.result().stored) for f in futs)
        t_store = time.perf_counter() - t0
        a.close()
        total = obj * n * layers
        print(f"store  : {tokens}-token prompt, {n} chunks x {layers} layers = {stored} objects, "
              f"{total / 2**20:.0f} MiB in {t_store:.2f} s ({total / t_store / 1e9:.2f} GB/s)")
        gw.restart()
        print("restart: gateway stopped (SIGTERM) and started again on the same card")
        b_client = _engine(gw.port, "engine-B")
        hits = b_client.exist(kb.keys(hashes, [layers - 1]), marks=marks).result()
        print(f"lookup : {sum(hits)} of {n} chunks stored -> {sum(hits) * CHUNK} of {tokens} tokens restorable")
        out = [bytearray(obj * n) for _ in range(layers)]
        t0 = time.perf_counter()
        reads = []
        for layer in range(layers):
            dst = memoryview(out[layer])

            def copy(b, dst=dst):
                dst[b.first * obj:(b.first + b.count) * obj] = b_client.ring[b.offset:b.offset + b.count * obj]
            reads.append(b_client.get(kb.keys(hashes, [layer]), obj, copy, marks=marks))
        restored = sum(sum(f.result().hits) for f in reads)
        t_restore = time.perf_counter() - t0
        exact = all(xxhash.xxh3_64_intdigest(out[l]) == xxhash.xxh3_64_intdigest(kv[l]) for l in range(layers))
        b_client.close()
        print(f"restore: {restored} objects, {total / 2**20:.0f} MiB in {t_restore:.2f} s "
              f"({total / t_restore / 1e9:.2f} GB/s), byte-exact: {exact}")
    finally:
        gw.stop()
    return 0 if exact and restored == n * layers else 1
