"""Start and stop a gateway as a child process (for the demo, the bench and tests)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

from adpkv_core.wire.door import door_path, lock_path

from adpkv_gateway.ops.control import wait_until_up


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """``python -m adpkv_gateway.loop.main`` with the given settings; its log goes to ``log_path``."""

    def __init__(self, card_dirs, port: Optional[int] = None, log_path: Optional[str] = None,
                 **settings):
        self.card_dirs = [card_dirs] if isinstance(card_dirs, str) else list(card_dirs)
        self.port = port or free_port()
        self.settings = dict(settings)
        self.log_path = log_path or os.path.join(self.card_dirs[0] + ".gateway.log")
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "adpkv_gateway.loop.main", "--port", str(self.port),
               "--storage-devices", *self.card_dirs]
        for name, value in self.settings.items():
            if isinstance(value, bool):
                value = int(value)
            cmd += ["--" + name.replace("_", "-"), str(value)]
        return cmd

    def start(self, wait: bool = True, timeout_s: float = 30.0) -> "GatewayProcess":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        if wait and not self._wait_until_up(timeout_s):
            code = self.proc.poll()
            self.kill()
            raise RuntimeError(f"gateway on port {self.port} did not come up (exit code {code}); "
                               f"log:\n{self.log()}")
        return self

    def _wait_until_up(self, timeout_s: float) -> bool:
        """PING until the gateway answers; False at the deadline or as soon as it exited."""
        proc = self.proc
        if proc is None:                   # not started, or stopped: it will not come up
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if wait_until_up(self.port, 0.5, door=self.settings.get("control_socket") or None):
                return True
        return False

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait: a graceful stop."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        finally:
            self.proc = None
        self._remove_leftovers()
        return code

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """A gateway leaves its lock file beside its door (and, when killed, its door: the next
        gateway on the port reclaims both); once it has exited, this tool removes them so test
        runs do not leave them behind. The door directory stays (it is its user's)."""
        door = self.settings.get("control_socket") or door_path(self.port, os.geteuid())
        for path in (door, lock_path(door)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def restart(self, hard: bool = False) -> "GatewayProcess":
        self.kill() if hard else self.stop()
        return self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        if self.alive():
            self.stop()
        time.sleep(0)


REDIS = shutil.which("redis-server")  # for the resp card's tests and benchmarks


class RedisServer:
    """One redis-server with RDB persistence in its own directory (saved on SIGTERM)."""

    def __init__(self, directory: str, port: int | None = None, maxmemory: int = 0):
        self.dir = directory
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        os.makedirs(directory, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisServer":
        from adpkv_gateway.cards.resp.conn import RespConnection
        if REDIS is None:
            raise RuntimeError("redis-server is not installed (not on PATH)")
        args = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--dbfilename", "dump.rdb", "--save", "3600 1", "--appendonly", "no",
                "--protected-mode", "no", "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log")]
        if self.maxmemory:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                c = RespConnection(self.url, 0.5)
                c.command(b"PING")
                c.close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not start")

    def stop(self) -> None:
        """SIGTERM: redis saves its data (RDB) and exits."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None

    def pause(self) -> None:
        self._running().send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._running().send_signal(signal.SIGCONT)

    def _running(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"redis-server on {self.port} is not running")
        return self.proc

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
