"""Run a tiny random Llama in vLLM on CPU (one process) and print a JSON result line.

Used by the tests and the benchmark as a fresh subprocess:

    python -m tests.vllm.engine_run '{"model": DIR, "prompts": [[...]], "connector": {...} | null, ...}'

The model has real (seeded, random) weights, so its greedy output depends on
the KV cache it attends to: a restored cache that is wrong changes the tokens.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # scheduler + worker in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float32", "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def make_model(path: str, layers: int = 2, seed: int = 0, config: dict | None = None) -> str:
    """A LlamaForCausalLM checkpoint with seeded random weights (a few MB).

    ``config`` adds to config.json, e.g. ``{"sliding_window": 400, "layer_types":
    ["sliding_attention", ...]}`` (vLLM's Llama reads the window per layer from layer_types)."""
    import torch
    from safetensors.torch import save_file
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg = dict(CONFIG, num_hidden_layers=layers, **(config or {}))
    g = torch.Generator().manual_seed(seed)
    h, i, v, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=g),
         "model.norm.weight": torch.ones(h), "lm_head.weight": lin(v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, h) * 2.0
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, h) * 2.0
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, nh * hd)
        w[p + "mlp.gate_proj.weight"] = lin(i, h)
        w[p + "mlp.up_proj.weight"] = lin(i, h)
        w[p + "mlp.down_proj.weight"] = lin(h, i)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file({k: t.contiguous() for k, t in w.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return path


def make_hf_model(path: str, config: dict, seed: int = 0, dtype: str = "float32") -> str:
    """A checkpoint of any architecture transformers knows (``config["model_type"]``) with
    seeded random weights: Transformers' own initialisation (``initializer_range`` from
    the config), saved as safetensors. Used for the hybrid architectures (Gemma 3, gpt-oss,
    Qwen3-Next, Falcon-H1, Mamba2, DeepSeek V2/V3 ...): tiny, but real weights whose greedy
    output depends on the KV cache and recurrent state they read."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    hf_config.dtype = dtype
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype=spec.get("dtype", "float32"),
              max_model_len=spec.get("max_model_len", 8192), seed=0,
              kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 << 20),
              distributed_executor_backend="mp" if spec.get("tensor_parallel_size", 1) > 1 else "uni",
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096))
    if spec.get("prefix_caching", True) is not None:   # None: vLLM's default for the model
        kw["enable_prefix_caching"] = spec.get("prefix_caching", True)
    if spec.get("block_size", 32) is not None:     # None: the block size vLLM picks for the model
        kw["block_size"] = spec.get("block_size", 32)
    kw.update(spec.get("engine_args") or {})       # e.g. {"mamba_cache_mode": "align"}
    conn = spec.get("connector")
    if conn:
        kw["kv_transfer_config"] = KVTransferConfig(**conn)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    init_s = time.perf_counter() - t0
    drafts: list = []                      # speculative decoding: the draft tokens of each step
    if spec.get("record_drafts"):
        _record_drafts(llm, drafts)
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, ignore_eos=True)
    results = []
    salts = spec.get("salts") or [None] * len(spec["prompts"])
    rounds = spec.get("rounds", 1)
    kill = spec.get("kill_after")          # {"pid": gateway pid, "after": n requests}: a crash mid-serve
    served = 0
    threads_at = None     # count_threads: the OS threads once the first prompt is served (vLLM's own made)
    for rnd in range(rounds):
        for prompt, salt in zip(spec["prompts"], salts):
            tp = TokensPrompt(prompt_token_ids=prompt)
            if salt is not None:
                tp["cache_salt"] = salt
            t = time.perf_counter()
            out = llm.generate([tp], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t
            m = out.metrics
            results.append({"round": rnd, "tokens": list(out.outputs[0].token_ids),
                            "cached": out.num_cached_tokens, "seconds": dt,
                            "ttft": _ttft(m, dt)})
            if spec.get("record_drafts"):
                results[-1]["drafts"], drafts[:] = list(drafts), []
            served += 1
            if spec.get("count_threads") and served == 1:
                threads_at = _native_threads()
            if kill and served == kill["after"]:
                os.kill(kill["pid"], signal.SIGKILL)
        if spec.get("reset_prefix_cache_between_rounds", True):
            _reset_prefix_cache(llm, spec.get("reset_wait_s"))
        if spec.get("drain_maps_between_rounds"):
            _drain_direct_maps(spec["drain_maps_between_rounds"])
        if spec.get("sleep_between_rounds"):
            time.sleep(spec["sleep_between_rounds"])
    if spec.get("wait_after_s"):
        time.sleep(spec["wait_after_s"])
    out = {"init_s": init_s, "results": results}
    if threads_at is not None:
        import threading
        import torch
        python = {t.native_id for t in threading.enumerate()}
        out["threads"] = {"torch": torch.get_num_threads(),
                          "new_native": sorted(_native_threads() - threads_at - python)}
    return out


def _native_threads() -> set[int]:
    """The ids of this process's OS threads."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _reset_prefix_cache(llm, wait_s) -> None:
    """Drop vLLM's own prefix cache. vLLM refuses while a connector still holds finished
    requests' blocks (until their saves are in the ring), and releases them only at an engine
    step: with ``wait_s`` set, a one-token prompt is served between tries until the reset
    succeeds (an error after ``wait_s``), so that the next round cannot hit vLLM's own cache;
    without it, one try (its result ignored)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    if wait_s is None:
        llm.reset_prefix_cache()
        return
    deadline = time.monotonic() + wait_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's prefix cache could not be reset within {wait_s} s")
        llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(max_tokens=1), use_tqdm=False)


def _drain_direct_maps(timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the connector's background mappings
    (``adpkv.direct_map_bytes``) are done: the engine runs in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    direct = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "direct", None)
    if direct is not None and not direct.drain(timeout_s):
        raise RuntimeError(f"the connector's mappings were not done within {timeout_s} s")


def run_subprocess(model_dir, prompts, conn=None, salts=None, log_path=None, timeout=300, whole=False, **spec):
    """Run one engine in a fresh process; returns (results, log text), or with ``whole`` (the
    result dict: results, init_s, threads with ``count_threads``, log text)."""
    import subprocess
    spec = dict(model=model_dir, prompts=prompts, connector=conn, salts=salts, max_tokens=8, **spec)
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    tp = spec.get("tensor_parallel_size", 1)
    if tp > 1:
        # vLLM-CPU's TP workers (gloo): one NUMA node here, so each rank's OpenMP threads are
        # bound to a core of their own by hand (cores shared round-robin when there are fewer)
        cores = sorted(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cores[r % len(cores)]) for r in range(tp)))
    env.setdefault("ADPKV_LOG_LEVEL", "INFO")    # the connector's lines also where a model configured logging
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    log = proc.stdout + proc.stderr
    if log_path:
        with open(log_path, "w") as fh:
            fh.write(log)
    assert proc.returncode == 0, log[-6000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("ENGINE_RESULT "))
    res = json.loads(line[len("ENGINE_RESULT "):])
    return (res if whole else res["results"]), log


def settled(gw, timeout_s: float = 120.0) -> dict:
    """Wait until the gateway has stored everything an engine that exited handed it (STATS: no
    request in flight, the ring free), then its STATS: a test that kills the gateway next
    kills it after its acknowledgements, not in the middle of the last writes (which on a
    loaded machine may still run when the engine's process has ended)."""
    from adpkv_gateway.ops.control import request

    deadline = time.monotonic() + timeout_s
    while True:
        reply = request(gw.port, {"op": "STATS"}, timeout_s=5.0)
        stats = reply["stats"] if reply else {}
        if stats and stats["requests_in_flight"] == 0 and stats["ring_in_use"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the gateway still works on {stats} after {timeout_s} s"
        time.sleep(0.1)


def remove_ring_of_killed_gateway(gw) -> None:
    """A SIGKILLed gateway cannot unlink its ring (/dev/shm/adpkv-ring-<port>): do it for it."""
    if gw.alive():
        return
    try:
        os.unlink(f"/dev/shm/adpkv-ring-{gw.port}")
    except OSError:
        pass


def engine_prompts():
    """The prompts the engine tests serve (1k, 2.5k and 4k tokens)."""
    import random
    out = []
    for n, seed in ((1000, 11), (2500, 12), (4000, 13)):
        rnd = random.Random(seed)
        out.append([rnd.randrange(3, 1000) for _ in range(n)])
    return out


def _record_drafts(llm, out: list) -> None:
    """Record the draft tokens the drafter proposes at each step (one engine in this process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): they depend on the drafter's KV,
    which the greedy output does not (the target verifies every draft)."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    propose = runner.propose_draft_token_ids

    def recording(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        out.append(drafts.tolist() if hasattr(drafts, "tolist") else [list(d) for d in drafts])
        return drafts

    runner.propose_draft_token_ids = recording


def _ttft(m, fallback):
    try:
        return float(m.first_token_latency)
    except Exception:
        return fallback


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("make_model"):
        make_model(spec["model"], spec.get("layers", 2))
    res = run(spec)
    print("ENGINE_RESULT " + json.dumps(res), flush=True)
