"""``adpkv.load_choice``: a hit slower to load than to compute is recomputed (connector/load_choice.py).

The rule on measured figures (a clock of the test's), then a real CPU engine on a real gateway
whose card is made slow at its read calls (strace holds each one: a cold card): the first return
of a stored prompt is loaded (nothing measured yet) and found slower than the prefill the engine
measured at that length, so the next returns are recomputed, with the same greedy tokens."""

from __future__ import annotations

import random
import sys

import pytest

from engine_run import engine_prompts, run_subprocess

from adpkv_vllm.connector.load_choice import EXPLORE_EVERY, STALE_S, LoadChoice, bucket_of

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests")
from core.stall import Stall  # noqa: E402

CHUNK = 256


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _measure(choice: LoadChoice, clock: Clock, req: str, tokens: int, seconds: float, restored: bool):
    choice.started(req, tokens, restored)
    clock.t += seconds
    choice.first_token(req)


def test_nothing_measured_loads():
    choice = LoadChoice("measured", Clock())
    assert choice.choose(8192) and choice.choose(1)


def test_a_restore_slower_than_the_prefill_is_declined_at_that_length_and_shorter_ones():
    clock = Clock()
    c = LoadChoice("measured", clock)
    _measure(c, clock, "p", 8000, 0.20, restored=False)     # prefill of 8000 tokens: 0.2 s
    _measure(c, clock, "r", 8000, 0.90, restored=True)      # restored: 0.9 s (a cold card)
    assert not c.verdict(7936).load
    assert not c.verdict(1000).load             # shorter: loses too
    assert c.verdict(20000).load                # longer, never measured: loaded
    # a longer length where the restore wins does not save the shorter one
    _measure(c, clock, "p2", 30000, 1.5, restored=False)
    _measure(c, clock, "r2", 29952, 0.3, restored=True)
    assert c.verdict(30000).load and not c.verdict(7936).load


def test_restores_that_win_are_loaded():
    clock = Clock()
    c = LoadChoice("measured", clock)
    _measure(c, clock, "p", 8000, 0.20, restored=False)
    _measure(c, clock, "r", 7936, 0.08, restored=True)
    v = c.verdict(7936)
    assert v.load and c.choose(7936)


def test_declined_hits_are_measured_again_now_and_then_and_figures_go_stale():
    clock = Clock()
    c = LoadChoice("measured", clock)
    _measure(c, clock, "p", 4000, 0.1, restored=False)
    _measure(c, clock, "r", 3840, 1.0, restored=True)
    got = [c.choose(3840) for _ in range(2 * EXPLORE_EVERY)]
    assert got.count(True) == 2 and got[EXPLORE_EVERY - 1] and got[-1]
    assert c.declined == 2 * EXPLORE_EVERY - 2
    clock.t += STALE_S + 1
    assert c.verdict(3840).load


def test_always_loads_and_measures_nothing():
    clock = Clock()
    c = LoadChoice("always", clock)
    _measure(c, clock, "p", 8000, 0.2, restored=False)
    _measure(c, clock, "r", 7936, 9.0, restored=True)
    assert c.choose(7936) and c.timing() == []


def test_buckets():
    assert bucket_of(1) == 1 and bucket_of(4095) == 12 and bucket_of(4096) == 13


def test_a_bad_setting_is_refused():
    from adpkv_vllm.common.settings import AdapterSettings
    with pytest.raises(ValueError, match="load_choice must be 'measured' or 'always'"):
        AdapterSettings.from_extra_config({"adpkv.load_choice": "sometimes"}, block_size=32)
    assert AdapterSettings.from_extra_config({}, block_size=32).load_choice == "measured"


def test_engine_recomputes_hits_its_card_cannot_restore_faster(model_dir, start_gateway, tmp_path):
    """A real engine, default ``load_choice``, on a card slowed at every read call."""
    _, _, p3 = engine_prompts()
    fresh = [random.Random(99).randrange(3, 1000) for _ in range(len(p3))]   # same length, never stored
    warm = [random.Random(98).randrange(3, 1000) for _ in range(300)]
    gw = start_gateway(shared_memory_size=256 << 20)
    conn = {"kv_connector": "AdpKVConnector", "kv_connector_module_path": "adpkv_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"adpkv.port": gw.port, "adpkv.namespace": "choice",
                                          "adpkv.chunk_size": CHUNK, "adpkv.timeout_s": 30.0}}
    stored, _ = run_subprocess(model_dir, [p3], conn)
    assert stored[0]["cached"] == 0
    stall = Stall(gw.proc.pid, 0.2, "preadv,preadv2")      # a restore several times its prefill, even on a loaded host
    try:
        # round 0: the fresh prompt's prefill is measured, then p3 is loaded (nothing measured
        # for a restore yet) and found slower; round 1 (vLLM's prefix cache reset): both hits
        # are recomputed
        # are recomputed (a short warm-up prompt first: the engine's first prefill pays one-time
        # costs; its own hit in round 1 is shorter than the losing length: recomputed too)
        res, log = run_subprocess(model_dir, [warm, fresh, p3], conn, rounds=2, log_path=str(tmp_path / "b.log"))
    finally:
        stall.stop()
    hit = (len(p3) - 1) // CHUNK * CHUNK
    seen = [(r["cached"], round(r["ttft"], 3)) for r in res]
    assert res[2]["ttft"] > res[1]["ttft"], f"the slowed card restored faster than the prefill: {seen}"
    assert [r["cached"] for r in res] == [0, 0, hit, 0, 0, 0], seen
    assert res[5]["tokens"] == res[2]["tokens"] == stored[0]["tokens"] and res[4]["tokens"] == res[1]["tokens"]
    assert "are recomputed, not loaded" in log
