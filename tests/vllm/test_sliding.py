"""Sliding-window models in a real vLLM engine on CPU with AdpKVConnector.

- every layer sliding (one ``SlidingWindowSpec`` KV cache group): restore fills only the
  blocks vLLM allocates (those inside the window at the hit boundary; the ones before it
  are null blocks), and the greedy output equals a run without any connector;
- a full and a sliding layer (two KV cache groups, each stored under its own keys): the
  hit is what both groups can restore, and the greedy output equals a run without any
  connector. (More architectures with several groups: test_hybrid.py.)
"""

from __future__ import annotations

import pytest

from engine_run import engine_prompts, make_model, run_subprocess

CHUNK = 256
WINDOW = 400          # not a multiple of the block (32) nor of the chunk (256)
P1, P2, _ = engine_prompts()


def connector(port, namespace):
    return {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": port, "adpkv.load_choice": "always", "adpkv.namespace": namespace,
                                          "adpkv.chunk_size": CHUNK, "adpkv.timeout_s": 3.0}}


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny-swa")), layers=2,
                      config={"sliding_window": WINDOW,
                              "layer_types": ["sliding_attention", "sliding_attention"]})


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny-hybrid")), layers=2,
                      config={"sliding_window": WINDOW,
                              "layer_types": ["full_attention", "sliding_attention"]})


def test_sliding_window_restores_only_the_window(sliding_dir, start_gateway):
    # chunked prefill (1024 tokens a step): blocks leave the window between steps
    # (vLLM's own prefix cache is off: round 1 can only be served from the gateway)
    kw = dict(max_num_batched_tokens=1024, prefix_caching=False)
    base, _ = run_subprocess(sliding_dir, [P1, P2], **kw)
    gw = start_gateway(shared_memory_size=256 << 20)
    # round 0 stores, round 1 restores from the gateway
    res, log = run_subprocess(sliding_dir, [P1, P2], connector(gw.port, "swa"), rounds=2, **kw)
    assert "external KV cache disabled" not in log
    assert f"KV cache groups [sliding {WINDOW} x2]" in log     # vLLM gave the group a SlidingWindowSpec
    assert [r["cached"] for r in res] == [0, 0, (1000 - 1) // CHUNK * CHUNK,
                                          (2500 - 1) // CHUNK * CHUNK], log[-3000:]
    assert [r["tokens"] for r in res] == [r["tokens"] for r in base] * 2


def test_full_and_sliding_groups_restore(hybrid_dir, start_gateway):
    kw = dict(max_num_batched_tokens=1024, prefix_caching=False)
    base, _ = run_subprocess(hybrid_dir, [P1, P2], **kw)
    gw = start_gateway(shared_memory_size=256 << 20)
    res, log = run_subprocess(hybrid_dir, [P1, P2], connector(gw.port, "hybrid"), rounds=2, **kw)
    assert f"KV cache groups [full x1; sliding {WINDOW} x1]" in log
    assert [r["cached"] for r in res] == [0, 0, (1000 - 1) // CHUNK * CHUNK,
                                          (2500 - 1) // CHUNK * CHUNK], log[-3000:]
    assert [r["tokens"] for r in res] == [r["tokens"] for r in base] * 2


class _Geometry:
    """The connector's hit rule without an engine (block 32, chunk 256 = 8 blocks)."""

    def __init__(self, *windows):
        import types
        from adpkv_vllm.connector.metadata import CacheGroup
        groups = [CacheGroup(i, "sliding" if w else "full", (f"l{i}",), w) for i, w in enumerate(windows)]
        self.cfg = types.SimpleNamespace(groups=groups, block_size=32, chunk_size=CHUNK, blocks_per_chunk=8)

    def hit(self, *present, local=0):
        from adpkv_vllm.connector.scheduler import hit_chunks
        return hit_chunks(self.cfg, list(present), local)


def test_hit_rule():
    full = _Geometry(None)
    assert full.hit([True, False, True, True]) == 1
    swa = _Geometry(WINDOW)
    # 4 chunks (1024 tokens): the window at the boundary needs blocks from (1024-399)//32 = 19,
    # i.e. chunks 2 and 3; chunks 0 and 1 need not be stored
    assert swa.hit([False, False, True, True]) == 4
    assert swa.hit([True, True, True, False]) == 3
    assert swa.hit([True, False, False, True]) == 1
    assert swa.hit([False, False, False, False]) == 0
    # vLLM's own hit covers chunk 2: a hit must go past it
    assert swa.hit([False, False, False, False], local=2 * CHUNK) == 0
    assert swa.hit([False, False, False, True], local=3 * CHUNK) == 4


def test_hit_rule_of_several_groups():
    # one hit for the request, valid for every group
    mix = _Geometry(None, WINDOW)
    assert mix.hit([True] * 4, [False, False, True, True]) == 4      # sliding needs only its window
    assert mix.hit([True, True, False, True], [True] * 4) == 2       # full needs every chunk
    assert mix.hit([True] * 4, [True, True, True, False]) == 3       # the window at 3 chunks
    assert mix.hit([True] * 4, [True, True, False, False]) == 2      # at 2 chunks: chunks 0, 1
    assert mix.hit([True] * 4, [False, True, False, True]) == 0
    assert mix.hit([True] * 4, [False, False, False, False]) == 0
    two_windows = _Geometry(WINDOW, 100)
    assert two_windows.hit([False, False, True, True], [False, False, False, True]) == 4
    assert two_windows.hit([False, True, True, True], [False, False, True, False]) == 3
