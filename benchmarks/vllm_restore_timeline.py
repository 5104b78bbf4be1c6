"""The timeline of one AdpKVConnector restore in a real vLLM engine: where a returning
prompt's time goes between the lookup and the step that runs it.

Runs after ``benchmarks/vllm_ttft.py --workdir W`` (its model and its card, namespace
``ttft-bench``, the same prompts from the same seed): a gateway on W's card, one fresh engine
with the connector (one process, scheduler and worker in it) serving the warm-up prompt and
then the prompt of ``--length`` tokens. The connector's lookup, load plan, ``start_load_kv``
and transfer results, and vLLM's ``Scheduler.schedule`` (when it schedules tokens) are
wrapped with timers; the events of the prompt are printed in ms after its lookup.

    ~/.cache/adpkv/venvs/vllm/bin/python benchmarks/vllm_restore_timeline.py --workdir W --arch gemma3 --length 16384
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("PYTHONHASHSEED", "0")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "vllm"))

EVENTS: list[tuple[float, str]] = []


def timed(cls, name: str, label: str, describe) -> None:
    """Wrap ``cls.name``: an event when ``describe(result, args)`` is not None."""
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        result = inner(self, *args, **kwargs)
        text = describe(result, args)
        if text is not None:
            EVENTS.append((t0, f"{label} {text} ({(time.perf_counter() - t0) * 1e3:.1f} ms call)"))
        return result

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="a vllm_ttft.py --workdir (model and card)")
    ap.add_argument("--arch", required=True)
    ap.add_argument("--lengths", default="4096,16384", help="the vllm_ttft.py run's --lengths")
    ap.add_argument("--length", type=int, default=16384, help="the prompt to restore")
    ap.add_argument("--max-batched", type=int, default=None)
    args = ap.parse_args()

    import engine_run
    from adpkv_gateway.ops.spawn import GatewayProcess
    from adpkv_vllm.connector import scheduler as sched_role, worker as worker_role
    from hybrid_models import HYBRID_MODELS
    from vllm.v1.core.sched.scheduler import Scheduler

    timed(sched_role.AdpConnectorScheduler, "get_num_new_matched_tokens", "lookup answered",
          lambda r, a: f"{r[0]} tokens")
    timed(sched_role.AdpConnectorScheduler, "build_connector_meta", "load planned",
          lambda r, a: f"{len(r.loads)} plans" if r.loads else None)
    timed(worker_role.AdpConnectorWorker, "start_load_kv", "GETs issued",
          lambda r, a: "" if getattr(a[0], "loads", None) else None)
    timed(worker_role.AdpConnectorWorker, "transfer_results", "received",
          lambda r, a: f"{sorted(r[1])} failed {sorted(r[2])}" if r[1] else None)
    timed(Scheduler, "schedule", "scheduled",
          lambda r, a: f"{r.total_num_scheduled_tokens} tokens" if r.total_num_scheduled_tokens else None)

    lengths = [int(x) for x in args.lengths.split(",")]
    rnd = random.Random(42)        # vllm_ttft.py's prompts, in its order
    prompts = [[rnd.randrange(3, 1000) for _ in range(n)] for n in lengths]
    warm = [rnd.randrange(3, 1000) for _ in range(300)]
    gw = GatewayProcess([os.path.join(args.workdir, "card")],
                        log_path=os.path.join(args.workdir, "timeline-gateway.log"), shared_memory_size=1 << 30)
    gw.start()
    conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": gw.port, "adpkv.namespace": "ttft-bench",
                                          "adpkv.load_choice": "always"}}
    max_len = max(lengths) + 512
    spec = dict(model=os.path.join(args.workdir, f"model-{args.arch}"), dtype=HYBRID_MODELS[args.arch]["dtype"],
                block_size=None, prompts=[warm, prompts[lengths.index(args.length)]], connector=conn,
                max_tokens=1, max_model_len=max_len, kv_cache_bytes=max(256 << 20, 4 * max_len * 2 * 1024 * 2))
    if args.max_batched:
        spec["max_num_batched_tokens"] = args.max_batched
    try:
        results = engine_run.run(spec)["results"]
    finally:
        gw.stop()
    # the prompt's first lookup: the last run of lookups (one a step while its EXIST is pending)
    last = max(i for i, (_, what) in enumerate(EVENTS) if what.startswith("lookup"))
    while last > 0 and EVENTS[last - 1][1].startswith("lookup"):
        last -= 1
    t0 = EVENTS[last][0]
    for t, what in EVENTS:
        if t >= t0:
            print(f"{(t - t0) * 1e3:8.1f} ms  {what}")
    print(f"restored {results[1]['cached']} of {args.length} tokens, TTFT {results[1]['ttft']:.3f} s")


if __name__ == "__main__":
    main()
