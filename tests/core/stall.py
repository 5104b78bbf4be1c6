"""A real gateway process held at chosen system calls (strace's fault injection): each call's
entry waits ``seconds``. Makes a window deterministic (a gateway stalled right before its write
into a region) or a card slow (every read of an object file waits, as on a slow disk), with no
change to the gateway."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time

import pytest


class Stall:
    """strace on every thread of process ``pid``, holding each of ``calls`` (strace's
    comma-separated names, e.g. ``"pwrite64,pwritev"``) at its entry for ``seconds``.
    ``until(text)`` waits for a line of strace's output; ``stop()`` lets the process run free."""

    def __init__(self, pid: int, seconds: float, calls: str):
        if shutil.which("strace") is None:
            pytest.fail("this test needs strace (apt-get install -y strace) to stall the gateway at a system call")
        self.proc = subprocess.Popen(["strace", "-f", "-p", str(pid), "-e", f"trace={calls}",
                                      "-e", f"inject={calls}:delay_enter={int(seconds * 1e6)}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._buf = b""
        if not self.until(f"Process {pid} attached", 20):
            self.stop()
            pytest.fail("strace could not attach to the gateway (it needs ptrace: CAP_SYS_PTRACE)")

    def until(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        fd = self.proc.stderr.fileno()
        while True:
            *lines, self._buf = self._buf.split(b"\n")
            for i, line in enumerate(lines):
                if text.encode() in line:
                    self._buf = b"\n".join(lines[i + 1:] + [self._buf])
                    return True
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            chunk = os.read(fd, 65536)
            if not chunk:
                return False
            self._buf += chunk

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
