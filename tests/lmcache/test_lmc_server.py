"""The real `lmcache server` with the adpkv L2 adapter: store, restart server and gateway, all hits from L2.

Driven by LMCache's own tools: `lmcache bench server --mode cpu --transfer-mode lmcache_driven`
(cold store + warm retrieve + checksum), then LMCache's ServerBenchClient (the class that command
uses) for the probes before and after the restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from lmc_helpers import LMCacheServerProcess, gateway_stats

N_SEQ = 4
NUM_TOKENS = 512          # + 1 sequence token → 2 full chunks of 256
NUM_BLOCKS = 256          # each sequence gets its own 32 blocks (own random content)
SHAPE = f"(2,{NUM_BLOCKS},16,8,128):float16:4"    # 4 layers, 1 MiB of KV per layer per chunk
CHUNKS = N_SEQ * 2


def _bench_config(server: LMCacheServerProcess):
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    return BenchConfig(rpc_url=server.rpc_url, http_url=server.http_url, mode="cpu",
                       transfer_mode="lmcache_driven", tp_size=1, use_mla=False, num_tokens=NUM_TOKENS,
                       kvcache_shape_spec=SHAPE, num_blocks=NUM_BLOCKS, block_size=16)


def _probe(server: LMCacheServerProcess, phase: str, reference: dict | None = None) -> dict[int, list[str]]:
    """Look up and retrieve every sequence; return the checksums of what came back.

    With ``reference``, the client's KV is wiped first and must differ from the reference before
    the retrieve, so equal checksums afterwards prove the bytes came back through LMCache.
    LMCache 0.5.6's bench client or 0.5.7's (``_BenchRequests``: the client's API changed).
    """
    zero_first = reference is not None
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient

    client = ServerBenchClient(_bench_config(server), log=lambda m: None)
    client.start()
    bench = _BenchRequests(client)
    out: dict[int, list[str]] = {}
    try:
        for seq in range(N_SEQ):
            req = bench.create(seq, f"probe-{phase}-{seq}-{uuid.uuid4().hex[:6]}")
            n = req.num_full_tokens
            if zero_first:
                bench.wipe(req, n)
                assert bench.checksums(req, n) != reference[seq], "wiping the KV changed nothing"
            lk = client.lookup(req)
            assert lk.succeeded and lk.is_full_hit, f"{phase}: seq {seq} hit {lk.hit_chunks}/{lk.total_chunks}"
            r = client.retrieve(req, 0, n)
            assert r is not None and r.succeeded, f"{phase}: retrieve of seq {seq} failed"
            out[seq] = bench.checksums(req, n)
            bench.end(req)
    finally:
        client.close()
    return out


def _bench_reuses_content() -> bool:
    """LMCache 0.5.7's bench client (the one whose ``create_request`` takes the tokens) stores the
    same KV content for every sequence of this test (equal checksums for all four, seen on
    0.5.7rc2), 0.5.6's a different one each; the wipe before each retrieve still proves the
    bytes came back from L2."""
    import inspect

    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    return "token_ids" in inspect.signature(ServerBenchClient.create_request).parameters


class _BenchRequests:
    """LMCache's ``ServerBenchClient`` requests in 0.5.6's shape (tokens made from the sequence
    number, KV filled with seeded random data, ``end_session``) or 0.5.7's (tokens passed in,
    blocks reserved per request, ``zero_destination``, checksums per receiver rank,
    ``release_request``); asked by what the client has, never by version number."""

    def __init__(self, client):
        import inspect
        self.client = client
        self.new_api = "token_ids" in inspect.signature(client.create_request).parameters

    def create(self, seq: int, request_id: str):
        kw = {}
        if self.new_api:
            from lmcache.cli.commands.bench.server_bench.helpers import _build_token_ids
            kw["token_ids"] = _build_token_ids(seq, NUM_TOKENS)    # what `lmcache bench server` sends
        return self.client.create_request(seq, request_id=request_id, request_kind="probe", **kw)

    def wipe(self, req, n: int) -> None:
        if self.new_api:
            self.client.zero_destination(req, 0, n)
            return
        # The bench client fills its KV with seeded random data, so a fresh client already
        # holds the "right" bytes; wipe them so only a real retrieve can bring them back.
        for w in self.client._workers:
            for t in w.kv_caches.values():
                t.zero_()

    def checksums(self, req, n: int):
        if self.new_api:     # per receiver rank: their digests in rank order
            by_rank = self.client.compute_checksums(req, 0, n, operation="retrieve") or {}
            return [d for rank in sorted(by_rank) for d in by_rank[rank]]
        return self.client.compute_checksums(req, 0, n)

    def end(self, req) -> None:
        (self.client.release_request if self.new_api else self.client.end_session)(req)


def _wait_for_l2(port: int, n_objects: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = gateway_stats(port)
        if st["objects"].get("stored", 0) >= n_objects and st["requests_in_flight"] == 0:
            return st
        assert time.monotonic() < deadline, f"L2 holds {st['objects']} after {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("l1", ["anonymous", "shm"])
def test_lmcache_server_restart_every_chunk_hits_from_l2(start_gateway, tmp_path, l1):
    """``l1="shm"``: the server's L1 pool is a /dev/shm file (``--shm-name``), which the adapter
    registers with the gateway: stores and loads skip the ring. Otherwise they go through it."""
    gw = start_gateway(shared_memory_size=64 << 20)
    spec = {"type": "plugin", "module_path": "adpkv_lmcache", "class_name": "AdpL2Adapter",
            "adapter_params": {"port": gw.port, "namespace": "server-restart-test"}}
    extra = ("--shm-name", f"adpkv_test_{uuid.uuid4().hex[:8]}") if l1 == "shm" else ()
    server = LMCacheServerProcess([spec], log_path=str(tmp_path / "lmcache-server.log"), extra=extra).start()
    try:
        # 1. LMCache's own end-to-end bench: cold requests store, warm ones retrieve (from L1)
        out = tmp_path / "bench.json"
        cmd = [os.path.join(os.path.dirname(sys.executable), "lmcache"), "bench", "server",
               "--rpc-url", server.rpc_url, "--url", server.http_url, "--mode", "cpu",
               "--transfer-mode", "lmcache_driven", "--kvcache-shape-spec", SHAPE, "--num-blocks", str(NUM_BLOCKS),
               "--num-tokens", str(NUM_TOKENS), "--start", "0", "--end", str(N_SEQ),
               # LMCache acks a STORE before its L1 write is finished; a lookup right behind it can
               # miss in L1 (seen with its fs adapter too). The bench's own default interval is 0.5 s.
               "--interval", "0.3",
               "--format", "json", "--output", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                           env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        res = json.loads(out.read_text())["metrics"]["results"]
        log = "\n".join(l for l in r.stdout.splitlines() if "[seq" in l or "===" in l)
        assert res["total_requests"] == N_SEQ and res["checksum_ok"] == N_SEQ, f"{res}\n{log}"

        # every chunk reached L2 (the store controller pushes L1 writes to the adapter)
        st = _wait_for_l2(gw.port, CHUNKS)
        assert st["objects"].get("store_failed", 0) == 0
        reference = _probe(server, "before")     # served from L1
        assert len(reference) == N_SEQ and all(reference.values())
        if not _bench_reuses_content():
            assert len({tuple(v) for v in reference.values()}) == N_SEQ   # distinct content per sequence
    finally:
        server.stop()

    # 2. restart both: the L1 tier is gone, only the gateway's card remains
    gw.stop()
    gw.start()
    hits_before = gateway_stats(gw.port)["objects"].get("hits", 0)
    server = LMCacheServerProcess([spec], log_path=str(tmp_path / "lmcache-server.log"), extra=extra).start()
    try:
        # 3. every chunk of every sequence hits (from L2), byte-exact
        after = _probe(server, "after", reference)
        assert after == reference
        st = gateway_stats(gw.port)
        assert st["objects"].get("hits", 0) - hits_before >= CHUNKS
        assert st["objects"].get("misses", 0) == 0
        direct = st["counters"].get("get_region_requests", 0)
        assert (direct > 0) if l1 == "shm" else (direct == 0), st["counters"]
        assert "AdpL2Adapter" in server.log()
    finally:
        server.stop()
    assert "Traceback" not in server.log()
