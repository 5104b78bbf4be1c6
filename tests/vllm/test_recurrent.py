"""Recurrent state (Mamba-type layers, vLLM's ``align`` mode) restored by AdpKVConnector in
real vLLM-CPU engines (issue 15).

Per architecture (tiny random-weight checkpoints, ``hybrid_models.py``), in fresh engine
processes (``engine_run.py``): a baseline process without any connector serves the prompts
twice (its second round is vLLM's own prefix-cache hit at the state boundary: the
reference), process A stores them, the gateway is killed (-9) and restarted, and a fresh
process B restores: cached tokens equal to the state-boundary floor (the last block boundary
below the prompt's end, where vLLM keeps a state: ``(N - 1) // block * block``), greedy
tokens identical to the reference.

Then the card is made to lie behind the running gateway's back (Qwen3-Next), so that each
lookup still finds the state at the boundary and the lie shows only when it is read: a
state object corrupted, one replaced by another key's object (written for another
prefix), one deleted. Each request's load fails as a whole (never KV without its state),
it is recomputed from its first token and gives the reference tokens. In the same process a
restore on top of vLLM's own hit: a prompt whose first 512 tokens vLLM holds (state included)
loads the next chunks and the state at 1024 from the card.

Not run: Bamba (vLLM removed BambaForCausalLM in 0.23), Jamba (vLLM-CPU has no selective-scan
kernel); see docs/vllm.md, "Architectures".
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_run import run_subprocess
from hybrid_models import HYBRID_MODELS, build

N = 1200
PROMPTS = [[random.Random(s).randrange(3, 1000) for _ in range(N)] for s in (31, 32, 33, 34, 35)]


def connector(port, namespace, chunk=None):
    extra = {"adpkv.port": port, "adpkv.load_choice": "always", "adpkv.namespace": namespace, "adpkv.timeout_s": 3.0}
    if chunk is not None:
        extra["adpkv.chunk_size"] = chunk
    return {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def engine(path, name, prompts, conn=None, **kw):
    kw.setdefault("block_size", None)        # the block size vLLM picks for the model
    return run_subprocess(path, prompts, conn, dtype=HYBRID_MODELS[name]["dtype"], timeout=600, **kw)


# name, the Mamba block vLLM picks here, engine settings
ARCHS = [
    # Gated DeltaNet (bf16 only on CPU); vLLM aligns the attention block to the state (256 here)
    ("qwen3_next", 256, {}),
    # Mamba-2 hybrid; vLLM-CPU's SSD kernel ignores intermediate states: one block a step
    ("falcon_h1", 128, dict(max_num_batched_tokens=128)),
    # the Mamba-2 hybrids of Granite 4 (with MoE) and Nemotron-H, the same way
    ("granitemoehybrid", 128, dict(block_size=128, max_num_batched_tokens=128)),
    ("nemotron_h", 128, dict(block_size=128, max_num_batched_tokens=128)),
    # pure Mamba2 with prefix caching on (align mode, a state only); vLLM picks 16-token
    # blocks for it; 128 here, one block a step (the SSD kernel, as for Falcon-H1)
    ("mamba2", 128, dict(block_size=128, max_num_batched_tokens=128)),
]


def store_baseline_restore(name, block, kw, start_gateway, tmp_path, prompts, chunk=None):
    """Baseline (two rounds) beside process A (stores), gateway kill -9 + restart, process B
    restores; returns (baseline, b results, gateway, model path)."""
    path = build(name, str(tmp_path / name))
    gw = start_gateway(shared_memory_size=256 << 20)
    conn = connector(gw.port, name, chunk)
    with ThreadPoolExecutor(2) as pool:
        base_f = pool.submit(engine, path, name, prompts, None, rounds=2,
                             reset_prefix_cache_between_rounds=False, **kw)
        a_f = pool.submit(engine, path, name, prompts, conn, **kw)
        (base, _), (a, log_a) = base_f.result(), a_f.result()
    assert "external KV cache disabled" not in log_a, log_a[-3000:]
    assert "state x" in log_a, log_a[-3000:]          # the recurrent group is stored
    if chunk is not None and chunk % block:
        assert log_a.count(f"adpkv.chunk_size={chunk} is not a positive multiple") == 1
    floors = [(len(p) - 1) // block * block for p in prompts]
    n = len(prompts)
    assert [r["cached"] for r in base[n:]] == floors     # vLLM's own hit: the reference
    assert all(r["cached"] == 0 for r in a)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in base[:n]]
    gw.restart(hard=True)          # only the card carries the objects over
    b, log_b = engine(path, name, prompts, conn, **kw)
    assert [r["cached"] for r in b] == floors, log_b[-4000:]
    assert [r["tokens"] for r in b] == [r["tokens"] for r in base[n:]]
    if chunk is not None and chunk > block:
        assert log_a.count(f"adpkv.chunk_size={chunk} is not used for a model with recurrent state") == 1
    return base, b, gw, path


@pytest.mark.parametrize("name, block, kw", [a for a in ARCHS if a[0] != "qwen3_next"])
def test_fresh_process_restores_the_state(name, block, kw, start_gateway, tmp_path):
    store_baseline_restore(name, block, kw, start_gateway, tmp_path, PROMPTS[:1])


def test_pure_mamba2_with_a_chunk_of_two_blocks_restores_every_prompt(start_gateway, tmp_path):
    """Issue 27: pure Mamba-2, prefix caching on, block 32 and ``adpkv.chunk_size`` 64, three
    prompts whose last block boundaries (vLLM's replay boundary, the only one where it keeps
    the state: 480, 1248, 2944) are not, are not, are multiples of 64. With objects of two
    blocks only the state at 2944 could be stored and found (restored 0, 0, 2944 before the
    fix); now an object of such a model is one block (the larger chunk logged, not used) and
    every prompt restores its block floor with the reference's greedy tokens."""
    prompts = [[random.Random(s).randrange(3, 1000) for _ in range(n)]
               for s, n in ((41, 500), (42, 1250), (43, 2960))]
    store_baseline_restore("mamba2", 32, dict(block_size=32, max_num_batched_tokens=32), start_gateway,
                           tmp_path, prompts, chunk=64)


def _state_files(card: str, group: int, digest_of_key) -> dict[bytes, str]:
    """The fs card's object files of a recurrent group's states: key -> path (fragment 0)."""
    out = {}
    for root, _, files in os.walk(card):
        for f in files:
            try:
                fkey = bytes.fromhex(f)
            except ValueError:
                continue
            key = fkey[:-2]
            if len(key) == 28 and key[-1] == group and digest_of_key(key):
                out[key] = os.path.join(root, f)
    return out


def test_qwen3_next_restores_and_a_lying_state_is_recomputed(start_gateway, tmp_path):
    """Qwen3-Next: restore as above, then a state corrupted, replaced by another key's object,
    or deleted while the gateway runs (found by the lookup, its GET fails): recomputed from
    token 0 with the full prefill's tokens. Then a local hit extended from the card."""
    name, block, kw = ARCHS[0]
    # chunk 64: rounded up to the block (256), with one log line
    base, b, gw, path = store_baseline_restore(name, block, kw, start_gateway, tmp_path, PROMPTS, chunk=64)
    # the state objects at the restored boundary (one per Mamba layer) of each prompt
    from adpkv_core.keys import chunk_digest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    import vllm.v1.core.kv_cache_utils as kvu
    init_none_hash(sha256)
    floor = (N - 1) // block * block

    def boundary_digest(tokens):
        h = kvu.NONE_HASH
        for i in range(floor // block):
            h = hash_block_tokens(sha256, h, tokens[i * block:(i + 1) * block])
        return chunk_digest(bytes(h))

    digests = [boundary_digest(p) for p in PROMPTS]
    card = gw.card_dirs[0]
    files = _state_files(card, 0, lambda key: key[9:25] in digests)
    by_prompt = [[p for k, p in files.items() if k[9:25] == d] for d in digests]
    assert all(len(f) == 2 for f in by_prompt), (by_prompt, len(files))   # 2 Gated DeltaNet layers
    # the gateway keeps running: its index still lists every object, so each lookup finds the
    # state at the boundary and the lie shows only when the object is read
    # prompt 0: a state's payload corrupted (its checksum fails when it is read)
    with open(by_prompt[0][0], "r+b") as fh:
        fh.seek(4096 + 100)
        byte = fh.read(1)
        fh.seek(4096 + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    # prompt 1: a state replaced by the object of another key (prompt 3's): the header names
    # the key it was written for
    with open(by_prompt[3][0], "rb") as src, open(by_prompt[1][0], "wb") as dst:
        dst.write(src.read())
    # prompt 2: a state deleted behind the gateway's back (lost)
    os.unlink(by_prompt[2][1])
    # then prompt 4's first 700 tokens (no state at 256 or 512 on the card: computed, vLLM
    # keeps the state at 512, where its step ended) and prompt 4 itself: vLLM's own hit of
    # 512 tokens, the card's chunks 2 and 3 and the state at 1024 on top
    c, log_c = engine(path, name, PROMPTS[:3] + [PROMPTS[4][:700], PROMPTS[4]], connector(gw.port, name), **kw)
    assert [r["cached"] for r in c] == [0, 0, 0, 0, floor], log_c[-4000:]
    assert log_c.count("restore(s) failed (an object missed)") == 3, log_c[-4000:]
    assert [r["tokens"] for r in c[:3]] == [r["tokens"] for r in base[:3]]
    assert c[4]["tokens"] == base[len(PROMPTS) + 4]["tokens"]
