"""The fs card at scale: its compact index, the scan at start while the card serves.

- the index's eviction against an exact LRU simulated on the same skewed (Zipf) trace,
  both with the card's watermark policy (unit: the index alone, no files);
- a real gateway on a real card of 100,000 objects (files written with the card's own
  writer, ``fs_cards``): it answers while its scan runs (the benchmark measures how soon:
  the test waits on what the gateway reports, with deadlines generous for a loaded 2-core
  machine); every hit during the scan is byte-exact; PUTs during the scan (new keys, and
  keys already on disk that the scan may not have reached) are neither lost nor counted
  twice; once the scan ends every object is found and usage equals the files on disk; a
  kill -9 in the middle of the scan loses nothing; the index holds at most 100 bytes an
  object (RssAnon).
"""

from __future__ import annotations

import collections
import json
import os
import random
import stat
import time

import numpy as np
import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.cards.base import CardError
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.cards.fs.files import object_name
from adpkv_gateway.cards.fs.index import FsIndex
from adpkv_gateway.cards.fragments import fragment_db, fragment_key

from ..fs_cards import build_card, card_keys, files_on_disk, object_paths, payload_of

ON_DISK = 4096 + 1024


def _zipf_trace(n_keys: int, length: int, s: float, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_keys + 1) ** s
    ranks = rng.choice(n_keys, size=length, p=weights / weights.sum())
    perm = rng.permutation(n_keys)               # popularity not in key order
    return perm[ranks].tolist()


def _exact_lru(trace, capacity_objects: int, watermark: float, ratio: float) -> tuple[int, int]:
    """(hits, evictions) of an exact LRU (OrderedDict) with the card's policy: past
    ``watermark`` of the capacity, evict down to ``watermark - ratio``."""
    lru: "collections.OrderedDict[int, None]" = collections.OrderedDict()
    hits = evictions = 0
    high, low = capacity_objects * watermark, capacity_objects * (watermark - ratio)
    for k in trace:
        if k in lru:
            lru.move_to_end(k)
            hits += 1
            continue
        if len(lru) + 1 > high:
            while len(lru) > low - 1:
                lru.popitem(last=False)
                evictions += 1
        lru[k] = None
    return hits, evictions


def test_eviction_follows_an_exact_lru_on_a_zipf_trace():
    n_keys, capacity_objects = 20000, 2000
    keys = card_keys(n_keys, "lru")
    trace = _zipf_trace(n_keys, 60000, 0.9, seed=7)
    index = FsIndex("/nowhere", lambda db, fkey: f"/nowhere/{db}/{fkey.hex()}",
                    capacity_bytes=capacity_objects * ON_DISK, watermark=0.95, ratio=0.10)
    hits = 0
    for k in trace:
        fkey = fragment_key(keys[k], 0)
        if index.locate(fkey) is not None:
            hits += 1
            continue
        ok, _ = index.reserve(keys[k], fkey, ON_DISK)
        assert ok
        assert index.commit(fkey, 0, 1024, ON_DISK, 1024) == (True, [])
    want_hits, want_evictions = _exact_lru(trace, capacity_objects, 0.95, 0.10)
    assert abs(hits - want_hits) <= 0.005 * len(trace), (hits, want_hits)
    assert abs(index.evicted - want_evictions) <= 0.01 * want_evictions + 10, (index.evicted, want_evictions)
    assert index.usage()[0] <= capacity_objects * ON_DISK * 0.95


def test_pins_and_quotas_bound_eviction_in_the_index():
    keys = card_keys(400, "pins")
    pinned = set(keys[:50])
    from adpkv_core.keys import namespace_id
    index = FsIndex("/nowhere", lambda db, fkey: f"/nowhere/{db}/{fkey.hex()}", capacity_bytes=1 << 40,
                    is_pinned=lambda key: key in pinned, quotas={namespace_id("pins"): 100 * ON_DISK})
    for key in keys:
        fkey = fragment_key(key, 0)
        ok, _ = index.reserve(key, fkey, ON_DISK)
        assert ok
        index.commit(fkey, 0, 1024, ON_DISK, 1024)
    assert index.usage()[0] <= 100 * ON_DISK
    assert all(index.locate(fragment_key(k, 0)) is not None for k in keys[:50]), "a pinned object was evicted"
    assert all(index.locate(fragment_key(k, 0)) is not None for k in keys[-50:]), "the newest must stay"
    assert index.objects() == 100


def _client(port, engine):
    return GatewayClient(ClientConfig(port=port, timeout_s=60.0, busy_wait_s=0), engine, rank=0, world_size=1)


def _put(client, keys, size, make):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + size] = make(keys[b.first + j], size)
    return client.put(keys, size, fill).result().stored


def _get_checked(client, keys, size, allowed):
    """Hits of ``keys``; each hit's bytes must be one of ``allowed(key)``."""
    wrong = []

    def check(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride
                key = keys[b.first + j]
                if bytes(client.ring[o:o + size]) not in allowed(key):
                    wrong.append(key.hex())
    hits = client.get(keys, size, check).result().hits
    assert not wrong, f"{len(wrong)} hits with wrong bytes"
    return hits


def _other(key: bytes, size: int) -> bytes:
    return payload_of(key[::-1], size)


def _indexing(port) -> bool:
    work = control.request(port, {"op": "STATS"}, timeout_s=60)["stats"].get("work", [])
    return any(w in x.get("what", "") for x in work for w in ("indexing", "checking", "trimming"))


def _wait_scanned(gw, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while _indexing(gw.port):
        assert time.monotonic() < deadline, "the scan did not end"
        time.sleep(0.1)


def _usage(port):
    card = control.request(port, {"op": "STATS"}, timeout_s=60)["stats"]["cards"][0]
    return card["used_bytes"], card["objects"]


def _rss_anon(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def _first_answer_while_scanning(gw, name):
    """A client of ``gw`` once it answered an EXIST; the card must still be indexing its files
    then (the scan runs behind the serving card: 100,000 files take several seconds even on a
    quiet machine). The callers bound how soon it answers by ``SERVE_DEADLINE_S`` from the
    process's start (the interpreter's start included: generous for a loaded 2-core VM)."""
    client = _client(gw.port, name)
    found = client.exist(card_keys(1, start=10**6)).result()
    assert found == [False]
    assert _indexing(gw.port), "the card should still be scanning its 100,000 files when it first answers"
    return client


SERVE_DEADLINE_S = 30.0
SCAN_DEADLINE_S = 1800.0      # 100,000 files: 3-9 s here when quiet, minutes on a loaded 2-core VM


def test_a_large_card_serves_at_once_and_is_whole_after_its_scan(start_gateway, tmp_path):
    n, size = 100_000, 1024
    root = str(tmp_path / "card")
    keys = card_keys(n)
    build_card(root, keys)
    empty = start_gateway()
    empty_rss = _rss_anon(empty.proc.pid)
    empty.stop()

    t0 = time.monotonic()
    gw = start_gateway(card_dirs=[root])
    client = _first_answer_while_scanning(gw, "scan")
    served_s = time.monotonic() - t0
    assert served_s <= SERVE_DEADLINE_S, f"first EXIST answered {served_s:.2f} s after the start"
    sample = random.Random(1).sample(keys, 2000)
    hits = _get_checked(client, sample, size, lambda k: (payload_of(k, size),))
    assert sum(hits) <= len(sample)
    # PUTs during the scan: new keys, and keys on disk the scan may not have reached yet
    fresh = card_keys(300, start=n)
    assert all(_put(client, fresh, size, payload_of))
    rewritten = keys[-300:]
    stored = _put(client, rewritten, size, _other)   # 'existed' where the scan was there first
    allowed = lambda k: (payload_of(k, size), _other(k, size))
    assert all(_get_checked(client, rewritten, size, allowed))
    assert all(_get_checked(client, fresh, size, lambda k: (payload_of(k, size),)))
    client.close()
    # kill -9 (no snapshot: the next start scans again), then kill -9 again while that scan is
    # seen running, then a scan to its end
    for name in ("scan2", "scan3"):
        gw.kill()
        gw.start(timeout_s=SERVE_DEADLINE_S)
        client = _first_answer_while_scanning(gw, name)
        client.close()
    gw.kill()
    gw.start(timeout_s=SERVE_DEADLINE_S)
    client = _client(gw.port, "scan4")
    _wait_scanned(gw, SCAN_DEADLINE_S)
    everything = keys + fresh
    # the index is 64 B a row + 8-16 B of hash slots; the rest is the heap the test's own requests
    # left (measured 91-99 B here at 100k; the benchmark's 1M point spreads it thinner). The
    # scan's thread hands its heap back after its last work item (the sweep, the trim) has left
    # STATS, so the figure is read until it is within bounds or a deadline passes
    deadline = time.monotonic() + 20
    while True:
        per_object = (_rss_anon(gw.proc.pid) - empty_rss) / len(everything)
        if per_object <= 110 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"RssAnon over an empty card's: {per_object:.0f} B an object")
    assert per_object <= 110, f"{per_object:.0f} B of anonymous memory an object"
    assert all(client.exist(everything).result()), "an object on disk was not found after the scan"
    assert all(_get_checked(client, sample + fresh, size, lambda k: (payload_of(k, size),) if k in set(fresh)
                            else allowed(k)))
    on_disk_bytes, on_disk_files = files_on_disk(root)
    assert on_disk_files == len(everything)
    assert _usage(gw.port) == (on_disk_bytes, on_disk_files), "usage must equal the files on disk"
    assert sum(stored) <= len(rewritten)
    client.close()


def _since(gw, mark: int) -> str:
    return gw.log()[mark:]


def test_a_snapshot_spares_the_scan_and_is_never_used_once_older_than_the_files(start_gateway, tmp_path):
    """A clean stop saves the index; the next start takes it instead of a scan. A snapshot
    older than the files (objects stored and deleted after it), a truncated one, another
    card's, and the temporary file a kill -9 leaves in the middle of its write are each
    ignored with one line: the card scans and finds exactly what is on disk."""
    size = 1024
    root = str(tmp_path / "card")
    keys = card_keys(3000)
    build_card(root, keys)
    gw = start_gateway(card_dirs=[root])
    _wait_scanned(gw)
    gw.stop()
    snap = os.path.join(root, ".adpkv-index")
    assert os.path.exists(snap), "a clean stop saves the index"
    old = open(snap, "rb").read()

    mark = len(gw.log())
    gw.start()
    text = _since(gw, mark)
    assert "3000 objects in 3000 files, 14.6 MiB from the index snapshot" in text, text
    assert "indexed in" not in text and not _indexing(gw.port)
    client = _client(gw.port, "snap")
    assert all(client.exist(keys).result())
    fresh = card_keys(100, start=3000)
    assert all(_put(client, fresh, size, payload_of))
    gone = keys[:100]
    assert client.delete(gone).result() == 100
    client.close()
    gw.restart(hard=True)                     # no snapshot of this run
    gw.stop(); open(snap, "wb").write(old)    # the first snapshot again: older than the files
    mark = len(gw.log())
    gw.start()
    _wait_scanned(gw)
    text = _since(gw, mark)
    assert text.count("index snapshot ignored") == 1 and "older than the files" in text, text
    client = _client(gw.port, "snap2")
    assert client.exist(gone).result() == [False] * 100, "a deleted object came back from an old snapshot"
    assert all(client.exist(keys[100:] + fresh).result())
    assert all(_get_checked(client, keys[100:200] + fresh, size, lambda k: (payload_of(k, size),)))
    client.close()
    assert _usage(gw.port) == files_on_disk(root)

    gw.stop()
    whole = open(snap, "rb").read()
    open(snap, "wb").write(whole[:len(whole) // 2])
    mark = len(gw.log())
    gw.start()
    _wait_scanned(gw)
    text = _since(gw, mark)
    assert text.count("index snapshot ignored: truncated") == 1, text
    assert _usage(gw.port) == files_on_disk(root)

    other = str(tmp_path / "other")
    build_card(other, card_keys(10, "other"))
    gw_other = start_gateway(card_dirs=[other])
    _wait_scanned(gw_other)
    gw_other.stop()
    gw.stop()
    open(snap, "wb").write(open(os.path.join(other, ".adpkv-index"), "rb").read())
    mark = len(gw.log())
    gw.start()
    _wait_scanned(gw)
    text = _since(gw, mark)
    assert text.count("index snapshot ignored: of another card") == 1, text
    assert _usage(gw.port) == files_on_disk(root)

    gw.stop()
    os.rename(snap, snap + ".tmp")            # a kill -9 in the middle of the write: never renamed
    with open(snap + ".tmp", "r+b") as f:
        f.truncate(len(whole) // 3)
    mark = len(gw.log())
    gw.start()
    _wait_scanned(gw)
    assert not os.path.exists(snap + ".tmp"), "the leftover of an interrupted snapshot is removed"
    assert "index snapshot ignored" not in _since(gw, mark)
    client = _client(gw.port, "snap3")
    assert all(client.exist(keys[100:] + fresh).result()) and not any(client.exist(gone).result())
    client.close()
    assert _usage(gw.port) == files_on_disk(root)


@pytest.mark.parametrize("pins", [0, 300])
def test_a_trim_evicts_down_to_the_watermark_past_its_first_queue(pins):
    """A card whose capacity is now a tenth of what it holds (a restart with a lower
    capacity): the trim evicts down to ``watermark - ratio`` in LRU order, though that takes
    many refills of the eviction queue; pinned objects stay."""
    keys = card_keys(5000, "trim")
    pinned = set(keys[:pins])
    index = FsIndex("/nowhere", lambda db, fkey: f"/nowhere/{db}/{fkey.hex()}", capacity_bytes=1 << 40,
                    is_pinned=lambda key: key in pinned)
    for key in keys:
        fkey = fragment_key(key, 0)
        index.reserve(key, fkey, ON_DISK)
        index.commit(fkey, 0, 1024, ON_DISK, 1024)
    index.capacity_bytes = 500 * ON_DISK
    victims, steps = [], 0
    while step := index.trim(limit=1000):
        assert len(step) <= 1000, "a step of the trim evicts at most its limit"
        victims += step
        steps += 1
    assert steps == 5 and index.over() == 0
    assert index.objects() == int(500 * 0.85) and len(victims) == 5000 - index.objects()
    assert index.usage()[0] == index.objects() * ON_DISK
    assert all(index.locate(fragment_key(k, 0)) is not None for k in keys[:pins]), "a pinned object was evicted"
    assert all(index.locate(fragment_key(k, 0)) is not None for k in keys[-(425 - pins):]), "the newest must stay"


def test_files_are_spread_over_256_subdirectories_of_each_database(tmp_path):
    """Issue 26 item 4: a card's files lie in ``dbNNN/<2 hex digits of the key>/`` (16 x 256
    directories: about 7,300 entries each at 30 M objects, not 1.9 M); every subdirectory is
    made at the first write into it (a new card makes none at open: it serves at once) with the
    databases' mode; the scan, the snapshot and clean find them there."""
    root = str(tmp_path / "card")
    card = FsCard(root, num_dbs=16)
    card.open()
    assert all(os.listdir(os.path.join(root, f"db{db:03d}")) == [] for db in range(16))
    keys = card_keys(3000, "spread")
    for key in keys:
        assert card.write(fragment_db(key, 0, 16), fragment_key(key, 0), memoryview(payload_of(key, 1024)), 1024)
    per_dir = collections.Counter()
    for db in range(16):
        db_dir = os.path.join(root, f"db{db:03d}")
        subs = os.listdir(db_dir)
        written = {object_name(fragment_key(k, 0))[:2] for k in keys if fragment_db(k, 0, 16) == db}
        assert sorted(subs) == sorted(written), f"{db_dir} holds {len(subs)} entries"
        for sub in subs:
            assert stat.S_IMODE(os.stat(os.path.join(db_dir, sub)).st_mode) == 0o700
            per_dir[(db, sub)] = len(os.listdir(os.path.join(db_dir, sub)))
    assert sum(per_dir.values()) == len(keys)
    for key in keys:
        assert os.path.isfile(os.path.join(root, f"db{fragment_db(key, 0, 16):03d}", object_name(fragment_key(key, 0))))
    assert len({sub for (_, sub), n in per_dir.items() if n}) >= 250, "keys must spread over the subdirectories"
    card.close()                                   # the snapshot
    for from_snapshot in (True, False):
        again = FsCard(root, num_dbs=16)
        again.open()
        assert again.scanned.wait(60)
        assert all(again.contains_many([(0, fragment_key(k, 0)) for k in keys])), from_snapshot
        assert again.usage().objects == len(keys)
        if from_snapshot:
            again.close()
            os.unlink(os.path.join(root, ".adpkv-index"))    # the next open scans the subdirectories
    assert again.clean() == len(keys)
    assert files_on_disk(root) == (0, 0)
    again.close()


def test_a_card_of_the_flat_layout_is_refused_saying_what_to_do(tmp_path):
    """A card written in format 2 (every file straight in its ``dbNNN``) is refused with a
    line naming the formats and what to do; nothing in it is touched."""
    root = tmp_path / "card"
    card = FsCard(str(root), num_dbs=2)
    card.open()
    card.close()
    meta = json.loads((root / "adpkv-card.json").read_text())
    meta["format"] = 2
    (root / "adpkv-card.json").write_text(json.dumps(meta))
    flat = root / "db000" / ("ab" * 30)
    flat.write_bytes(b"a file of the flat layout")
    with pytest.raises(CardError, match="written in format 2; this gateway reads format 3 only .*give the card an "
                                        "empty directory, or remove this one's contents"):
        FsCard(str(root), num_dbs=2).open()
    assert flat.read_bytes() == b"a file of the flat layout"


def test_requests_are_answered_while_a_large_trim_runs(start_gateway, tmp_path):
    """A restart with a tenth of the room a card of 40,000 objects needs: the trim at start
    evicts 36,000 objects in steps, giving the index's lock up between them, so STATS is
    answered while it runs: a STATS sees the object count between the full card and the
    trimmed one (a trim in one step under the lock drops it at once: no answer can), and
    none waits long (one step, not the whole trim)."""
    n, size = 40_000, 64
    on_disk = 4096 + size
    root = str(tmp_path / "card")
    keys = card_keys(n, "trim-live")
    build_card(root, keys, size=size)
    capacity = n // 10 * on_disk
    final = int(capacity * (0.95 - 0.10)) // on_disk
    gw = start_gateway(card_dirs=[root], capacity_bytes=capacity)
    deadline = time.monotonic() + 600
    seen: list[int] = []
    slowest = 0.0
    while True:
        assert time.monotonic() < deadline, f"the trim did not end; counts seen {seen[-5:]}"
        asked = time.monotonic()
        reply = control.request(gw.port, {"op": "STATS"}, timeout_s=60)
        slowest = max(slowest, time.monotonic() - asked)
        assert reply is not None, "STATS was not answered within 60 s"
        seen.append(reply["stats"]["cards"][0]["objects"])
        busy = any(w in x.get("what", "") for x in reply["stats"].get("work", [])
                   for w in ("indexing", "trimming"))
        if not busy and seen[-1] <= final:
            break
    top = seen.index(max(seen))             # the scan's end: from there on only the trim changes the count
    during = [c for c in seen[top:] if final < c < n]
    assert during, "no STATS was answered while the trim ran (the count went from the full card to the trimmed one)"
    assert slowest < 5.0, f"a STATS waited {slowest:.1f} s: the trim held the index's lock"
    assert seen[-1] == final and files_on_disk(root)[1] == final


def test_clean_reports_objects_not_fragment_files(start_gateway):
    """Issue 28: CLEAN of objects of 4 fragments each reports the objects (it counted files)."""
    gw = start_gateway(fragment_size=16 * 1024)
    keys = card_keys(10, "clean")
    client = _client(gw.port, "clean")
    assert all(_put(client, keys, 64 * 1024, payload_of))
    client.close()
    assert _usage(gw.port)[1] == 40
    assert control.request(gw.port, {"op": "CLEAN"}, timeout_s=60)["deleted"] == 10
    assert _usage(gw.port) == (0, 0) and files_on_disk(gw.card_dirs[0]) == (0, 0)


def _two_fragment_object(card, okey: bytes, write_id: int, wid_of_second: int) -> None:
    """An object of two 4 KiB fragments in database 0: fragment 1 stamped ``wid_of_second``,
    the head (written last) ``write_id``."""
    card.write(0, okey + b"\0\1", memoryview(os.urandom(4096)), 0, b"", wid_of_second)
    card.write(0, okey + b"\0\0", memoryview(os.urandom(4096)), 8192, b"", write_id)


def test_write_ids_survive_the_snapshot_and_the_scan_removes_torn_objects(tmp_path):
    """The index row keeps the head's write id through a clean stop (the snapshot) and a
    scan; a read expecting another write is a miss that removes nothing (CHANGED). An object
    whose fragments carry another write id than its head (an overwrite cut short: torn), its
    files older than the start, is removed by the scan. Real files, the card's own open/close."""
    import time as _time

    from adpkv_gateway.cards.base import Head, Read
    from adpkv_gateway.cards.fs.card import SNAPSHOT_FILE, FsCard
    root = str(tmp_path / "card")
    whole, torn = b"w" * 28, b"t" * 28
    card = FsCard(root, num_dbs=2, capacity_bytes=1 << 30)
    card.open()
    assert card.scanned.wait(30)
    _two_fragment_object(card, whole, 0x1122334455667788, 0x1122334455667788)
    _two_fragment_object(card, torn, 0xAAAA, 0xBBBB)      # as a crash between two writers leaves it
    assert card.heads([(0, whole + b"\0\0")]) == [Head(8192, 0x1122334455667788)]
    card.close()
    assert os.path.exists(os.path.join(root, SNAPSHOT_FILE))
    card = FsCard(root, num_dbs=2, capacity_bytes=1 << 30)
    card.open()                                        # from the snapshot: the write id is in the row
    assert card.scanned.wait(30)
    assert card.heads([(0, whole + b"\0\0")]) == [Head(8192, 0x1122334455667788)]
    buf = memoryview(bytearray(4096))
    assert card.read(0, whole + b"\0\1", buf, b"", 0x1122334455667788) is Read.HIT
    assert card.read(0, whole + b"\0\1", buf, b"", 0x99) is Read.CHANGED
    assert card.heads([(0, whole + b"\0\0")]) == [Head(8192, 0x1122334455667788)], "a CHANGED read dropped it"
    card.close()
    os.unlink(os.path.join(root, SNAPSHOT_FILE))       # the next start scans the files
    old = _time.time() - 60
    for path in object_paths(root):
        os.utime(path, (old, old))
    card = FsCard(root, num_dbs=2, capacity_bytes=1 << 30)
    card.open()
    assert card.scanned.wait(30)
    assert card.heads([(0, whole + b"\0\0"), (0, torn + b"\0\0")]) == [Head(8192, 0x1122334455667788), None]
    left = sorted(os.path.basename(p) for p in object_paths(root))
    assert not [n for n in left if n.startswith(torn.hex())], f"the torn object's files stayed: {left}"
    card.close()


def test_the_batch_head_lookup_answers_as_heads_and_contains_many(tmp_path):
    """``FsCard.heads_found`` (every head of an EXIST in one index lookup) answers what the
    per-head rule (``Card.heads_found``: ``heads``, then ``contains_many`` at each head's first
    extent) answers, for objects of one and of several fragments, absent ones, a GET's size that
    is and is not the stored one."""
    from adpkv_gateway.cards.base import Card, FirstExtent
    from adpkv_gateway.store.health import CardHealth
    from adpkv_gateway.store.object_store import ObjectStore
    from adpkv_gateway.store.pins import Pins
    card = FsCard(str(tmp_path / "card"), num_dbs=4)
    card.open()
    store = ObjectStore([card], 16, 4, "dialog", 2048, True, 1, CardHealth([card], 0, 3), Pins())
    keys = card_keys(400, "heads")
    sizes = [random.Random(i).choice([100, 2048, 3000, 5000]) for i in range(len(keys))]
    active = store.service.active
    for key, size in zip(keys[:300], sizes):
        assert store.io.write_replicas(store.write_plans(key, 0, size, active), memoryview(payload_of(key, size)))
    dbs = np.array([fragment_db(k, 0, 4) for k in keys], np.int64)
    hits = {}
    for object_bytes in (None, 100, 2048, 3000, 5000, 7):
        for frag in (0, 2048):
            first = FirstExtent(object_bytes, frag)
            got = card.heads_found(keys, dbs, first, [b""] * len(keys))
            want = Card.heads_found(card, keys, dbs, first, [b""] * len(keys))
            assert got.found.tolist() == want.found.tolist(), (object_bytes, frag)
            assert got.size.tolist() == want.size.tolist() and got.write_id.tolist() == want.write_id.tolist()
            hits[(object_bytes, frag)] = int(got.found.sum())
    assert hits[(None, 2048)] == 300 and hits[(100, 0)] > 0 and hits[(7, 2048)] == 0, hits
    assert store.lookup.exists(keys, None) == [True] * 300 + [False] * 100
def test_the_snapshot_check_judges_again_each_object_whose_files_changed(tmp_path, caplog):
    """A start from the snapshot checks each object's files against it (``fs_scan.verify``):
    files changed in place since the stop (no directory's time changes, so the snapshot is
    taken) are judged again from their headers: a truncated one is removed and its object
    gone; one only touched since is sound and stays indexed, readable; an unchanged one
    stays. Real files, the card's own open/close."""
    from adpkv_gateway.cards.base import Head, Read
    from adpkv_gateway.cards.fs.card import SNAPSHOT_FILE
    root = str(tmp_path / "card")
    cut, touched, kept = b"c" * 28, b"t" * 28, b"k" * 28
    card = FsCard(root, num_dbs=2, capacity_bytes=1 << 30)
    card.open()
    assert card.scanned.wait(30)
    for n, okey in enumerate((cut, touched, kept), 1):
        assert card.write(0, okey + b"\0\0", memoryview(os.urandom(4096)), 4096, b"", n)
    card.close()
    assert os.path.exists(os.path.join(root, SNAPSHOT_FILE))
    path_of = {os.path.basename(p)[:56]: p for p in object_paths(root)}
    os.truncate(path_of[cut.hex()], 4096 + 100)
    os.utime(path_of[touched.hex()])
    card = FsCard(root, num_dbs=2, capacity_bytes=1 << 30)
    with caplog.at_level("INFO", logger="adpkv.gateway.fs"):
        card.open()
        assert card.scanned.wait(30)
    assert "3 objects in 3 files, 0.0 MiB from the index snapshot" in caplog.text, caplog.text
    assert "index snapshot checked against the files, 2 objects changed since" in caplog.text, caplog.text
    assert card.heads([(0, k + b"\0\0") for k in (cut, touched, kept)]) == [None, Head(4096, 2), Head(4096, 3)]
    assert not os.path.exists(path_of[cut.hex()]), "the truncated file stayed"
    buf = memoryview(bytearray(4096))
    assert card.read(0, touched + b"\0\0", buf, b"", 2) is Read.HIT
    assert card.read(0, kept + b"\0\0", buf, b"", 3) is Read.HIT
    assert card.index.objects() == 2 and card.index.usage()[1] == 2
    card.close()


def test_a_disk_other_files_filled_shrinks_the_card_at_start_with_a_warning(tmp_path, caplog):
    """A card whose capacity is the disk's (the default) restarts on a file system that other
    files have filled: its capacity is what it holds plus the free space, the trim at start
    evicts down to the watermark, and the gateway says so as a WARNING naming the free space
    and the objects evicted (an operator's stored objects are gone: not an INFO line). Real
    files on a real tmpfs of 16 MiB (root mounts it: the suite runs as root)."""
    import logging
    import subprocess

    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs: run the core suite as root, as CI does")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        root = str(mnt / "card")
        n, size = 200, 16 * 1024
        build_card(root, card_keys(n, "full-disk"), size=size)
        held, files = files_on_disk(root)
        assert files == n
        with open(mnt / "other-files", "wb") as fh:     # another program fills the file system
            try:
                while True:
                    fh.write(b"x" * 65536)
                    fh.flush()
            except OSError:
                pass
        caplog.set_level(logging.INFO, logger="adpkv.gateway.fs")
        card = FsCard(root, num_dbs=16)
        card.open()
        try:
            assert card.scanned.wait(60), "the scan at start did not end"
            left = card.index.objects()
        finally:
            card.close()
        assert 0 < left < n and files_on_disk(root)[1] == left
        assert left <= int(card.index.capacity_bytes * 0.85 / (held / n)) + 1
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "trimmed" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert "free space" in warned[0].getMessage() and f"{n - left} objects evicted" in warned[0].getMessage()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
