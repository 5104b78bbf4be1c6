"""One engine process of the GPU engine benchmark (``gpu_vllm_engine.py``): a real vLLM ``LLM``
built from a spec file, a list of steps run in order, one ``PHASE_RESULT {json}`` line printed.

    python benchmarks/gpu_engine_phase.py SPEC.json

``run_in_process`` runs one from a driver (``gpu_vllm_engine.py``, ``vllm_cpu_decode.py``).

The spec (written by the driver; prompts are (length, seed) pairs, made here, so no argv holds
128k token ids):

    {"llm": {LLM keyword arguments}, "kv_transfer_config": {...} | null,
     "prompts": {"p8k": [8192, 1], ...}, "vocab": 100000,
     "gateway": {"pid": N, "card_dirs": [...], "port": P, "settings": {...}, "log": PATH} | null,
     "steps": [{"do": "serve", "prompts": ["p8k", ...], "label": "restore"},
               {"do": "reset"},                       # vLLM's own prefix cache dropped
               {"do": "maps"},                        # the connector's background mappings settled
               {"do": "settle"},                      # the gateway's writes all landed
               {"do": "decode", "batch": 32, "prompt_tokens": 512, "tokens": 128, "repeats": 5},
               {"do": "warmup"}, {"do": "kill_gateway"}, {"do": "start_gateway"},
               {"do": "serve_until_cached", "prompts": [...], "label": ..., "deadline_s": 60},
               {"do": "drop_cache"}],                 # the gateway's card out of the page cache
     "timeline": true}                                # each served prompt's stages (engine_timeline.py)

Each served prompt: time to its first token (vLLM's own ``first_token_latency``, arrival to first
token), the tokens vLLM took from a cache (``num_cached_tokens``), the first 8 greedy tokens and
their logprobs. Runs one engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
connector's worker half is reachable for the ``maps`` step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Optional

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

RESULT = "PHASE_RESULT "
VOCAB_LOW = 3          # token ids of the synthetic prompts: [VOCAB_LOW, the spec's "vocab")


def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(VOCAB_LOW, vocab) for _ in range(length)]


class Phase:
    def __init__(self, spec: dict):
        from vllm import LLM
        from vllm.config import KVTransferConfig
        self.spec = spec
        self.vocab = spec["vocab"]
        self.prompts = {name: make_prompt(n, seed, self.vocab) for name, (n, seed) in spec.get("prompts", {}).items()}
        kw = dict(spec["llm"])
        kw.setdefault("disable_log_stats", False)        # per-request metrics: first_token_latency
        if spec.get("kv_transfer_config"):
            kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
        self.timeline = bool(spec.get("timeline"))
        if self.timeline:
            import engine_timeline
            engine_timeline.install()
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        self.init_s = time.perf_counter() - t0
        self.gateway = spec.get("gateway")
        self.results: list[dict] = []

    def graph_mode(self) -> str:
        cc = self.llm.llm_engine.vllm_config.compilation_config
        return str(getattr(cc, "cudagraph_mode", "?"))

    def serve(self, names: list[str], label: str) -> list[dict]:
        sp = serve_params()
        out = []
        for name in names:
            if self.timeline:
                import engine_timeline
                engine_timeline.clear()
            t = time.perf_counter()
            r = self.llm.generate([{"prompt_token_ids": self.prompts[name]}], sp, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            m = r.metrics
            ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) or wall
            comp = r.outputs[0]
            lps = [float(lp[t].logprob) for lp, t in zip(comp.logprobs or [], comp.token_ids)]
            out.append({"label": label, "prompt": name, "tokens_in": len(self.prompts[name]),
                        "ttft": ttft, "wall": wall, "cached": r.num_cached_tokens,
                        "tokens": list(comp.token_ids), "logprobs": lps})
            if self.timeline:
                import engine_timeline
                out[-1]["timeline"] = engine_timeline.stages(t, t + wall)
            print(f"[phase] {label} {name}: ttft {ttft:.3f} s, cached {r.num_cached_tokens}", flush=True)
        return out

    def reset(self, deadline_s: float = 60.0) -> None:
        """vLLM's prefix cache dropped; it refuses while a connector holds finished requests'
        blocks (released at an engine step), so a one-token request runs between tries."""
        from vllm import SamplingParams
        deadline = time.monotonic() + deadline_s
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's prefix cache could not be reset within {deadline_s} s")
            self.llm.generate([{"prompt_token_ids": [VOCAB_LOW]}], SamplingParams(max_tokens=1), use_tqdm=False)

    def maps(self, deadline_s: float = 120.0) -> dict:
        """Wait until the connector's background mappings (``adpkv.direct_map_bytes``) are done:
        first the gateway's writes (what a store maps is queued when its PUT ends: on the H100
        a 32k prompt's writes still ran when its mappings were drained, and its return went by
        the ring), then the mappings queued."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        conn = get_kv_transfer_group()
        worker = getattr(conn, "connector_worker", None)
        direct = getattr(worker, "direct", None)
        if direct is None:
            return {"maps": "none"}
        t = time.perf_counter()
        settled = self.settle(deadline_s)["settled"]
        ok = direct.drain(deadline_s)
        return {"maps_drained": ok, "writes_settled": settled, "maps_wait_s": time.perf_counter() - t}

    def settle(self, deadline_s: float = 120.0) -> dict:
        """Wait until the gateway has written everything handed to it (STATS: no request in
        flight, its ring free): what follows measures restores, not the race with the writes."""
        from gpu_vllm_engine import gateway_settled
        t = time.perf_counter()
        ok, _ = gateway_settled(self.gateway["port"], deadline_s)
        return {"settled": ok, "settle_s": time.perf_counter() - t}

    def decode(self, batch: int, prompt_tokens: int, tokens: int, repeats: int = 1) -> dict:
        """Decode tokens/s of ``batch`` requests: their prompts served once (one token, into
        vLLM's prefix cache), then ``repeats`` times for ``tokens`` tokens: decode steps; the
        median run is ``decode_tok_s``. With the timeline on, the steps vLLM scheduled and the
        CPU time of the calls into the connector in them (``engine_timeline.connector_calls``)."""
        from vllm import SamplingParams
        prompts = [{"prompt_token_ids": make_prompt(prompt_tokens, 10_000 + i, self.vocab)} for i in range(batch)]
        self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        runs, steps, calls = [], 0, {}
        for _ in range(repeats):
            if self.timeline:
                import engine_timeline
                engine_timeline.clear()
            t = time.perf_counter()
            outs = self.llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                                     use_tqdm=False)
            dt = time.perf_counter() - t
            runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            if self.timeline:
                steps += engine_timeline.steps()
                for name, (n, s) in engine_timeline.connector_calls().items():
                    c = calls.setdefault(name, [0, 0.0])
                    c[0] += n
                    c[1] += s
        res: dict = {"decode_batch": batch, "decode_tokens": batch * tokens, "decode_runs": runs,
                     "decode_tok_s": sorted(runs)[len(runs) // 2]}
        if steps:
            res["decode_steps"] = steps
            res["connector_ms_per_step"] = sum(s for _, s in calls.values()) * 1e3 / steps
            res["connector_calls_per_step"] = {k: round(n / steps, 2) for k, (n, _) in calls.items()}
            res["connector_ms_per_step_by_call"] = {k: round(t * 1e3 / steps, 4) for k, (_, t) in calls.items()}
        return res

    def warmup(self) -> dict:
        """An unrelated 600-token prompt first (two chunks: stored by the first engine with the
        connector, restored by the later ones), then once more (a hit of vLLM's own prefix
        cache): the one-time costs of the first request, of the first sampling with logprobs
        (the served prompts ask for them: vLLM's V1 runner compiled its sampler's logprob ranks
        there, 0.2 s on a CPU engine, in the first served prompt's time) and of the first
        prefill with a cached prefix are paid here, not by the first prompt measured."""
        t = time.perf_counter()
        prompt = {"prompt_token_ids": make_prompt(600, 7, self.vocab)}
        for _ in range(2):
            self.llm.generate([prompt], serve_params(), use_tqdm=False)
        return {"warmup_s": time.perf_counter() - t}

    def _rank_attachment(self):
        """The connector's worker-side attachment (this process runs the worker), or None."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        worker = getattr(get_kv_transfer_group(), "connector_worker", None)
        return getattr(worker, "attachment", None)

    def kill_gateway(self) -> dict:
        attachment = self._rank_attachment()
        self.reattaches_at_kill = attachment.reattaches if attachment is not None else 0
        pid = self.gateway["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _running(pid):   # dead or a zombie (the driver reaps it)
            time.sleep(0.05)
        try:
            os.unlink(f"/dev/shm/adpkv-ring-{self.gateway['port']}")
        except OSError:
            pass
        return {"killed_pid": self.gateway["pid"]}

    def start_gateway(self) -> dict:
        from adpkv_gateway.ops.spawn import GatewayProcess
        g = self.gateway
        gw = GatewayProcess(g["card_dirs"], port=g["port"], log_path=g["log"], **g["settings"]).start(timeout_s=120)
        assert gw.proc is not None
        g["pid"] = gw.proc.pid
        return {"gateway_pid": gw.proc.pid}

    def serve_until_cached(self, names: list[str], label: str, deadline_s: float) -> list[dict]:
        """Serve (prefix cache reset before each round) until a round that began with the rank
        re-attached to the gateway served every prompt from the cache, or the deadline: the
        rounds before recompute (a hit found by the lookups before the rank is back is a failed
        load, which vLLM recomputes). Each result says whether its round began re-attached."""
        attachment = self._rank_attachment()
        deadline = time.monotonic() + deadline_s
        out: list[dict] = []
        while True:
            back = attachment is None or attachment.reattaches > getattr(self, "reattaches_at_kill", 0)
            self.reset()
            got = self.serve(names, label)
            for r in got:
                r["rank_reattached"] = back
            out.extend(got)
            if (back and all(r["cached"] > 0 for r in got)) or time.monotonic() > deadline:
                return out

    def run(self) -> dict:
        info: dict = {"init_s": self.init_s, "graph_mode": self.graph_mode(), "steps": []}
        for step in self.spec["steps"]:
            do = step["do"]
            t = time.perf_counter()
            try:
                if do == "warmup":
                    res = self.warmup()
                elif do == "serve":
                    self.results.extend(self.serve(step["prompts"], step["label"]))
                    res: dict = {}
                elif do == "serve_until_cached":
                    self.results.extend(self.serve_until_cached(step["prompts"], step["label"],
                                                                step.get("deadline_s", 60.0)))
                    res = {}
                elif do == "reset":
                    self.reset()
                    res = {}
                elif do == "maps":
                    res = self.maps()
                elif do == "settle":
                    res = self.settle(step.get("deadline_s", 120.0))
                elif do == "decode":
                    res = self.decode(step["batch"], step["prompt_tokens"], step["tokens"], step.get("repeats", 1))
                elif do == "kill_gateway":
                    res = self.kill_gateway()
                elif do == "start_gateway":
                    res = self.start_gateway()
                elif do == "drop_cache":
                    from gpu_vllm_engine import drop_page_cache
                    res = drop_page_cache(self.gateway["card_dirs"][0])
                else:
                    raise ValueError(f"unknown step {do!r}")
            except Exception as exc:        # the phase goes on: the driver reports the step failed
                res = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"[phase] step {do} failed: {res['error']}", flush=True)
            info["steps"].append({"do": do, "s": time.perf_counter() - t, **res})
        info["results"] = self.results
        info["gateway_pid"] = (self.gateway or {}).get("pid")
        return info


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def serve_params():
    """What each served prompt asks: 8 greedy tokens and their logprobs (compared with the
    baseline's)."""
    from vllm import SamplingParams
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def run_in_process(spec: dict, spec_path: str, log_path: str, timeout_s: Optional[float] = None,
                   env: Optional[dict] = None) -> tuple[int, str, Optional[dict]]:
    """One phase in a fresh process of this file: ``spec`` written to ``spec_path``, the process's
    output to ``log_path``. Returns (its return code, its output, what it printed as its
    ``PHASE_RESULT``, or None when it failed or printed none)."""
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    penv = dict(os.environ, PYTHONHASHSEED="0", VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    with open(log_path, "w") as fh:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), spec_path], stdout=fh,
                           stderr=subprocess.STDOUT, env=penv, timeout=timeout_s)
    with open(log_path) as fh:
        text = fh.read()
    line = next((l for l in text.splitlines() if l.startswith(RESULT)), None)
    result = json.loads(line[len(RESULT):]) if p.returncode == 0 and line is not None else None
    return p.returncode, text, result


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    info = Phase(spec).run()
    print(RESULT + json.dumps(info), flush=True)
    sys.stdout.flush()
    os._exit(0)          # no engine teardown: the next phase starts at once (the driver waits for exit)


if __name__ == "__main__":
    main()
