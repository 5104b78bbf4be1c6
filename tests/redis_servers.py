"""Real redis-server processes on 127.0.0.1 with random ports, for the resp card tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from adpkv_gateway.cards.resp_conn import RespConnection
from adpkv_gateway.spawn import free_port

REDIS = shutil.which("redis-server")


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
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
