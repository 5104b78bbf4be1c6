"""The control loop's handoff: work that may block runs on a pool (threads, or the I/O
processes), and its result comes back to the loop's thread, where every state of the gateway
lives. ``RunOnPool`` is the contract the loop (``loop.server.Gateway._run``) implements and the
data path calls: ``run(executor, work, then, fail)`` returns at once; later, on the loop,
exactly one of ``then(work())`` or ``fail(exception)``."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class RunOnPool(Protocol):
    def __call__(self, executor: Executor, work: Callable[[], T], then: Callable[[T], None],
                 fail: Callable[[BaseException], None]) -> None: ...
