"""Fixtures shared by the areas of tests/core: a world-traversable directory (``open_dir``),
root's engine on a gateway whose door every user may open (``root_engine``), a real Redis
Cluster (``redis_cluster``) and a /dev/shm buffer mapped in this process (``shm_buffer``).
Helpers shared as code: ``rankproc`` (engine ranks), ``fs_cards`` (large fs cards built
fast), ``adversary`` (an unprivileged child and its requests)."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import uuid

import pytest

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig

from .adversary import OBJ, ring_fill
from .rankproc import make_keys


@pytest.fixture
def open_dir():
    """A directory every user may traverse (tmp_path is root-only, which would hide the
    card's own permissions from the test)."""
    path = tempfile.mkdtemp(prefix="adpkv-sec-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root_engine(start_gateway, open_dir):
    """A gateway as root with a world-usable door (mode 0666: every local user may attach an
    engine of its own) on a card in a world-traversable directory, and root's engine
    attached, with stored objects."""
    gw = start_gateway(card_dirs=[os.path.join(open_dir, "card")], control_socket_mode="0666")
    keys = make_keys(4, namespace="root-tenant")
    rank = GatewayClient(ClientConfig(port=gw.port), "root-engine-7f3a")
    assert rank.enabled
    assert rank.put(keys, OBJ, ring_fill(rank, keys)).result(10).stored == [True] * 4
    yield gw, rank, keys
    rank.close()


@pytest.fixture
def redis_cluster(tmp_path):
    """Factory: ``redis_cluster()`` starts a real cluster (stopped at the end of the test)."""
    from redis_cluster import RedisCluster
    started = []

    def start(**kw):
        c = RedisCluster(str(tmp_path / f"cluster{len(started)}"), **kw)
        started.append(c)
        return c.start()

    yield start
    for c in started:
        c.stop()


def _shm_region(size: int, views_may_remain: bool = False):
    """A /dev/shm file of ``size`` bytes mapped shared in this process: ``(path, mapping)``,
    removed at the end. ``views_may_remain``: a test's arrays may still view the mapping then
    (it goes with them); else closing it must succeed."""
    path = f"/dev/shm/adpkv-test-region-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
    os.close(fd)
    yield path, mm
    try:
        mm.close()
    except BufferError:
        if not views_may_remain:
            raise
    os.unlink(path)


@pytest.fixture
def shm_buffer():
    """A /dev/shm file mapped shared in this process, like LMCache's L1 pool (removed at the end)."""
    yield from _shm_region(8 << 20)


@pytest.fixture
def big_region():
    """A 64 MiB /dev/shm region for the region store races (tests/core/regions)."""
    yield from _shm_region(64 << 20, views_may_remain=True)
