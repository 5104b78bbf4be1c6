"""A change of the card set without a cold cache (issue 29): the layout recorded on the cards,
reads that fall back to the previous placement, the mover, the fingerprint rule.

Real gateway processes on real redis-server cards and fs cards on separate directories;
dialogs stored before the change are restored after it, every hit compared byte for byte
(``Dialogs.restore`` asserts it)."""

from __future__ import annotations

import collections
import json
import os
import struct

import xxhash

import pytest

from adpkv_gateway.cards import objfmt
from adpkv_gateway.layout.record import CardRecord, Layout, LayoutError
from adpkv_gateway.layout.record import resolve as resolve_records
from adpkv_gateway.store.placement import Placement

from .test_cards_cluster import Dialogs, stats, wait_for


def record_of(card_dir: str) -> dict:
    with open(os.path.join(card_dir, "adpkv-layout.json"), encoding="utf-8") as fh:
        return json.load(fh)


def serial_of(card_dir: str) -> str:
    with open(os.path.join(card_dir, "adpkv-card.json"), encoding="utf-8") as fh:
        return json.load(fh)["serial"]


def placed(serials, dialogs, mode: str) -> list[int]:
    """Objects per card (``serials`` in configuration order, None: a card left out) where the
    placement puts the dialogs' objects."""
    p, counts = Placement(serials, 16, mode), [0] * len(serials)
    for keys, marks in dialogs.dialogs:
        for key, mark in zip(keys, marks):
            counts[p.ranking(key, mark)[0]] += 1
    return counts


def card_objects(port: int) -> list[int]:
    return [c["objects"] for c in stats(port)["cards"]]


def total_objects(port: int) -> int:
    return sum(c["objects"] for c in stats(port)["cards"])


# ------------------------------------------------------------------------------ the rule
def layout(*serials, slots=16):
    return Layout.of(serials, slots, 16, "dialog", 0, 1)


def resolve(records, current, configured, previous):
    """``layout_record.resolve`` with the cards of ``current`` in its order."""
    return resolve_records(records, list(current.serials), current, configured, previous)


def test_rule_first_start_resume_change_and_refusals():
    a, ab = layout("A", "B"), layout("A", "B", "C")
    assert resolve([None, None], a, "", "") == CardRecord(a)
    assert resolve([CardRecord(a), CardRecord(a)], a, "", "") == CardRecord(a)
    # a third card: a change from the recorded layout, resumed as it is at the next start
    change = resolve([CardRecord(a, None, 3), CardRecord(a, None, 3), None], ab, "", "")
    assert change == CardRecord(ab, a, 4)
    assert resolve([change, CardRecord(a, None, 3), change], ab, "", "") == change     # a crash while recording
    # with key_layout_fingerprint the change must be declared with the recorded layout's fingerprint
    with pytest.raises(LayoutError, match=f"set previous_key_layout_fingerprint to {a.fingerprint}"):
        resolve([CardRecord(a), CardRecord(a), None], ab, ab.fingerprint, "")
    assert resolve([CardRecord(a), CardRecord(a), None], ab, ab.fingerprint, a.fingerprint).previous == a
    with pytest.raises(LayoutError, match="is not the layout the cards record"):
        resolve([CardRecord(a), CardRecord(a), None], ab, "", ab.fingerprint)
    with pytest.raises(LayoutError, match="differs from the configured key_layout_fingerprint"):
        resolve([CardRecord(a), CardRecord(a), None], ab, a.fingerprint, "")
    # mixed layouts, another change before this one is moved, another key distribution
    with pytest.raises(LayoutError, match="record different key layouts"):
        resolve([CardRecord(a, None, 1), CardRecord(layout("B", "C"), None, 1)], ab, "", "")
    abcd = layout("A", "B", "C", "D")
    with pytest.raises(LayoutError, match="in the middle of a change"):         # dialog: its sweep finishes it too
        resolve([change, change, change, None], abcd, "", "")
    striped = [Layout.of(s, 16, 16, "stripe", 0, 1) for s in (("A", "B"), ("A", "B", "C"), ("A", "B", "C", "D"))]
    moving = CardRecord(striped[1], striped[0], 1)
    with pytest.raises(LayoutError, match="in the middle of a change"):         # stripe: the sweep finishes it
        resolve([moving, moving, moving, None], striped[2], "", "")
    with pytest.raises(LayoutError, match="only storage_devices may change"):
        resolve([CardRecord(a), CardRecord(a)], layout("A", "B", slots=32), "", "")


# ------------------------------------------------------------------------------ real gateways
def test_four_to_five_resp_cards_every_dialog_still_hits_and_moves(redis_servers, start_gateway, tmp_path):
    servers = redis_servers(5)
    gw = start_gateway(card_dirs=[s.url for s in servers[:4]], storage_backend="resp")
    dialogs = Dialogs("m", n=80, chunks=1, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    gw.stop()
    status = tmp_path / "status.prom"
    gw5 = start_gateway(card_dirs=[s.url for s in servers], storage_backend="resp", status_file=str(status))
    assert dialogs.restore(gw5.port) == [1.0] * 80          # today about 31 % of them miss
    assert stats(gw5.port)["layout_change"] is not None
    # the dialogs read from their previous card move to their card now (or by the sweep), and leave the old one
    serials = [c["serial"] for c in stats(gw5.port)["cards"]]
    four, five = Placement(serials[:4], 16), Placement(serials, 16)
    owners = [(four.ranking(keys[0], marks[0])[0], five.ranking(keys[0], marks[0])[0])
              for keys, marks in dialogs.dialogs]
    changed = sum(a != b for a, b in owners)
    # the fifth card owns its share of the slots; how many dialogs that moves depends on the
    # cards' random serials (3 to 9 of 16 slots: test_cards_cluster.py bounds it over many sets)
    assert sorted(collections.Counter(r[0] for r in five.rankings).values()) == [3, 3, 3, 3, 4]
    assert changed > 0
    assert wait_for(lambda: stats(gw5.port)["layout_change"]["moved_objects"] == changed, 30)
    want = [sum(b == i for _, b in owners) for i in range(5)]
    assert wait_for(lambda: [c["objects"] for c in stats(gw5.port)["cards"]] == want, 15), \
        "an object is not on its card, or an old copy was left behind"
    assert total_objects(gw5.port) == stored
    assert dialogs.restore(gw5.port) == [1.0] * 80
    assert wait_for(lambda: "adpkv_gateway_layout_moved_objects" in status.read_text(), 10)


def test_four_to_five_fs_cards_stripe_sweep_finishes_and_drops_previous(start_gateway, tmp_path):
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4], key_placement="stripe")
    dialogs = Dialogs("s", n=30, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    gw.stop()
    old = record_of(dirs[0])["layout"]
    gw5 = start_gateway(card_dirs=dirs, key_placement="stripe")
    # objects never read move too: the sweep over the old cards
    assert wait_for(lambda: stats(gw5.port)["layout_change"]["complete"], 60), stats(gw5.port)["layout_change"]
    assert stats(gw5.port)["layout_change"]["moved_objects"] > 0
    assert card_objects(gw5.port) == placed([serial_of(d) for d in dirs], dialogs, "stripe")
    for d in dirs:
        rec = record_of(d)
        assert rec["previous"] is None and rec["layout"]["fingerprint"] == stats(gw5.port)["fingerprint"]
        assert rec["layout"]["fingerprint"] != old["fingerprint"]
    assert "previous layout is dropped" in gw5.log()
    from ..ops.test_cli_edges import ADPKV, run
    shown = run([*ADPKV, "--port", str(gw5.port), "status"])
    assert shown.returncode == 0 and f"layout  : change from {old['fingerprint']} complete, the previous layout " \
        "is dropped" in shown.stdout, shown.stdout
    assert dialogs.restore(gw5.port) == [1.0] * 30
    gw5.stop()
    gw5.start()
    assert stats(gw5.port)["layout_change"] is None
    assert dialogs.restore(gw5.port) == [1.0] * 30


def test_a_replaced_card_costs_only_its_own_dialogs(redis_servers, start_gateway):
    servers = redis_servers(5)
    gw = start_gateway(card_dirs=[s.url for s in servers[:4]], storage_backend="resp")
    dialogs = Dialogs("r", n=80, chunks=1, layers=1)
    assert all(dialogs.store(gw.port))
    serials = [c["serial"] for c in stats(gw.port)["cards"]]
    gw.stop()
    before = Placement(serials, 16)
    lost = [before.ranking(keys[0], marks[0])[0] == 3 for keys, marks in dialogs.dialogs]
    gw2 = start_gateway(card_dirs=[s.url for s in servers[:3]] + [servers[4].url], storage_backend="resp")
    shares = dialogs.restore(gw2.port)
    assert [s == 0.0 for s in shares] == lost, "a dialog of a card that is still there missed"
    assert 5 <= sum(lost) <= 35


def test_the_fingerprint_must_declare_the_change(start_gateway, tmp_path):
    dirs = [str(tmp_path / f"fs{i}") for i in range(3)]
    gw = start_gateway(card_dirs=dirs[:2])
    old = stats(gw.port)["fingerprint"]
    gw.stop()
    gw3 = start_gateway(card_dirs=dirs)          # learn the new fingerprint (and the new card's serial)
    new = stats(gw3.port)["fingerprint"]
    gw3.stop()
    for d in dirs:                                # back to before the change
        os.unlink(os.path.join(d, "adpkv-layout.json"))
    gw = start_gateway(card_dirs=dirs[:2])
    gw.stop()
    with pytest.raises(RuntimeError, match=f"set previous_key_layout_fingerprint to {old}"):
        start_gateway(card_dirs=dirs, key_layout_fingerprint=new)
    with pytest.raises(RuntimeError, match="differs from the configured key_layout_fingerprint"):
        start_gateway(card_dirs=dirs, key_layout_fingerprint=old)
    assert record_of(dirs[0])["layout"]["fingerprint"] == old and not os.path.exists(
        os.path.join(dirs[2], "adpkv-layout.json")), "a refused start recorded a layout"
    ok = start_gateway(card_dirs=dirs, key_layout_fingerprint=new, previous_key_layout_fingerprint=old)
    assert stats(ok.port)["layout_change"]["previous_fingerprint"] == old
    ok.stop()
    # a card of another deployment's layout in the set: refused
    other = [str(tmp_path / "x0"), str(tmp_path / "x1")]
    start_gateway(card_dirs=other).stop()
    with pytest.raises(RuntimeError, match="record different key layouts"):
        start_gateway(card_dirs=dirs[:2] + other[:1])


def test_a_gateway_killed_mid_move_resumes_and_loses_nothing(start_gateway, tmp_path):
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4], key_placement="stripe")
    dialogs = Dialogs("k", n=40, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    gw.stop()
    slow = start_gateway(card_dirs=dirs, key_placement="stripe", move_rate_bytes=64 * 1024)   # ~4 objects/s
    assert wait_for(lambda: stats(slow.port)["layout_change"]["moved_objects"] >= 3, 30)
    moving_from = stats(slow.port)["layout_change"]["previous_fingerprint"]
    slow.kill()                                               # SIGKILL in the middle of the move
    assert record_of(dirs[0])["previous"]["fingerprint"] == moving_from
    fast = start_gateway(card_dirs=dirs, key_placement="stripe")
    assert stats(fast.port)["layout_change"]["previous_fingerprint"] == moving_from    # resumed
    assert dialogs.restore(fast.port) == [1.0] * 40          # nothing lost, nothing wrong, mid-move
    assert wait_for(lambda: stats(fast.port)["layout_change"]["complete"], 60)
    assert total_objects(fast.port) == stored
    assert card_objects(fast.port) == placed([serial_of(d) for d in dirs], dialogs, "stripe")
    assert dialogs.restore(fast.port) == [1.0] * 40


def test_two_gateways_move_one_change_together(redis_servers, start_gateway):
    servers = redis_servers(5)
    urls = [s.url for s in servers]
    gw = start_gateway(card_dirs=urls[:4], storage_backend="resp", key_placement="stripe", shared_storage=True)
    dialogs = Dialogs("t", n=40, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    gw.stop()
    a = start_gateway(card_dirs=urls, storage_backend="resp", key_placement="stripe", shared_storage=True,
                      move_rate_bytes=256 * 1024)
    b = start_gateway(card_dirs=list(reversed(urls)), storage_backend="resp", key_placement="stripe",
                      shared_storage=True, move_rate_bytes=256 * 1024)
    assert stats(a.port)["fingerprint"] == stats(b.port)["fingerprint"]
    assert stats(b.port)["layout_change"]["previous_fingerprint"] == stats(a.port)["layout_change"][
        "previous_fingerprint"]
    assert dialogs.restore(b.port) == [1.0] * 40
    assert dialogs.restore(a.port) == [1.0] * 40
    assert wait_for(lambda: stats(a.port)["layout_change"]["complete"] and stats(b.port)["layout_change"]["complete"],
                    90)
    assert total_objects(a.port) == stored, "an object is on two cards, or lost"
    assert dialogs.restore(a.port) == [1.0] * 40
    assert dialogs.restore(b.port) == [1.0] * 40


def test_drain_moves_a_card_away_then_it_can_go(start_gateway, tmp_path):
    from ..ops.test_cli_edges import ADPKV, run
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs, key_placement="stripe")
    dialogs = Dialogs("n", n=30, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    going = serial_of(dirs[4])
    on_it = stats(gw.port)["cards"][4]["objects"]
    assert on_it > 0
    before = stats(gw.port)["fingerprint"]
    refused = run([*ADPKV, "--port", str(gw.port), "drain", "FSNOSUCHCARD"])
    assert refused.returncode == 1 and "DRAIN_REFUSED" in refused.stderr
    done = run([*ADPKV, "--port", str(gw.port), "drain", going])
    assert done.returncode == 0, done.stderr
    assert f"card {going} is drained: remove it from storage_devices" in done.stdout
    after = stats(gw.port)
    assert after["layout_change"]["complete"] and after["cards"][4]["objects"] == 0
    assert after["layout_change"]["moved_objects"] >= on_it           # and the rebalancing between the others
    assert card_objects(gw.port) == placed([serial_of(d) for d in dirs[:4]] + [None], dialogs, "stripe")
    assert after["fingerprint"] != before and total_objects(gw.port) == stored
    assert dialogs.restore(gw.port) == [1.0] * 30             # during and after: the same bytes
    # a restart with the drained card still configured leaves it out; without it, nothing changes
    gw.stop()
    again = start_gateway(card_dirs=dirs, key_placement="stripe")
    assert stats(again.port)["fingerprint"] == after["fingerprint"]
    assert "were drained: left out of the layout" in again.log()
    assert dialogs.restore(again.port) == [1.0] * 30
    assert stats(again.port)["cards"][4]["objects"] == 0       # nothing was placed on it
    again.stop()
    four = start_gateway(card_dirs=dirs[:4], key_placement="stripe", key_layout_fingerprint=after["fingerprint"])
    assert stats(four.port)["layout_change"] is None
    assert dialogs.restore(four.port) == [1.0] * 30


def _drain_as_another_user(port: int) -> dict:
    from adpkv_gateway.ops import control
    return {"drain": control.request(port, {"op": "DRAIN", "card": "x"}),
            "stats": control.request(port, {"op": "STATS"})["op"]}


@pytest.mark.security
def test_drain_is_for_operators(start_gateway, tmp_path):
    from adpkv_core.wire import protocol as P
    from ..adversary import as_nobody
    dirs = [str(tmp_path / f"fs{i}") for i in range(2)]
    gw = start_gateway(card_dirs=dirs, control_socket_mode="0666")
    seen = as_nobody(_drain_as_another_user, gw.port)
    assert seen["stats"] == "OK" and seen["drain"]["code"] == P.FORBIDDEN     # a session, not an operator
    assert stats(gw.port)["layout_change"] is None


def test_a_delete_during_the_change_removes_the_copy_on_the_previous_card(redis_servers, start_gateway):
    from adpkv_core.client import GatewayClient
    from adpkv_core.settings import ClientConfig
    servers = redis_servers(5)
    gw = start_gateway(card_dirs=[s.url for s in servers[:4]], storage_backend="resp")
    dialogs = Dialogs("x", n=40, chunks=1, layers=1)
    assert all(dialogs.store(gw.port))
    gw.stop()
    gw5 = start_gateway(card_dirs=[s.url for s in servers], storage_backend="resp", move_rate_bytes=1)
    c = GatewayClient(ClientConfig(port=gw5.port, busy_wait_s=5), "deleter")
    keys = [k for ks, _ in dialogs.dialogs for k in ks]
    marks = [m for _, ms in dialogs.dialogs for m in ms]
    assert c.exist(keys, marks=marks).result(10) == [True] * 40         # some of them on their previous card
    assert c.delete(keys, marks=marks).result(10) == 40
    assert c.exist(keys, marks=marks).result(10) == [False] * 40         # none comes back from there
    c.close()
    assert total_objects(gw5.port) == 0


def test_a_gateway_killed_mid_drain_resumes_it(start_gateway, tmp_path):
    from adpkv_gateway.ops import control
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs, key_placement="stripe", move_rate_bytes=64 * 1024)    # ~4 objects/s
    dialogs = Dialogs("q", n=40, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    going = serial_of(dirs[4])
    assert control.request(gw.port, {"op": "DRAIN", "card": dirs[4]})["serial"] == going    # by its device
    assert control.request(gw.port, {"op": "DRAIN", "card": going})["code"] == "DRAIN_REFUSED"   # one at a time
    assert wait_for(lambda: stats(gw.port)["layout_change"]["moved_objects"] >= 2, 30)
    gw.kill()                                                 # SIGKILL in the middle of the drain
    again = start_gateway(card_dirs=dirs, key_placement="stripe")
    assert dialogs.restore(again.port) == [1.0] * 40
    assert wait_for(lambda: stats(again.port)["layout_change"]["complete"], 60)
    assert stats(again.port)["cards"][4]["objects"] == 0 and total_objects(again.port) == stored
    assert card_objects(again.port) == placed([serial_of(d) for d in dirs[:4]] + [None], dialogs, "stripe")
    assert dialogs.restore(again.port) == [1.0] * 40


def test_a_card_that_dies_during_the_move_costs_only_its_own_objects(redis_servers, start_gateway):
    servers = redis_servers(5)
    urls = [s.url for s in servers]
    gw = start_gateway(card_dirs=urls[:4], storage_backend="resp", key_placement="stripe")
    dialogs = Dialogs("f", n=60, chunks=1, layers=1)
    assert all(dialogs.store(gw.port))
    gw.stop()
    gw5 = start_gateway(card_dirs=urls, storage_backend="resp", key_placement="stripe", move_rate_bytes=64 * 1024,
                        io_timeout_ms=500)
    assert wait_for(lambda: stats(gw5.port)["layout_change"]["moved_objects"] >= 2, 30)
    servers[1].kill()                                          # an old card dies in the middle of the move
    serials = [c["serial"] for c in stats(gw5.port)["cards"]]
    four, five = Placement(serials[:4], 16, "stripe"), Placement(serials, 16, "stripe")
    shares = dialogs.restore(gw5.port)                        # every hit byte-compared
    for (keys, marks), share in zip(dialogs.dialogs, shares):
        if 1 not in (four.ranking(keys[0], 0)[0], five.ranking(keys[0], 0)[0]):
            assert share == 1.0, "an object of the cards that live missed"
    assert 0 < sum(s == 0.0 for s in shares) < 30
    assert gw5.alive() and not stats(gw5.port)["layout_change"]["complete"]    # it may come back


# ------------------------------------------------------------------------------ dialog placement: the sweep
def dropped_once(gw) -> bool:
    return gw.log().count("the previous layout is dropped") == 1


def recorded_tags(card_dir: str) -> list:
    """The slot tag the header of each head file on an fs card records (None: none recorded)."""
    out = []
    for root, _, names in os.walk(card_dir):
        for name in names:
            if len(name) == 60 and name.endswith("0000"):
                with open(os.path.join(root, name), "rb") as fh:
                    out.append(objfmt.read_header(fh.read(objfmt.HEADER_CORE), bytes.fromhex(name)).slot_tag)
    return out


def test_four_to_five_fs_cards_dialog_sweep_finishes_and_drops_previous(start_gateway, tmp_path):
    from ..ops.test_cli_edges import ADPKV, run
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4])                    # key_placement dialog, the default
    dialogs = Dialogs("g", n=60, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    gw.stop()
    marks = {m.to_bytes(8, "big") for _, ms in dialogs.dialogs for m in ms}
    assert set(recorded_tags(dirs[0])) <= marks and recorded_tags(dirs[0]), "a head does not record its mark"
    old = record_of(dirs[0])["layout"]["fingerprint"]
    status = tmp_path / "status.prom"
    gw5 = start_gateway(card_dirs=dirs, move_rate_bytes=256 * 1024, status_file=str(status))   # ~8 objects/s
    half = dialogs.dialogs[:30]
    during = Dialogs("g", n=0)
    during.dialogs = half                                     # read while the sweep runs: every one hits
    assert during.restore(gw5.port) == [1.0] * 30
    assert not stats(gw5.port)["layout_change"]["complete"]
    # objects never read move too (today a dialog change never completes: they stay behind)
    assert wait_for(lambda: stats(gw5.port)["layout_change"]["complete"], 90), stats(gw5.port)["layout_change"]
    assert card_objects(gw5.port) == placed([serial_of(d) for d in dirs], dialogs, "dialog")
    assert total_objects(gw5.port) == stored
    for d in dirs:
        rec = record_of(d)
        assert rec["previous"] is None and rec["layout"]["fingerprint"] == stats(gw5.port)["fingerprint"] != old
    assert dropped_once(gw5), gw5.log()
    shown = run([*ADPKV, "--port", str(gw5.port), "status"])
    assert f"layout  : change from {old} complete, the previous layout is dropped" in shown.stdout, shown.stdout
    assert wait_for(lambda: "adpkv_gateway_layout_change_active 0.0" in status.read_text(), 10)
    assert dialogs.restore(gw5.port) == [1.0] * 60
    gw5.stop()
    gw5.start()
    assert stats(gw5.port)["layout_change"] is None and dialogs.restore(gw5.port) == [1.0] * 60


def test_drain_of_a_card_with_dialog_placement(redis_servers, start_gateway):
    from ..ops.test_cli_edges import ADPKV, run
    servers = redis_servers(5)
    gw = start_gateway(card_dirs=[s.url for s in servers], storage_backend="resp")
    dialogs = Dialogs("w", n=60, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    serials = [c["serial"] for c in stats(gw.port)["cards"]]
    assert stats(gw.port)["cards"][4]["objects"] > 0
    done = run([*ADPKV, "--port", str(gw.port), "drain", serials[4]])     # refused today for dialog layouts
    assert done.returncode == 0, done.stderr
    assert f"card {serials[4]} is drained: remove it from storage_devices" in done.stdout
    after = stats(gw.port)
    assert after["layout_change"]["complete"] and after["cards"][4]["objects"] == 0
    assert card_objects(gw.port) == placed(serials[:4] + [None], dialogs, "dialog")
    assert total_objects(gw.port) == stored
    assert dialogs.restore(gw.port) == [1.0] * 60
    gw.stop()
    four = start_gateway(card_dirs=[s.url for s in servers[:4]], storage_backend="resp",
                         key_layout_fingerprint=after["fingerprint"])
    assert stats(four.port)["layout_change"] is None and dialogs.restore(four.port) == [1.0] * 60


def test_a_gateway_killed_mid_dialog_sweep_resumes_it(start_gateway, tmp_path):
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4])
    dialogs = Dialogs("h", n=40, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    gw.stop()
    slow = start_gateway(card_dirs=dirs, move_rate_bytes=64 * 1024)          # ~4 objects/s
    assert wait_for(lambda: stats(slow.port)["layout_change"]["moved_objects"] >= 3, 30)
    moving_from = stats(slow.port)["layout_change"]["previous_fingerprint"]
    slow.kill()                                               # SIGKILL in the middle of the sweep
    fast = start_gateway(card_dirs=dirs)
    assert stats(fast.port)["layout_change"]["previous_fingerprint"] == moving_from    # resumed
    assert wait_for(lambda: stats(fast.port)["layout_change"]["complete"], 60), stats(fast.port)["layout_change"]
    assert total_objects(fast.port) == stored
    assert card_objects(fast.port) == placed([serial_of(d) for d in dirs], dialogs, "dialog")
    assert dialogs.restore(fast.port) == [1.0] * 40
    assert all(record_of(d)["previous"] is None for d in dirs)


def test_two_gateways_sweep_one_dialog_change_together(redis_servers, start_gateway):
    servers = redis_servers(5)
    urls = [s.url for s in servers]
    gw = start_gateway(card_dirs=urls[:4], storage_backend="resp", shared_storage=True)
    dialogs = Dialogs("u", n=50, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    stored = total_objects(gw.port)
    gw.stop()
    a = start_gateway(card_dirs=urls, storage_backend="resp", shared_storage=True, move_rate_bytes=256 * 1024)
    b = start_gateway(card_dirs=list(reversed(urls)), storage_backend="resp", shared_storage=True,
                      move_rate_bytes=256 * 1024)
    assert stats(a.port)["fingerprint"] == stats(b.port)["fingerprint"]
    assert dialogs.restore(b.port) == [1.0] * 50            # during the sweeps of both: every byte checked
    assert wait_for(lambda: stats(a.port)["layout_change"]["complete"] and stats(b.port)["layout_change"]["complete"],
                    90)
    assert total_objects(a.port) == stored, "an object is on two cards, or lost"
    serials = [c["serial"] for c in stats(a.port)["cards"]]
    assert card_objects(a.port) == placed(serials, dialogs, "dialog")
    assert dialogs.restore(a.port) == [1.0] * 50
    assert dialogs.restore(b.port) == [1.0] * 50


def untag(card_dir: str) -> int:
    """Make every object file's header one written before slot tags were recorded (the tag's
    flag byte and bytes zero, the header's own checksum recomputed), as a gateway of before
    left them; the index snapshot goes, so the card scans its files. How many files."""
    n = 0
    for root, _, names in os.walk(card_dir):
        for name in names:
            if len(name) != 60:
                continue
            with open(os.path.join(root, name), "r+b") as fh:
                header = bytearray(fh.read(objfmt.HEADER_CORE))
                at = objfmt._TAG_FLAG_AT
                header[at:at + 1 + objfmt.MAX_TAG] = bytes(1 + objfmt.MAX_TAG)
                header[objfmt._SUM_AT:] = struct.pack(">Q", xxhash.xxh3_64_intdigest(bytes(header[:objfmt._SUM_AT])))
                fh.seek(0)
                fh.write(header)
            n += 1
    if os.path.exists(os.path.join(card_dir, ".adpkv-index")):
        os.unlink(os.path.join(card_dir, ".adpkv-index"))
    return n


def test_objects_without_a_recorded_tag_are_copied_where_they_may_belong(start_gateway, tmp_path):
    dirs = [str(tmp_path / f"fs{i}") for i in range(5)]
    gw = start_gateway(card_dirs=dirs[:4])
    dialogs = Dialogs("l", n=60, chunks=1, layers=1)
    assert all(dialogs.store(gw.port))
    gw.stop()
    assert sum(untag(d) for d in dirs[:4]) == 60
    assert set(recorded_tags(dirs[0])) == {None}
    status = tmp_path / "status.prom"
    gw5 = start_gateway(card_dirs=dirs, status_file=str(status))
    assert wait_for(lambda: stats(gw5.port)["layout_change"]["complete"], 60), stats(gw5.port)["layout_change"]
    change = stats(gw5.port)["layout_change"]
    assert change["copied_objects"] > 0 and change["unplaceable_objects"] == 0
    assert wait_for(lambda: f"adpkv_gateway_layout_copied_objects {float(change['copied_objects'])}"
                    in status.read_text(), 10)
    assert record_of(dirs[0])["previous"] is None and dropped_once(gw5)
    # none was read during the change: each is found on its card in the new layout all the same
    assert dialogs.restore(gw5.port) == [1.0] * 60


def test_a_cluster_card_is_swept(redis_cluster, redis_servers, start_gateway):
    from .test_cards_redis_cluster import FRAG
    cluster = redis_cluster(primaries=3, replicas=0)
    servers = redis_servers(2)
    cards = [cluster.url, servers[0].url, servers[1].url]
    gw = start_gateway(card_dirs=cards[:2], storage_backend="resp", fragment_size=FRAG)
    dialogs = Dialogs("c", n=60, chunks=2, layers=1)
    assert all(dialogs.store(gw.port))
    on_cluster = stats(gw.port)["cards"][0]["objects"]
    gw.stop()
    gw3 = start_gateway(card_dirs=cards, storage_backend="resp", fragment_size=FRAG)
    serials = [c["serial"] for c in stats(gw3.port)["cards"]]
    two, three = Placement(serials[:2], 16), Placement(serials, 16)
    from_cluster = sum(two.ranking(k, m)[0] == 0 != three.ranking(k, m)[0]
                       for keys, marks in dialogs.dialogs for k, m in zip(keys, marks))
    assert on_cluster > 0 and from_cluster > 0
    # today the mover cannot list a cluster card: the change never completes
    assert wait_for(lambda: stats(gw3.port)["layout_change"]["complete"], 60), stats(gw3.port)["layout_change"]
    assert stats(gw3.port)["layout_change"]["moved_objects"] >= from_cluster
    assert dialogs.restore(gw3.port) == [1.0] * 60
    counts = placed(serials, dialogs, "dialog")
    assert card_objects(gw3.port)[1:] == counts[1:]
