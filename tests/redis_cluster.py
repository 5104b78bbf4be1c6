"""A real Redis Cluster on 127.0.0.1 from ``redis-server`` processes, for the cluster card's
tests and benchmark: ``redis-server --cluster-enabled yes`` nodes joined with
``redis-cli --cluster create ... --cluster-replicas N --cluster-yes``; nodes can be
killed (``kill -9``), added and slots moved to them (``redis-cli --cluster add-node``,
``rebalance --cluster-use-empty-masters``). Every wait polls with a deadline."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Callable, Optional

from adpkv_gateway.cards.resp.conn import RespConnection, RespError

REDIS = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _free_cluster_port() -> int:
    """A port that is free on 127.0.0.1 with its cluster bus port (port + 10000) free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def poll(pred: Callable[[], object], timeout: float, interval: float = 0.05, what: str = ""):
    """``pred()`` until it is truthy (returned) or ``timeout`` s passed (RuntimeError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what or pred}")
        time.sleep(interval)


class ClusterNode:
    """One ``redis-server --cluster-enabled yes`` in its own directory."""

    def __init__(self, directory: str, node_timeout_ms: int):
        self.dir = directory
        self.port = _free_cluster_port()
        self.node_timeout_ms = node_timeout_ms
        self.proc: Optional[subprocess.Popen] = None
        os.makedirs(directory, exist_ok=True)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ClusterNode":
        args = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no",      # a dead primary costs only its slots
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                "--logfile", os.path.join(self.dir, "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        poll(lambda: self.command(b"PING") == b"PONG", 10, what=f"redis-server on {self.port}")
        return self

    def command(self, *args: bytes, timeout: float = 1.0):
        """One command on this node; None when it does not answer."""
        try:
            c = RespConnection(f"redis://127.0.0.1:{self.port}", timeout)
        except OSError:
            return None
        try:
            return c.command(*args)
        except (OSError, RespError):
            return None
        finally:
            c.close()

    def info(self, section: bytes) -> dict:
        text = self.command(b"INFO", section) if section != b"cluster" else self.command(b"CLUSTER", b"INFO")
        if not text:
            return {}
        return dict(line.split(":", 1) for line in text.decode().splitlines() if ":" in line)

    def node_id(self) -> str:
        return (self.command(b"CLUSTER", b"MYID") or b"").decode()

    def role(self) -> str:
        return self.info(b"replication").get("role", "").strip()

    def dbsize(self) -> int:
        return int(self.command(b"DBSIZE") or 0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the node dies at once, with whatever it had not replicated."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None


class RedisCluster:
    """``primaries`` primaries with ``replicas`` replicas each, created by redis-cli."""

    def __init__(self, directory: str, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        if REDIS is None or REDIS_CLI is None:
            raise RuntimeError("redis-server / redis-cli are not installed "
                               "(apt-get install -y redis-server; tools/test.sh does it)")
        self.dir = directory
        self.node_timeout_ms = node_timeout_ms
        self.n_primaries, self.n_replicas = primaries, replicas
        self.nodes: list[ClusterNode] = []

    @property
    def url(self) -> str:
        """The cluster card's device URL (seed nodes: the first three)."""
        return "redis+cluster://" + ",".join(n.addr for n in self.nodes[:3])

    def _new_node(self) -> ClusterNode:
        node = ClusterNode(os.path.join(self.dir, f"node{len(self.nodes)}"), self.node_timeout_ms)
        self.nodes.append(node)
        return node.start()

    def cli(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run([REDIS_CLI, "--cluster", *args], capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def start(self) -> "RedisCluster":
        for _ in range(self.n_primaries * (1 + self.n_replicas)):
            self._new_node()
        if self.n_primaries >= 3:
            self.cli("create", *[n.addr for n in self.nodes], "--cluster-replicas", str(self.n_replicas),
                     "--cluster-yes")
        else:                 # redis-cli creates 3 primaries at least: slots and MEET by hand
            if self.n_replicas:
                raise ValueError("fewer than 3 primaries: replicas are not supported by this helper")
            step = 16384 // self.n_primaries
            for i, n in enumerate(self.nodes):
                end = 16383 if i == self.n_primaries - 1 else (i + 1) * step - 1
                assert n.command(b"CLUSTER", b"ADDSLOTSRANGE", b"%d" % (i * step), b"%d" % end) == b"OK"
                if i:
                    n.command(b"CLUSTER", b"MEET", b"127.0.0.1", b"%d" % self.nodes[0].port)
            poll(lambda: all(n.info(b"cluster").get("cluster_known_nodes", "").strip() == str(len(self.nodes))
                             for n in self.nodes), 30, interval=0.1, what="nodes meeting")
        self.wait_ok(30)
        poll(self.replicas_in_sync, 30, what="replicas linked to their primaries")
        return self

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive()]

    def primaries(self) -> list[ClusterNode]:
        return [n for n in self.live() if n.role() == "master"]

    def replicas(self) -> list[ClusterNode]:
        return [n for n in self.live() if n.role() == "slave"]

    def ok(self) -> bool:
        """Every live node says cluster_state ok with all slots served and its node list is
        free of failed nodes that still hold slots."""
        for n in self.live():
            info = n.info(b"cluster")
            if info.get("cluster_state", "").strip() != "ok" or info.get("cluster_slots_ok", "").strip() != "16384":
                return False
        return True

    def wait_ok(self, timeout: float) -> None:
        poll(self.ok, timeout, interval=0.1, what="cluster_state ok on every node")

    def replicas_in_sync(self) -> bool:
        reps = self.replicas()
        return len(reps) >= self.n_primaries * self.n_replicas and all(
            r.info(b"replication").get("master_link_status", "").strip() == "up" for r in reps)

    def replica_of(self, primary: ClusterNode) -> list[ClusterNode]:
        return [n for n in self.replicas()
                if n.info(b"replication").get("master_port", "").strip() == str(primary.port)]

    def add_primary_and_rebalance(self) -> ClusterNode:
        """A new empty node joins as a primary; ``rebalance --cluster-use-empty-masters``
        moves its share of the slots (with their keys, by MIGRATE) to it, live."""
        node = self._new_node()
        seed = self.primaries()[0].addr
        self.cli("add-node", node.addr, seed)
        poll(lambda: all(node.node_id() in (n.command(b"CLUSTER", b"NODES") or b"").decode()
                         for n in self.live()), 30, interval=0.1, what="the new node known to every node")
        poll(self.ok, 30, interval=0.1, what="cluster ok after add-node")
        self.cli("rebalance", seed, "--cluster-use-empty-masters", "--cluster-pipeline", "10", timeout=300)
        return node

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()
