"""The card trusts only what it owns; no acknowledged object is lost to a transient error;
objects are whole under racing writers (issue 25, items 2, 5 and 6).

Real root gateways, real files, real redis-server processes and clusters, real client
processes; the hostile local user is a forked child that drops to uid 65534
(``test_security.as_nobody``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import stat
import tempfile
import time
import traceback

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway.spawn import GatewayProcess

from .rankproc import make_keys, pattern
from .test_security import NOBODY, as_nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, "
                                "the attacker as uid 65534")

OBJ = 8192


@pytest.fixture
def open_dir():
    """A directory every user may traverse and create in (as /tmp is): where a hostile user
    can get in first."""
    path = tempfile.mkdtemp(prefix="adpkv-adv-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fill(client, keys, rank, nbytes):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + nbytes] = pattern(keys[b.first + j], rank, nbytes)
    return fill


def _get_exact(client, keys, nbytes, ranks=(0,)):
    """Hits of a GET of ``keys``; every hit must be byte for byte one of ``ranks``' patterns
    (which one, per key: the second list), else the test fails."""
    wrong, whose = [], [None] * len(keys)

    def check(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride
                got = bytes(client.ring[o:o + nbytes])
                for r in ranks:
                    if got == pattern(keys[b.first + j], r, nbytes):
                        whose[b.first + j] = r
                        break
                else:
                    wrong.append(b.first + j)
    hits = list(client.get(keys, nbytes, check).result(timeout=60))
    assert not wrong, f"hits that are no one writer's whole object: {wrong[:10]} ({len(wrong)} of {len(keys)})"
    return hits, whose


def _refused(tmp_path, card, why):
    gw = GatewayProcess([card], log_path=str(tmp_path / "refused.log"), shared_memory_size=16 << 20)
    with pytest.raises(Exception):
        gw.start(timeout_s=20)
    deadline = time.monotonic() + 20
    while gw.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if gw.alive():
        gw.kill()
    log = gw.log()
    assert why in log, log[-3000:]
    return log


# ---------------------------------------------------------------- item 2: a card someone else made
def _make_dir(path):
    os.mkdir(path, 0o700)
    return os.stat(path).st_uid


def test_a_card_directory_made_by_another_user_is_refused(tmp_path, open_dir):
    """uid 65534 creates the card directory before the gateway's first start: the gateway
    refuses it, naming the directory, its owner and mode, and writes nothing into it."""
    card = os.path.join(open_dir, "card")
    assert as_nobody(_make_dir, card) == NOBODY
    log = _refused(tmp_path, card, f"fs card directory {card} is not the gateway's own (owner uid {NOBODY}, "
                                   "mode 0700")
    assert "error" in log.lower()
    assert os.listdir(card) == [], "the gateway wrote into a directory another user owns"
    assert os.stat(card).st_uid == NOBODY


def _swap_db_for_own_dir(card, db):
    """As 65534 (the card was made world-writable by a careless admin, or was never the
    gateway's): replace ``db`` by a directory of its own holding a forged object file."""
    forged = os.path.join(card, db + ".forged")
    os.mkdir(forged, 0o700)
    os.rename(os.path.join(card, db), os.path.join(card, db + ".old"))
    os.rename(forged, os.path.join(card, db))
    return True


@pytest.mark.parametrize("how", ["symlink to a root directory", "a directory of uid 65534",
                                 "card directory writable by others"])
def test_a_swapped_database_is_refused_and_nothing_is_followed(tmp_path, open_dir, start_gateway, how):
    """After a clean stop, one ``dbNNN`` of root's card is swapped: for a symlink to a root
    directory (holding hex-named root files), or for a directory of uid 65534 holding a
    forged copy of an object; or the card directory itself was left writable by others.
    The restart refuses the card with the path, owner and mode; the root directory's files
    are neither deleted nor chmodded nor read; no forged object is served."""
    card = os.path.join(open_dir, "card")
    keys = make_keys(8, namespace="adv-card")
    gw = start_gateway(card_dirs=[card], num_dbs=4)
    c = GatewayClient(ClientConfig(port=gw.port), "adv-card-engine")
    assert c.put(keys, OBJ, _fill(c, keys, 0, OBJ)).result(10).stored == [True] * 8
    c.close()
    gw.stop()
    victim = str(tmp_path / "root-only")
    os.mkdir(victim, 0o755)
    victim_file = os.path.join(victim, "ab" * 15)
    with open(victim_file, "wb") as fh:
        fh.write(b"root's own file")
    os.chmod(victim_file, 0o644)
    if how.startswith("symlink"):
        os.rename(os.path.join(card, "db001"), os.path.join(card, "db001.old"))
        os.symlink(victim, os.path.join(card, "db001"))
        why = f"fs card directory {card}/db001 is a symlink or not a directory"
    elif how.startswith("a directory"):
        os.chmod(card, 0o777)               # how the attacker got in; then put back
        assert as_nobody(_swap_db_for_own_dir, card, "db002")
        os.chmod(card, 0o700)
        for name in os.listdir(os.path.join(card, "db002.old")):     # the forgery: root's objects, copied
            shutil.copyfile(os.path.join(card, "db002.old", name), os.path.join(card, "db002", name))
        why = f"fs card directory {card}/db002 is not the gateway's own (owner uid {NOBODY}"
    else:
        os.chmod(card, 0o777)
        why = f"fs card directory {card} is not the gateway's own (owner uid 0, mode 0777"
    _refused(tmp_path, card, why)
    assert os.listdir(victim) == ["ab" * 15], "a file of a directory the card links to was removed"
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755 and stat.S_IMODE(os.stat(victim_file).st_mode) == 0o644
    with open(victim_file, "rb") as fh:
        assert fh.read() == b"root's own file"


def test_symlinks_at_temporary_names_are_not_followed(tmp_path):
    """Symlinks placed at the names the card's next writes will use (the names made
    predictable for the test: the one stand-in) to a root-only file: the writes fail
    (``O_EXCL | O_NOFOLLOW``), the root file keeps its bytes and mode, and the card serves no
    object of them; a symlink at an object's own name is a miss, never followed, and goes."""
    from adpkv_gateway.cards.base import Read
    from adpkv_gateway.cards.fs import FsCard
    card = FsCard(str(tmp_path / "card"), num_dbs=1)
    card.open()
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's secret")
    os.chmod(secret, 0o600)
    card._tmp_tag = "predictable"
    fkey = b"t" * 28 + b"\0\0"
    db0 = os.path.join(card.root, "db000")
    for seq in range(1, 4):
        os.symlink(secret, os.path.join(db0, f".{fkey.hex()}.predictable.{seq}"))
    data = memoryview(bytearray(os.urandom(4096)))
    for _ in range(3):
        assert not card.write(0, fkey, data, object_bytes=4096)
    assert secret.read_bytes() == b"root's secret" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert card.contains_many([(0, fkey)]) == [False]
    assert card.write(0, fkey, data, object_bytes=4096)     # a fresh name: stored
    os.unlink(os.path.join(db0, fkey.hex()))
    os.symlink(secret, os.path.join(db0, fkey.hex()))        # an object's name swapped for a link
    out = bytearray(4096)
    assert card.read(0, fkey, memoryview(out)) is Read.FOREIGN
    assert not os.path.lexists(os.path.join(db0, fkey.hex())), "the symlink at the object's name stayed"
    assert secret.read_bytes() == b"root's secret"
    card.close()


# ---------------------------------------------------------------- item 5: EMFILE on the read path
def _lowest_free_fd(pid):
    used = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    fd = 0
    while fd in used:
        fd += 1
    return fd


@pytest.mark.parametrize("io_processes", [0, 1], ids=["threads", "io-process"])
def test_descriptors_used_up_delete_no_acknowledged_object(start_gateway, io_processes):
    """The gateway's descriptors run out (its soft RLIMIT_NOFILE lowered under its open
    descriptors with prlimit): every open() on the read path fails with EMFILE. Its GETs
    miss, and delete nothing: once descriptors are back, every acknowledged object hits,
    byte exact."""
    gw = start_gateway(io_processes=io_processes)
    keys = make_keys(32, namespace="emfile")
    c = GatewayClient(ClientConfig(port=gw.port), "emfile-engine")
    assert c.put(keys, OBJ, _fill(c, keys, 0, OBJ)).result(10).stored == [True] * 32
    pids = [gw.proc.pid]
    if io_processes:
        pids += [int(p) for p in open(f"/proc/{gw.proc.pid}/task/{gw.proc.pid}/children").read().split()]
    saved = {pid: resource.prlimit(pid, resource.RLIMIT_NOFILE) for pid in pids}
    try:
        for pid in pids:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), saved[pid][1]))
        hits, _ = _get_exact(c, keys, OBJ)
        assert sum(hits) < len(keys), "no read failed: the test ran out of nothing"
    finally:
        for pid, limits in saved.items():
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    hits, _ = _get_exact(c, keys, OBJ)
    assert hits == [True] * len(keys), f"acknowledged objects lost to EMFILE: {hits.count(False)} of {len(keys)}"
    c.close()


# ---------------------------------------------------------------- item 6: racing writers
BIG = 64 << 10
FRAG = 16 << 10


ENGINE, WORLD = "racing-engine", 3       # ranks 0 and 1 write, rank 2 reads (one engine per gateway)


def _rank(port, rank):
    client = GatewayClient(ClientConfig(port=port, timeout_s=60, busy_wait_s=0), ENGINE, rank=rank,
                           world_size=WORLD)
    assert client.enabled, "the rank did not attach"
    return client


def _writer(port, rank, keys, start, out_q):
    """Rank ``rank`` stores every key on its own (rank-local PUTs, not a collective one)
    with its own bytes."""
    try:
        client = _rank(port, rank)
        start.wait(30)
        for k in range(0, len(keys), 64):
            part = keys[k:k + 64]
            stored = client.put(part, BIG, _fill(client, part, rank, BIG)).result(60).stored
            assert all(stored), f"rank {rank}: not stored: {stored}"
        out_q.put((rank, True))
        client.close()
    except Exception:
        out_q.put((rank, traceback.format_exc()))


def _reader(port, keys, start, stop, out_q):
    """GETs during the race: every hit one writer's whole object."""
    try:
        client = _rank(port, 2)
        start.wait(30)
        seen = 0
        while not stop.is_set():
            hits, _ = _get_exact(client, keys, BIG, ranks=(0, 1))
            seen += sum(hits)
        out_q.put(("reader", seen))
        client.close()
    except BaseException:
        out_q.put(("reader", traceback.format_exc()))


def _race(port, keys):
    ctx = mp.get_context("fork")
    q, start, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_writer, args=(port, r, keys, start, q)) for r in (0, 1)]
    procs.append(ctx.Process(target=_reader, args=(port, keys, start, stop, q)))
    for p in procs:
        p.start()
    start.set()
    results = [q.get(timeout=120) for _ in range(2)]
    stop.set()
    results.append(q.get(timeout=120))
    for p in procs:
        p.join(30)
    for who, what in results:
        assert what is True or isinstance(what, int), f"{who}: {what}"


def _check_race(port, keys):
    _race(port, keys)
    c = _rank(port, 2)
    hits, whose = _get_exact(c, keys, BIG, ranks=(0, 1))
    c.close()
    assert all(hits), f"acknowledged objects vanished in the race: {hits.count(False)} of {len(keys)}"
    return whose


@pytest.mark.timeout(300)
def test_racing_writers_fs(start_gateway):
    """Two engines store the same 512 keys with different bytes at once (64 KiB objects,
    16 KiB fragments), a third reads them meanwhile: every hit, during and after, is
    exactly one writer's whole object, and every key hits after the race."""
    gw = start_gateway(fragment_size=FRAG, thread_pool_size=8)
    _check_race(gw.port, make_keys(512, namespace="race-fs"))


@pytest.mark.timeout(300)
def test_racing_writers_resp(start_gateway, redis_servers):
    server, = redis_servers(1)
    gw = start_gateway(card_dirs=[server.url], fragment_size=FRAG, thread_pool_size=8)
    _check_race(gw.port, make_keys(512, namespace="race-resp"))


@pytest.mark.timeout(300)
def test_racing_writers_cluster(start_gateway, tmp_path):
    from redis_cluster import RedisCluster
    cluster = RedisCluster(str(tmp_path / "cluster"), primaries=3, replicas=0)
    cluster.start()
    try:
        gw = start_gateway(card_dirs=[cluster.url], fragment_size=FRAG, thread_pool_size=8)
        _check_race(gw.port, make_keys(512, namespace="race-cluster"))
    finally:
        cluster.stop()
