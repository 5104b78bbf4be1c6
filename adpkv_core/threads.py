"""The threads adpkv starts in an engine's process, and what each runs before its work.

An engine adapter registers what its libraries need set up per thread (``at_start``); every
thread adpkv_core starts there (a client link's I/O thread, which runs the ring batches'
copies; an attachment's watcher; the direct maps' thread) runs those set-ups first
(``set_up``), once, before anything else. The vLLM adapter registers one OpenMP thread for
torch's CPU ops (``adpkv_vllm.common.copy.one_openmp_thread``: a team of our own would slow a
CPU engine's forward pass).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger("adpkv.client")

_SETUPS: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def at_start(setup: Callable[[], None]) -> None:
    """Have every adpkv thread started from now on run ``setup`` first (once per setup)."""
    with _LOCK:
        if setup not in _SETUPS:
            _SETUPS.append(setup)


def set_up() -> None:
    """Run the registered set-ups on the calling thread (an adpkv thread, as it starts). A
    set-up that raises is logged and skipped: the thread's work goes on without it."""
    with _LOCK:
        setups = list(_SETUPS)
    for setup in setups:
        try:
            setup()
        except Exception:
            logger.exception("adpkv: a thread set-up failed (%s)", getattr(setup, "__qualname__", setup))
