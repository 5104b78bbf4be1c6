"""Shared fixtures: real gateway processes on temporary fs cards."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest

from adpkv_gateway.ops.spawn import GatewayProcess


@pytest.fixture
def start_gateway(tmp_path):
    """Factory: ``start_gateway(**settings)`` starts a real gateway process on a fresh card.

    Pass ``card_dirs=[...]`` to reuse cards; every gateway started is stopped at
    the end of the test (its log is printed on failure by pytest's capture).
    """
    started: list[GatewayProcess] = []

    def start(card_dirs=None, **settings):
        dirs = card_dirs or [str(tmp_path / f"card{len(started)}")]
        settings.setdefault("shared_memory_size", 64 << 20)
        gw = GatewayProcess(dirs, log_path=str(tmp_path / f"gateway{len(started)}.log"), **settings)
        gw.start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        if gw.alive():
            gw.stop()
        print(f"--- gateway log {gw.log_path} ---\n{gw.log()[-4000:]}")


@pytest.fixture
def gateway(start_gateway):
    """One running gateway on a fresh fs card."""
    return start_gateway()


def pytest_configure(config):
    os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture
def redis_servers(tmp_path):
    """Factory: ``redis_servers(n)`` starts n real redis-server processes (stopped at the end)."""
    from redis_servers import REDIS, RedisServer
    if REDIS is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server; tools/test.sh does it)")
    started: list[RedisServer] = []

    def start(n, **kw):
        servers = [RedisServer(str(tmp_path / f"redis{len(started) + i}"), **kw).start() for i in range(n)]
        started.extend(servers)
        return servers

    yield start
    for s in started:
        if s.proc is not None:
            s.resume() if s.proc.poll() is None else None
            s.kill()
