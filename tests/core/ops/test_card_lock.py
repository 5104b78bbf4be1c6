"""Issue 38 item 3: an fs card has one writer. The door's lock keeps a second gateway off a
port, not off a card: a second gateway on another port that names the same card directory is
refused by the card's own lock (``gateway/cards/fs/lock.py``), naming the first (pid, port),
unless every gateway on the card says ``shared_storage: true``. And a start refused late (its
port taken) undoes what it did: a card it made is gone. Real gateway processes, started as an
operator starts them."""

from __future__ import annotations

import json
import os
import socket

from adpkv_gateway.ops import control
from adpkv_gateway.ops.spawn import GatewayProcess, free_port

from .test_cli_edges import ADPKV_GATEWAY, run


def start_refused(card_dirs: list[str], port: int, *extra: str) -> str:
    """``adpkv-gateway`` on the card(s) and port: it must refuse (exit 2) without a traceback;
    its output."""
    out = run(ADPKV_GATEWAY + ["--port", str(port), "--storage-devices", *card_dirs,
                               "--shared-memory-size", str(8 << 20), *extra], timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and ("refusing to start" in text or "cannot listen" in text), text
    return text


def test_a_second_gateway_on_the_card_is_refused_naming_the_first(start_gateway, tmp_path):
    first = start_gateway()
    assert first.proc is not None
    card = first.card_dirs[0]
    text = start_refused([card], free_port())
    assert f"fs card {card} is in use by another gateway (pid {first.proc.pid}, port {first.port})" in text, text
    assert "shared_storage: true" in text, text
    assert control.request(first.port, {"op": "STATS"})["op"] == "OK", "the refused start disturbed the first"
    text = start_refused([card], free_port(), "--shared-storage", "true")     # sharing takes both
    assert f"(pid {first.proc.pid}, port {first.port}) that does not share it" in text, text
    first.stop()
    again = start_gateway(card_dirs=[card])            # the lock went with the first gateway
    again.kill()                                       # a crash: the kernel gives the lock up
    start_gateway(card_dirs=[card])


def test_gateways_that_all_share_the_card_may_open_it(start_gateway, tmp_path):
    a = start_gateway(shared_storage=True)
    b = start_gateway(card_dirs=a.card_dirs, shared_storage=True)
    assert a.proc is not None and b.proc is not None
    for gw in (a, b):
        assert control.request(gw.port, {"op": "STATS"})["stats"]["cards"][0]["active"]
    text = start_refused(a.card_dirs, free_port())
    for gw in (a, b):
        assert gw.proc is not None and f"pid {gw.proc.pid}, port {gw.port}" in text, text
    assert "that shares it" in text, text


def test_the_same_card_named_twice_is_refused(tmp_path):
    card = str(tmp_path / "card")
    text = start_refused([card, card + "/"], free_port())
    assert f"fs card {card} is named twice in storage_devices" in text, text
    assert not os.path.exists(card), "the refused start left the card it made"


def test_a_start_refused_for_a_busy_port_leaves_no_card_it_made(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        new = tmp_path / "new-card"
        assert "cannot listen on 127.0.0.1" in start_refused([str(new)], port)
        assert not new.exists(), os.listdir(new)
        empty = tmp_path / "empty-dir"                 # a directory the operator made for the card
        empty.mkdir()
        start_refused([str(empty)], port)
        assert empty.is_dir() and os.listdir(empty) == []
        existing = tmp_path / "existing"               # a card that was there stays as it was
        with GatewayProcess(str(existing), shared_memory_size=8 << 20, log_path=str(tmp_path / "gw.log")):
            pass
        serial = json.loads((existing / "adpkv-card.json").read_text())["serial"]
        start_refused([str(existing)], port)
        assert json.loads((existing / "adpkv-card.json").read_text())["serial"] == serial
        assert sorted(n for n in os.listdir(existing) if n.startswith("db"))[:1] == ["db000"]


def test_the_lock_is_a_private_file_that_records_its_holder(start_gateway):
    gw = start_gateway()
    assert gw.proc is not None
    lock = os.path.join(gw.card_dirs[0], ".adpkv-lock")
    assert os.stat(lock).st_mode & 0o777 == 0o600
    record = json.loads(open(lock, encoding="utf-8").read().splitlines()[0])
    assert (record["pid"], record["port"], record["host"], record["shared"]) == \
        (gw.proc.pid, gw.port, socket.gethostname(), False)
