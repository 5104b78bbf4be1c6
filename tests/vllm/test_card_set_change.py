"""A vLLM engine (CPU, a tiny seeded model, a fresh process each run) across a change of the
card set (issue 29): prompts stored on 4 fs cards restore in full on 5, with the same greedy
tokens as a recompute, while their moved chunks are read from the card of the previous layout."""

from __future__ import annotations

from adpkv_gateway.ops import control
from engine_run import engine_prompts, run_subprocess

from test_engine import connector, floor_hit

P1, P2, P3 = engine_prompts()


def test_returning_prompts_restore_across_a_fifth_card(model_dir, baseline, start_gateway, tmp_path):
    dirs = [str(tmp_path / f"card{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4], key_placement="stripe", shared_memory_size=256 << 20)
    a, _ = run_subprocess(model_dir, [P1, P2, P3], connector(gw.port, "change"))
    assert [r["tokens"] for r in a] == baseline and all(r["cached"] == 0 for r in a)
    gw.stop()
    # at 1 byte/s the mover moves one object and then waits: the engine's chunks that changed
    # card are read from their previous card (and wait in the mover's queue: left_objects)
    gw5 = start_gateway(card_dirs=dirs, key_placement="stripe", shared_memory_size=256 << 20,
                        move_rate_bytes=1)
    b, _ = run_subprocess(model_dir, [P1, P2, P3], connector(gw5.port, "change"))
    assert [r["cached"] for r in b] == [floor_hit(1000), floor_hit(2500), floor_hit(4000)]
    assert [r["tokens"] for r in b] == baseline
    change = control.request(gw5.port, {"op": "STATS"})["stats"]["layout_change"]
    assert change is not None and change["moved_objects"] <= 1 and change["left_objects"] > 1


def test_dialog_placement_change_completes_and_prompts_restore_after(model_dir, baseline, start_gateway, tmp_path):
    """With ``dialog`` placement (the default) the sweep moves every chunk by the slot tag its
    header records, the change completes and the previous layout is dropped; the prompts then
    restore in full from their cards in the new layout (today a dialog change never completes)."""
    import time
    dirs = [str(tmp_path / f"card{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4], shared_memory_size=256 << 20)
    a, _ = run_subprocess(model_dir, [P1, P2, P3], connector(gw.port, "change"))
    assert [r["tokens"] for r in a] == baseline and all(r["cached"] == 0 for r in a)
    gw.stop()
    gw5 = start_gateway(card_dirs=dirs, shared_memory_size=256 << 20)
    deadline = time.monotonic() + 60
    while not control.request(gw5.port, {"op": "STATS"})["stats"]["layout_change"]["complete"]:
        assert time.monotonic() < deadline, "the change did not complete"
        time.sleep(0.2)
    assert control.request(gw5.port, {"op": "STATS"})["stats"]["layout_change"]["failed"] == 0
    b, _ = run_subprocess(model_dir, [P1, P2, P3], connector(gw5.port, "change"))
    assert [r["cached"] for r in b] == [floor_hit(1000), floor_hit(2500), floor_hit(4000)]
    assert [r["tokens"] for r in b] == baseline
