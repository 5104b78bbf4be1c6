"""Progress of long work: a bar on a terminal (a real pty), plain lines in a log.

- ``Progress`` itself, both shapes, driven by a clock the test moves (so "after 2 s" and
  "every 5 s" are exact, not slept);
- a real gateway indexing a real card at start and cleaning it, its stderr a pty: the bar;
  the same with stderr a log file: quiet for short work, and plain lines when the rebuild
  is long (held past 2 s by SIGSTOP while it has a card file open: indexing for seconds
  would take GBs of files on this shared machine);
- ``adpkv bench`` on a pty draws its bar; piped, it prints no bar codes.
"""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from adpkv_core.keys import KeyBuilder
from adpkv_gateway.ops import control
from adpkv_gateway.observe import progress
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.cards.fragments import fragment_key
from adpkv_gateway.ops.spawn import GatewayProcess, free_port

from ..fs_cards import object_paths


ADPKV_CLI = [sys.executable, "-m", "adpkv_gateway.ops.cli"]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Tty(io.StringIO):
    def isatty(self):          # a terminal for Progress; the pty tests below use a real one
        return True


def test_plain_lines_start_after_the_first_delay_then_come_every_interval():
    clock, records = Clock(), []
    log = logging.getLogger("test.progress.lines")
    log.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})())
    log.setLevel(logging.INFO)
    stream = io.StringIO()
    with progress.track("indexing", 1000, "files", stream=stream, log=log, clock=clock,
                        first_line_s=2.0, every_s=5.0) as p:
        assert progress.running()[0] == {"what": "indexing", "done": 0, "total": 1000, "unit": "files",
                                         "elapsed_s": 0.0}
        for _ in range(100):
            p.advance()
        assert records == [], "no line before first_line_s"
        clock.now += 2.0
        p.advance()
        assert records == ["indexing: 101/1000 files (10%), 2.0 s"]
        clock.now += 4.9
        p.advance(399)
        assert len(records) == 1, "not again before every_s"
        clock.now += 0.1
        p.advance(100)
        assert records[-1] == "indexing: 600/1000 files (60%), 7.0 s"
        clock.now += 1.0
        p.advance(400)
    assert records[-1] == "indexing: done, 1000 files in 8.0 s" and len(records) == 3
    assert stream.getvalue() == "", "a log shape writes no bar"
    assert progress.running() == []


def test_short_work_says_nothing_in_a_log():
    clock, stream = Clock(), io.StringIO()
    with progress.track("cleaning", 10, "files", stream=stream, clock=clock) as p:
        p.advance(10)
        clock.now += 1.9
    assert stream.getvalue() == ""


def test_a_terminal_gets_one_bar_redrawn_in_place():
    clock, tty = Clock(), Tty()
    with progress.track("adpkv bench", 4, "runs", stream=tty, clock=clock) as p:
        p.advance()                 # before REDRAW_S: nothing drawn
        assert tty.getvalue() == ""
        clock.now += 0.5
        p.advance()
        p.note("adpkv bench: hot 128 KiB")
        clock.now += 0.5
        p.advance(2)
    out = tty.getvalue()
    frames = out.split("\r\033[K")[1:]
    assert frames[0] == "adpkv bench [" + "#" * 15 + "." * 15 + "]  50.0% 2/4 runs 0.5 s"
    assert frames[1].startswith("adpkv bench: hot 128 KiB [") and "50.0%" in frames[1]
    assert frames[-1] == "adpkv bench: hot 128 KiB [" + "#" * 30 + "] 100.0% 4/4 runs 1.0 s\n"
    assert out.count("\n") == 1, "a bar is one line, ended once"


def _pty_output(cmd, timeout_s=120, env=None):
    """Run ``cmd`` with stderr on a new pty (stdout piped); (exit code, stdout, what the pty got)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    got = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:        # EIO: every writer closed the pty
                break
            if not chunk:
                break
            got += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    return proc.returncode, out.decode(), got.decode(errors="replace")


def _card_of(path, n):
    """A real fs card holding ``n`` small objects (written by the card itself)."""
    card = FsCard(str(path), num_dbs=4)
    card.open()
    payload = memoryview(bytes(512))
    for i, key in enumerate(KeyBuilder("progress").keys([i.to_bytes(4, "big") for i in range(n)])):
        assert card.write(i % 4, fragment_key(key, 0), payload, 512)
    card.close()


def test_a_gateway_on_a_terminal_draws_the_index_rebuild_and_the_clean(tmp_path):
    _card_of(tmp_path / "card", 600)
    port = free_port()
    gw = GatewayProcess(str(tmp_path / "card"), port=port, shared_memory_size=8 << 20)
    master, slave = pty.openpty()
    proc = subprocess.Popen(gw.command(), stdout=slave, stderr=slave, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(slave)
    got = b""
    try:
        assert control.wait_until_up(port, 60), "the gateway did not come up"
        reply = control.request(port, {"op": "CLEAN"}, timeout_s=60)
        assert reply["deleted"] == 600
        deadline = time.monotonic() + 30
        while b"cleaning [" not in got or b"\n" not in got.split(b"cleaning [")[-1]:
            assert time.monotonic() < deadline, got.decode(errors="replace")
            if select.select([master], [], [], 0.5)[0]:
                got += os.read(master, 65536)
    finally:
        proc.terminate()
        proc.wait(30)
        gw.proc = None
        gw._remove_leftovers()
        os.close(master)
    text = got.decode(errors="replace")
    root = str(tmp_path / "card")
    assert re.search(rf"fs card {re.escape(root)}: indexing \[#{{30}}\] 100\.0% 600/600 files", text), text
    assert re.search(rf"fs card {re.escape(root)}: cleaning \[#{{30}}\] 100\.0% 600/600 files", text), text


def test_a_gateway_logging_to_a_file_stays_quiet_for_short_work(start_gateway, tmp_path):
    _card_of(tmp_path / "card0", 50)
    gw = start_gateway()
    assert "indexing" not in gw.log() and "\033[K" not in gw.log()
    assert "50 objects in 50 files" in gw.log()


def test_bench_draws_a_bar_on_a_terminal_and_none_when_piped(tmp_path):
    cmd = [sys.executable, "-m", "adpkv_gateway.ops.cli", "bench", "--dir", str(tmp_path / "b"), "--sizes", "128KiB",
           "--total", "2MiB", "--regime", "hot", "--repeat", "1"]
    code, out, tty = _pty_output(cmd)
    assert code == 0, out + tty
    assert "adpkv bench: hot 128 KiB run 1/1, gateway [" in tty
    assert re.search(r"\[#{30}\] 100\.0% 2/2 runs", tty), tty
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "\033[K" not in piped.stderr + piped.stdout
    assert re.fullmatch(r"store_vs_raw=\d+\.\d\d restore_vs_raw=\d+\.\d\d \((cold|hot) \d+ [KMG]iB\)",
                        piped.stdout.strip().splitlines()[-1])


def _stop_while_indexing(proc, card_root: str, deadline: float) -> bool:
    """SIGSTOP the gateway while it has a file of ``card_root``'s databases open (it is
    indexing them); False if it got past the index first."""
    fd_dir = f"/proc/{proc.pid}/fd"
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for n in names:
            try:
                target = os.readlink(os.path.join(fd_dir, n))
            except OSError:
                continue
            if re.fullmatch(re.escape(card_root) + r"/db\d+/[0-9a-f]{2}/[0-9a-f]+", target):   # an object file, not a listing
                os.kill(proc.pid, signal.SIGSTOP)
                return True
        if b"indexed in" in open(proc.log_path, "rb").read():
            return False
    return False


def test_a_long_index_rebuild_writes_plain_lines_in_the_log(tmp_path):
    """The log shape with a real gateway: the rebuild is held (SIGSTOP while it has a card
    file open) past the 2 s after which a log gets its first progress line."""
    _card_of(tmp_path / "card", 4000)
    root = str(tmp_path / "card")
    for attempt in range(5):
        log_path = str(tmp_path / f"gw{attempt}.log")
        gw = GatewayProcess(root, shared_memory_size=8 << 20, log_path=log_path)
        gw.start(wait=False)
        gw.proc.log_path = log_path
        caught = _stop_while_indexing(gw.proc, root, time.monotonic() + 60)
        if caught:
            held = time.monotonic() + 2.5          # the stimulus: the gateway's clock moves on while stopped
            while time.monotonic() < held:
                time.sleep(0.1)
            os.kill(gw.proc.pid, signal.SIGCONT)
        up = gw._wait_until_up(60)
        deadline = time.monotonic() + 60          # the scan goes on while the gateway serves
        while up and b"indexed in" not in open(log_path, "rb").read():
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.05)
        gw.stop()
        assert up, gw.log()
        if caught:
            break
    else:
        pytest.fail("the gateway indexed 4000 files before the test could catch it, 5 times")
    log = open(log_path).read()
    lines = re.findall(rf"fs card {re.escape(root)}: indexing: (\d+)/4000 files \((\d+)%\), (\d+\.\d) s", log)
    assert lines, log
    done, pct, elapsed = lines[0]
    assert 0 < int(done) <= 4000 and float(elapsed) >= 2.0
    assert re.search(rf"fs card {re.escape(root)}: indexing: done, 4000 files in \d+\.\d s", log), log
    assert "\033[K" not in log, "no bar codes in a log"


def test_adpkv_clean_draws_the_gateways_progress_on_a_terminal(start_gateway, tmp_path):
    """``adpkv clean`` on a pty draws the clean the gateway reports in STATS. The gateway is
    held (SIGSTOP, 1.5 s: less than the CLI's 3 s STATS timeout) as soon as its clean has
    removed a first file, so the CLI's next STATS finds the clean under way."""
    _card_of(tmp_path / "card0", 8000)
    gw = start_gateway(card_dirs=[str(tmp_path / "card0")])
    db = str(tmp_path / "card0")
    full = len(object_paths(db))
    master, slave = pty.openpty()
    cli = subprocess.Popen(ADPKV_CLI + ["clean", "--yes", "--port", str(gw.port)], stdout=subprocess.PIPE,
                           stderr=slave)
    os.close(slave)
    deadline = time.monotonic() + 60
    while len(object_paths(db)) == full:
        assert time.monotonic() < deadline and cli.poll() is None, "the clean did not start"
    os.kill(gw.proc.pid, signal.SIGSTOP)
    held = time.monotonic() + 1.5              # the stimulus: the CLI polls while the clean is held
    while time.monotonic() < held:
        time.sleep(0.1)
    os.kill(gw.proc.pid, signal.SIGCONT)
    got = b""
    while True:
        ready = select.select([master], [], [], 1.0)[0]
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        elif cli.poll() is not None:
            break
        assert time.monotonic() < deadline, got
    os.close(master)
    out = cli.communicate(timeout=60)[0].decode()
    assert cli.returncode == 0 and "deleted 8000 objects" in out, out
    text = got.decode(errors="replace")
    assert re.search(rf"fs card {re.escape(str(tmp_path / 'card0'))}: cleaning \[[#.]{{30}}\] +\d+\.\d% "
                     r"\d+/8000 files", text), text
    assert text.endswith("\n") and text.count("\n") == 1, "one bar, ended once"


def test_nothing_to_do_draws_nothing_on_a_terminal():
    tty = Tty()
    with progress.track("fs card /x: indexing", 0, "files", stream=tty, clock=Clock()):
        pass
    assert tty.getvalue() == ""
