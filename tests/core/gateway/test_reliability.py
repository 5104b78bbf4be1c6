"""The reliability suite (issue 12): kill -9 of the gateway and of a client under load,
eviction under load; count kills survived, wrong bytes served, acknowledged objects lost
and the time a rank waits when its gateway dies. See docs/reliability.md.

Every random choice comes from a seeded RNG (``ADPKV_RELIABILITY_SEED``, default 12; each
test prints its seed). Writers are real client processes (tests/core/gateway/reliability_worker.py)
whose objects are a function of their key, so any wrong byte is detected. Figures are
printed (``-rA`` or ``-s`` shows them) and, with ``ADPKV_RELIABILITY_FIGURES=FILE``, written
to FILE as JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest

from adpkv_core.client import GatewayClient
from adpkv_gateway.cards.fragments import fragment_extents
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control

from ..fs_cards import gateway_stats, object_dirs, settled_card
from .reliability_worker import key_of, payload

pytestmark = pytest.mark.reliability

WORKER = os.path.join(os.path.dirname(__file__), "reliability_worker.py")
SEED = int(os.environ.get("ADPKV_RELIABILITY_SEED", "12"))
KILLS_PER_MODE = int(os.environ.get("ADPKV_RELIABILITY_KILLS", "6"))
CLIENT_KILLS = 3
OBJ = 192 * 1024 + 123            # not 4 KiB aligned: O_DIRECT writes its tail through a bounce buffer
RANK_WAIT_LIMIT_S = 2.5           # the time a rank may wait for a dead gateway
MODES = {"page_cache": {}, "o_direct": {"o_direct": True}, "fsync": {"fsync": True},
         "page_cache_fragments": {"fragment_size": 64 * 1024}}   # 4 fragments per object

FIGURES: dict = {}


def _seed(name: str) -> int:
    seed = zlib.crc32(f"{SEED}:{name}".encode())
    print(f"[reliability] {name}: seed {seed} (ADPKV_RELIABILITY_SEED={SEED})")
    return seed


def wait_for(pred, timeout_s: float, what: str, every_s: float = 0.005):
    """Poll ``pred`` until it returns something true, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def on_disk(card: str) -> tuple[int, int, list[str]]:
    """(bytes, object files, temporary files) under the card's db* directories."""
    total = files = 0
    temps = []
    for d in object_dirs(card):
        with os.scandir(d) as it:
            for e in it:
                total += e.stat().st_size
                if e.name.startswith("."):
                    temps.append(os.path.relpath(e.path, card))
                else:
                    files += 1
    return total, files, temps


def usage_vs_disk(port: int, card: str, timeout_s: float = 120.0) -> dict:
    """The card's usage against its files, once the card's background work at start has ended
    (``fs_cards.settled_card``)."""
    c = settled_card(port, timeout_s, stats_timeout_s=5.0)
    total, files, temps = on_disk(card)
    return {"usage_bytes": c["used_bytes"], "disk_bytes": total, "usage_objects": c["objects"],
            "disk_files": files, "temp_files": temps}


# ---------------------------------------------------------------------------- writer processes
class Writer:
    """One reliability_worker.py process and the events of its log file."""

    def __init__(self, tmp_path, port: int, name: str, *args):
        self.log_path = str(tmp_path / f"{name}.events")
        self.out_path = str(tmp_path / f"{name}.out")
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, WORKER, "--port", str(port), "--log", self.log_path,
                                          *map(str, args)], stdout=out, stderr=subprocess.STDOUT)
        self._offset = 0
        self._rest = b""
        self.submitted: list[tuple[int, int]] = []   # (first, n) of every PUT sent
        self.acked: set[int] = set()                 # indices the gateway acknowledged as stored
        self.done_times: list[tuple[float, bool]] = []   # (t, any stored) of every PUT answer
        self.gets = self.get_hits = self.get_wrong = 0
        self.ready = self.off = self.end = self.stall = None

    def poll(self) -> "Writer":
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return self
        self._offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            f = line.decode().split()
            if f[0] == "S":
                self.submitted.append((int(f[1]), int(f[2])))
            elif f[0] == "A":
                first, flags = int(f[1]), f[2]
                self.acked.update(first + j for j, x in enumerate(flags) if x == "1")
                self.done_times.append((float(f[3]), "1" in flags))
            elif f[0] == "G":
                self.gets += 1
                self.get_hits += f[2].count("1")
                self.get_wrong += int(f[3])
            elif f[0] == "READY":
                self.ready = float(f[1])
            elif f[0] == "OFF":
                self.off = float(f[1])
            elif f[0] == "STALL":
                self.stall = (int(f[1]), int(f[2]))
            elif f[0] == "END":
                self.end = f[1]
        return self

    def submitted_indices(self) -> list[int]:
        return [first + j for first, n in self.submitted for j in range(n)]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.poll()

    def output(self) -> str:
        with open(self.out_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()[-3000:]

    def wait_ready(self, timeout_s: float = 30.0) -> "Writer":
        wait_for(lambda: self.poll().ready or self.end or not self.alive(), timeout_s, "the writer to attach")
        assert self.ready, f"the writer did not attach: {self.end}\n{self.output()}"
        return self


@pytest.fixture
def writers(tmp_path):
    """Factory: ``writers(port, name, *args)`` starts a writer process; all are killed at the end."""
    started: list[Writer] = []

    def start(port, name, *args):
        w = Writer(tmp_path, port, name, *args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


# ---------------------------------------------------------------------------- the checking client
class Checker:
    """A second client (in this process): EXIST, GET and compare every byte, PUT."""

    def __init__(self, port: int, engine: str):
        self.c = GatewayClient(ClientConfig(port=port, timeout_s=30.0, busy_wait_s=20.0), engine,
                               rank=0, world_size=1)
        assert self.c.enabled, f"the checking client could not attach: {self.c.attach_error}"

    def exist(self, keys: list[bytes]) -> list[bool]:
        out = []
        for k in range(0, len(keys), 512):
            out += self.c.exist(keys[k:k + 512]).result(timeout=60)
        return out

    def get(self, keys: list[bytes], obj: int, per: int = 32) -> tuple[list[bool], set[int]]:
        """Hits, and the indices of hits whose bytes are wrong."""
        hits, wrong = [], set()
        for k in range(0, len(keys), per):
            part = keys[k:k + per]

            def check(b, part=part, base=k):
                for j in range(b.count):
                    if b.hits[j]:
                        o = b.offset + j * b.stride
                        if bytes(self.c.ring[o:o + obj]) != payload(part[b.first + j], obj):
                            wrong.add(base + b.first + j)

            hits += self.c.get(part, obj, check).result(timeout=60).hits
        assert self.c.enabled, "the checking client was turned off"
        return hits, wrong

    def put(self, keys: list[bytes], obj: int):
        def fill(b):
            for j in range(b.count):
                o = b.offset + j * b.stride
                self.c.ring[o:o + obj] = payload(keys[b.first + j], obj)
        return self.c.put(keys, obj, fill).result(timeout=60)     # a StoreResult

    def verify(self, keys: list[bytes], obj: int, acked: set[int] = frozenset()) -> dict:
        """Every object the gateway calls present reads back exact; nothing acknowledged is lost."""
        present = self.exist(keys)
        hits, wrong = self.get(keys, obj)
        good = [h and i not in wrong for i, h in enumerate(hits)]
        return {
            "objects": len(keys), "present": sum(present), "readable": sum(good),
            "wrong_bytes": len(wrong),
            "present_unreadable": sum(1 for p, g in zip(present, good) if p and not g),
            "acked": len(acked), "acked_lost": sum(1 for i in acked if not good[i]),
            "good": good, "present_flags": present,
        }

    def close(self):
        self.c.close()


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("good", "present_flags")}


def _figures(name: str, **values) -> None:
    FIGURES[name] = values
    print(f"[reliability] {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\n[reliability] figures of this run:")
    for name, values in FIGURES.items():
        print(f"  {name}: {json.dumps(values)}")
    path = os.environ.get("ADPKV_RELIABILITY_FIGURES")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"seed": SEED, "kills_per_mode": KILLS_PER_MODE, "figures": FIGURES}, fh, indent=2)


# ---------------------------------------------------------------------------- kill -9 of the gateway
@pytest.mark.parametrize("mode", list(MODES))
def test_gateway_kill9_under_put_flood(start_gateway, writers, tmp_path, mode):
    """kill -9 of the gateway at random moments of a PUT flood, then a restart on the same card:
    what it calls present reads back exact, nothing acknowledged is lost, usage equals the
    disk, no temporary file is left."""
    rng = random.Random(_seed(f"gateway-kill9-{mode}"))
    gw = start_gateway(shared_memory_size=32 << 20, thread_pool_size=4, **MODES[mode])
    card = gw.card_dirs[0]
    all_keys: list[bytes] = []
    acked_all: set[int] = set()           # positions in all_keys
    totals = {"kills": 0, "kills_survived": 0, "objects_submitted": 0, "objects_acked": 0,
              "wrong_bytes": 0, "acked_lost": 0, "present_unreadable": 0, "usage_mismatches": 0,
              "writes_cut_short": 0, "temp_files_left": 0, "orphan_fragments": 0}
    frags_per_object = len(fragment_extents(OBJ, MODES[mode].get("fragment_size", 0)))
    problems = []
    for cycle in range(KILLS_PER_MODE):
        prefix = f"{mode}-{cycle}"
        w = writers(gw.port, f"writer-{mode}-{cycle}", "--prefix", prefix, "--obj", OBJ, "--batch", 8,
                    "--inflight", 4, "--seed", rng.randrange(1 << 30)).wait_ready()
        target = rng.randint(4, 160)          # kill once this many objects were acknowledged ...
        extra = rng.randint(0, 3)             # ... and this many more PUTs were sent after that
        base = wait_for(lambda: len(w.poll().acked) >= target and len(w.submitted) or w.end,
                        60, f"{target} acknowledged objects")
        assert not w.end, f"the writer ended before the kill: {w.end}\n{w.output()}"
        wait_for(lambda: len(w.poll().submitted) >= base + extra or not w.alive(), 30, "more PUTs")
        gw.kill()                             # kill -9 mid-flood (SIGKILL, then wait for it)
        totals["kills"] += 1
        w.kill()                              # its acknowledgements are in its event log already
        interrupted = len(on_disk(card)[2])   # writes the kill cut short (their temporary files)
        # a fragmented object cut short leaves fragments without their head (written last)
        totals["writes_cut_short"] += interrupted
        idx = w.submitted_indices()
        offset = len(all_keys)
        all_keys += [key_of(prefix, i) for i in idx]
        pos = {i: offset + n for n, i in enumerate(idx)}
        acked_all.update(pos[i] for i in w.acked)
        totals["objects_submitted"] += len(idx)
        totals["objects_acked"] += len(w.acked)

        gw.start()                            # the same card
        ud = usage_vs_disk(gw.port, card)
        checker = Checker(gw.port, f"checker-{mode}-{cycle}")
        try:
            res = checker.verify(all_keys, OBJ, acked_all)
        finally:
            checker.close()
        ud_after = usage_vs_disk(gw.port, card)
        ok = True
        for k in ("wrong_bytes", "acked_lost", "present_unreadable"):
            totals[k] += res[k]
            ok = ok and res[k] == 0
        for u in (ud, ud_after):
            if u["usage_bytes"] != u["disk_bytes"] or u["usage_objects"] != u["disk_files"]:
                totals["usage_mismatches"] += 1
                ok = False
        totals["temp_files_left"] += len(ud["temp_files"])
        totals["orphan_fragments"] = ud_after["disk_files"] - res["present"] * frags_per_object
        ok = ok and not ud["temp_files"]
        totals["kills_survived"] += ok
        line = (f"kill {cycle + 1}: after {len(w.acked)} acked of {len(idx)} sent, {interrupted} writes cut "
                f"short; {_public(res)}; "
                f"usage {ud['usage_bytes']} B / disk {ud['disk_bytes']} B, "
                f"{ud['usage_objects']} / {ud['disk_files']} objects, temp files {ud['temp_files'][:3]}")
        print(f"[reliability] {mode} {line}")
        if not ok:
            problems.append(line)
    _figures(f"gateway_kill9[{mode}]", **totals)
    assert totals["wrong_bytes"] == 0, problems
    assert totals["acked_lost"] == 0, problems
    assert totals["present_unreadable"] == 0, problems
    assert totals["usage_mismatches"] == 0, problems
    assert totals["temp_files_left"] == 0, problems
    assert totals["kills_survived"] == KILLS_PER_MODE, problems
    gw.stop()
    shutil.rmtree(card, ignore_errors=True)  # a few hundred MiB per mode: keep /tmp small


def test_rank_wait_when_the_gateway_dies(start_gateway, writers):
    """kill -9 of the gateway under a PUT flood: how long until the rank's pending call
    resolves and ``client.enabled`` turns False (the SDK's default settings)."""
    rng = random.Random(_seed("rank-wait"))
    gw = start_gateway(shared_memory_size=32 << 20, thread_pool_size=4)
    w = writers(gw.port, "writer-rank-wait", "--prefix", "rank-wait", "--obj", OBJ,
                "--seed", rng.randrange(1 << 30)).wait_ready()
    target = rng.randint(8, 80)
    wait_for(lambda: len(w.poll().acked) >= target or w.end, 60, f"{target} acknowledged objects")
    assert not w.end, w.output()
    t_kill = time.monotonic()
    gw.kill()
    deadline_s = 25.0
    wait_for(lambda: w.poll().off or w.end or not w.alive(), deadline_s, "the client to turn off")
    resolved = [t for t, stored in w.done_times if t > t_kill and not stored]
    off_s = round(w.off - t_kill, 3) if w.off else None
    resolve_s = round(min(resolved) - t_kill, 3) if resolved else None
    _figures("rank_wait", pending_call_resolved_s=resolve_s, client_turned_off_s=off_s,
             sdk_timeout_s=ClientConfig().timeout_s, limit_s=RANK_WAIT_LIMIT_S)
    w.kill()
    assert off_s is not None, f"the client never turned off\n{w.output()}"
    assert resolve_s is not None and resolve_s < RANK_WAIT_LIMIT_S and off_s < RANK_WAIT_LIMIT_S, (
        f"a rank waited {resolve_s} s for its pending call and {off_s} s until client.enabled turned "
        f"False after kill -9 of the gateway (limit {RANK_WAIT_LIMIT_S} s)")


# ---------------------------------------------------------------------------- kill -9 of the client
def test_client_kill9_mid_transfer(start_gateway, writers, tmp_path):
    """kill -9 of a writer with PUTs and GETs in flight (once at random moments, once
    half-way through filling a PUT's slot): the gateway stays up, frees the ring, serves a
    second client exactly, and never serves a half-written object."""
    rng = random.Random(_seed("client-kill9"))
    gw = start_gateway(shared_memory_size=16 << 20, thread_pool_size=4, engine_timeout_s=1)
    card = gw.card_dirs[0]
    base_n = 64
    w = writers(gw.port, "writer-base", "--prefix", "base", "--count", base_n, "--obj", OBJ)
    wait_for(lambda: w.poll().end or not w.alive(), 60, "the base objects to be stored")
    assert w.end == "done" and len(w.acked) == base_n, w.output()
    all_keys = [key_of("base", i) for i in range(base_n)]
    acked_all = set(range(base_n))
    totals = {"client_kills": 0, "gateway_stayed_up": 0, "ring_freed": 0, "wrong_bytes": 0,
              "wrong_bytes_seen_by_writer": 0, "acked_lost": 0, "present_unreadable": 0,
              "half_filled_objects_served": 0, "second_client_exact": 0, "max_ring_free_s": 0.0}
    problems = []
    for cycle in range(CLIENT_KILLS):
        prefix = f"client-{cycle}"
        stall = cycle == CLIENT_KILLS - 1     # the last kill: half-way through a fill, for sure
        args = ["--prefix", prefix, "--obj", OBJ, "--batch", 8, "--inflight", 6, "--get-prefix", "base",
                "--get-count", base_n, "--get-own", "--seed", rng.randrange(1 << 30)]
        if stall:
            args += ["--stall-put", rng.randint(2, 8)]
        w = writers(gw.port, f"writer-{prefix}", *args).wait_ready()
        if stall:
            wait_for(lambda: w.poll().stall or w.end, 60, "the writer to stall mid-fill")
        else:
            target = rng.randint(3, 60)       # answers (PUT and GET) before the kill
            wait_for(lambda: len(w.poll().done_times) + w.gets >= target or w.end, 60, f"{target} answers")
        assert not w.end, w.output()
        w.kill()                              # kill -9 with requests in flight
        totals["client_kills"] += 1
        t_kill = time.monotonic()
        up = gw.alive() and control.request(gw.port, {"op": "PING"}) is not None
        totals["gateway_stayed_up"] += up
        freed = wait_for(lambda: (lambda s: s["ring_in_use"] == 0 and s["requests_in_flight"] == 0
                                  and s["engine"] is None and s)(gateway_stats(gw.port, 5.0)), 20,
                         "the gateway to drop the dead client and free its ring", every_s=0.05)
        totals["ring_freed"] += bool(freed)
        totals["max_ring_free_s"] = max(totals["max_ring_free_s"], round(time.monotonic() - t_kill, 2))
        totals["wrong_bytes_seen_by_writer"] += w.get_wrong

        idx = w.submitted_indices()
        offset = len(all_keys)
        all_keys += [key_of(prefix, i) for i in idx]
        pos = {i: offset + n for n, i in enumerate(idx)}
        acked_all.update(pos[i] for i in w.acked)
        checker = Checker(gw.port, f"second-client-{cycle}")
        try:
            res = checker.verify(all_keys, OBJ, acked_all)
            if w.stall:                       # the half-filled request: a miss, never served
                first, n = w.stall
                half = [pos[first + j] for j in range(n)]
                totals["half_filled_objects_served"] += sum(1 for p in half if res["present_flags"][p])
            fresh = [key_of(f"second-{cycle}", i) for i in range(16)]
            flags = checker.put(fresh, OBJ)
            hits, wrong = checker.get(fresh, OBJ)
            exact = all(flags.stored) and all(hits) and not wrong
        finally:
            checker.close()
        totals["second_client_exact"] += exact
        for k in ("wrong_bytes", "acked_lost", "present_unreadable"):
            totals[k] += res[k]
        line = (f"client kill {cycle + 1} ({'mid-fill stall' if stall else 'random moment'}): "
                f"{len(w.acked)} acked of {len(idx)} sent, {w.gets} GETs answered; gateway up {up}; "
                f"{_public(res)}; second client exact {exact}")
        print(f"[reliability] {line}")
        if not (up and exact and res["wrong_bytes"] == res["acked_lost"] == res["present_unreadable"] == 0):
            problems.append(line)
    ud = usage_vs_disk(gw.port, card)
    totals["usage_equals_disk"] = ud["usage_bytes"] == ud["disk_bytes"] and ud["usage_objects"] == ud["disk_files"]
    _figures("client_kill9", **totals)
    assert totals["gateway_stayed_up"] == CLIENT_KILLS, problems
    assert totals["ring_freed"] == CLIENT_KILLS
    assert totals["wrong_bytes"] == 0 and totals["wrong_bytes_seen_by_writer"] == 0, problems
    assert totals["acked_lost"] == 0 and totals["present_unreadable"] == 0, problems
    assert totals["half_filled_objects_served"] == 0, problems
    assert totals["second_client_exact"] == CLIENT_KILLS, problems
    assert totals["usage_equals_disk"], ud


# ---------------------------------------------------------------------------- eviction with fragments
class PresentButUnreadable(AssertionError):
    """An object the gateway calls present does not read back (fragments evicted apart)."""


def test_eviction_with_fragments_under_load(start_gateway, writers, tmp_path):
    """64 KiB fragments of 256 KiB objects on a card of ~40 objects, flooded with PUTs and GETs
    (rounds of twice the capacity): nothing is ever served wrong, nothing is
    present-but-unreadable once the load stops, usage equals the disk and stays under the
    capacity, and a re-PUT of an evicted key stores it again."""
    rng = random.Random(_seed("eviction-fragments"))
    obj, frag = 256 * 1024, 64 * 1024
    per_object = 4 * (frag + 4096)            # four fragment files, each with its 4 KiB header
    capacity = 40 * per_object
    gw = start_gateway(shared_memory_size=16 << 20, thread_pool_size=4, fragment_size=frag, num_dbs=8,
                       capacity_bytes=capacity, eviction_watermark=0.9, eviction_ratio=0.3)
    card = gw.card_dirs[0]
    rounds, per_round = 4, 80
    keys: list[bytes] = []
    acked: set[int] = set()
    fig = {"objects_put": 0, "acked": 0, "gets_under_load": 0, "wrong_bytes": 0, "wrong_bytes_seen_by_writer": 0,
           "present_unreadable": 0, "usage_mismatches": 0, "over_capacity": 0, "reput": 0,
           "reput_answered_existed": 0, "reput_not_readable": 0}
    unreadable_seen = []
    for r in range(rounds):
        w = writers(gw.port, f"writer-evict-{r}", "--prefix", f"evict-{r}", "--count", per_round, "--obj", obj,
                    "--batch", 4, "--inflight", 4, "--get-own", "--seed", rng.randrange(1 << 30))
        wait_for(lambda: w.poll().end or not w.alive(), 120, "the eviction flood to finish", every_s=0.02)
        assert w.end == "done", w.output()
        offset = len(keys)
        keys += [key_of(f"evict-{r}", i) for i in range(per_round)]
        acked.update(offset + i for i in w.acked)
        fig["objects_put"] += per_round
        fig["acked"] += len(w.acked)
        fig["gets_under_load"] += w.gets
        fig["wrong_bytes_seen_by_writer"] += w.get_wrong
        checker = Checker(gw.port, f"checker-evict-{r}")
        try:
            res = checker.verify(keys, obj)        # once the load stopped
            ud = usage_vs_disk(gw.port, card)
            gone = [i for i, g in enumerate(res["good"]) if not g]
            unreadable = [i for i in gone if res["present_flags"][i]]
            # re-PUT evicted keys, the present-but-unreadable ones first: each must be stored again
            others = [i for i in gone if i not in unreadable]
            again = (unreadable + rng.sample(others, min(len(others), 6)))[:8]
            flags = checker.put([keys[i] for i in again], obj)
            hits, wrong = checker.get([keys[i] for i in again], obj)
        finally:
            checker.close()
        fig["wrong_bytes"] += res["wrong_bytes"] + len(wrong)
        fig["present_unreadable"] += res["present_unreadable"]
        unreadable_seen += [(r, i) for i in unreadable]
        fig["usage_mismatches"] += ud["usage_bytes"] != ud["disk_bytes"] or ud["usage_objects"] != ud["disk_files"]
        fig["over_capacity"] += ud["usage_bytes"] > capacity
        fig["reput"] += len(again)
        fig["reput_answered_existed"] += sum(flags.existed)
        fig["reput_not_readable"] += sum(1 for j, h in enumerate(hits) if not h or j in wrong)
        print(f"[reliability] eviction round {r + 1}: {_public(res)}; usage {ud['usage_bytes']} B / disk "
              f"{ud['disk_bytes']} B; re-PUT {len(again)} evicted (of them present-but-unreadable "
              f"{len(unreadable)}): stored {sum(flags.stored)}, answered existed {sum(flags.existed)}, read back {sum(hits)}")
    fig["evicted_fragments"] = gateway_stats(gw.port, 5.0)["cards"][0]["evicted"]
    fig["capacity_bytes"] = capacity
    _figures("eviction_fragments", **fig)
    assert fig["evicted_fragments"] > 0, "eviction never ran"
    assert fig["wrong_bytes"] == 0 and fig["wrong_bytes_seen_by_writer"] == 0, "wrong bytes served"
    assert fig["usage_mismatches"] == 0 and fig["over_capacity"] == 0, fig
    if fig["present_unreadable"]:
        raise PresentButUnreadable(f"{fig['present_unreadable']} objects EXIST but do not read back "
                                  f"(round, index): {unreadable_seen[:10]}")
    if fig["reput_not_readable"]:
        raise PresentButUnreadable(f"re-PUT of {fig['reput']} evicted keys: {fig['reput_answered_existed']} "
                                  f"answered 'existed', {fig['reput_not_readable']} not readable afterwards")
