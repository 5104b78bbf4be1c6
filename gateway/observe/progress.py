"""Progress of long work (index rebuild at start, clean, bench): a bar on a terminal, plain
lines in a log.

``track(what, total, unit)`` opens one piece of work; ``advance(n)`` counts what is done
(cheap: an add and a clock read, next to the file operation each counts); ``note(what)``
says what it is doing now. Where it goes:

- ``stream`` is a terminal: one bar redrawn in place (at most ``REDRAW_S`` apart), ended by
  a newline;
- otherwise plain lines to ``log`` (a logger; without one, to ``stream``): the first once the
  work has run ``first_line_s`` (short work says nothing), then every ``every_s``, and a
  last line when it ends if any was written.

Work in progress is also listed by ``running()`` (this process's), which STATS reports
as ``work`` so that ``adpkv clean`` can draw the gateway's progress on the operator's terminal.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Optional, TextIO

REDRAW_S = 0.1
BAR_WIDTH = 30

_running: list["Progress"] = []
_running_lock = threading.Lock()


def running() -> list[dict]:
    """What this process is doing now: ``{"what", "done", "total", "unit", "elapsed_s"}`` each."""
    with _running_lock:
        return [p.figures() for p in _running]


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """One piece of long work; see the module."""

    def __init__(self, what: str, total: int, unit: str = "", *, stream: Optional[TextIO] = None,
                 log: Optional[logging.Logger] = None, first_line_s: float = 2.0, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.what = what
        self.total = max(0, int(total))
        self.unit = unit
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.log = log
        self.bar = is_terminal(self.stream)
        self.first_line_s = first_line_s
        self.every_s = every_s
        self.clock = clock
        self.started = clock()
        self._next = self.started + (REDRAW_S if self.bar else first_line_s)
        self._lines = 0                     # lines written, or bar frames drawn
        self._closed = False
        with _running_lock:
            _running.append(self)

    # ------------------------------------------------------------ counting
    def advance(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now >= self._next:
            self._show(now)

    def set(self, done: int) -> None:
        """The count done so far (work whose progress is read elsewhere, e.g. the gateway's)."""
        self.advance(done - self.done)

    def note(self, what: str) -> None:
        """What the work is doing now (a terminal shows it at once)."""
        self.what = what
        if self.bar:
            self._show(self.clock())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _running_lock:
            if self in _running:
                _running.remove(self)
        elapsed = self.clock() - self.started
        if self.bar and (self.done or self._lines):     # nothing to do (an empty card): nothing drawn
            self._write("\r\033[K" + self._text(elapsed) + "\n")
        elif self._lines:
            self._line(f"{self.what}: done, {self.done} {self.unit} in {elapsed:.1f} s".replace("  ", " "))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def figures(self) -> dict:
        return {"what": self.what, "done": self.done, "total": self.total, "unit": self.unit,
                "elapsed_s": round(self.clock() - self.started, 3)}

    # ------------------------------------------------------------ output
    def _text(self, elapsed: float) -> str:
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * BAR_WIDTH)
            return (f"{self.what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {frac * 100:5.1f}% "
                    f"{self.done}/{self.total} {self.unit} {elapsed:.1f} s")
        return f"{self.what} {self.done} {self.unit} {elapsed:.1f} s"

    def _show(self, now: float) -> None:
        elapsed = now - self.started
        if self.bar:
            self._write("\r\033[K" + self._text(elapsed))
            self._next = now + REDRAW_S
            self._lines += 1
            return
        pct = f" ({100.0 * self.done / self.total:.0f}%)" if self.total else ""
        of = f"/{self.total}" if self.total else ""
        self._line(f"{self.what}: {self.done}{of} {self.unit}{pct}, {elapsed:.1f} s".replace("  ", " "))
        self._lines += 1
        self._next = now + self.every_s

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def _line(self, text: str) -> None:
        if self.log is not None:
            self.log.info("%s", text)
        else:
            self._write(text + "\n")


def track(what: str, total: int, unit: str = "", **kw) -> Progress:
    """``Progress(what, total, unit, ...)``: use it as a context manager."""
    return Progress(what, total, unit, **kw)
