"""The gate in front of every copy to or from a rank's KV tensors (vLLM >= 0.33 sleep mode).

vLLM's sleep mode releases the KV cache's device memory (``unregister_kv_caches`` right
before, ``restore_kv_caches`` after the wake-up, when the memory is back, possibly at other
addresses). The connector's copies between the ring and the KV blocks run on the client's
I/O thread, whenever the gateway hands a batch, outside vLLM's step, so vLLM draining its
own work does not cover them: a copy after the release would read or write memory that is
gone (or, after the wake-up, store the new memory's bytes under an old chunk's key).

Contract: a request takes a ``ticket`` when it starts (its copies use the KV views of that
moment) and every copy of it runs through ``KVGate.run(ticket, copy)``. ``close`` waits for
the copies running now and keeps every later one out (``run`` returns False: the batch
counts as a miss / not stored, the client's rule for a batch that was not copied), for good
for the requests started before it (their views may be stale after the wake-up); ``open``
lets in the copies of requests started after it.
"""

from __future__ import annotations

import threading
from typing import Callable


class KVGate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._inside = 0
        self._closed = False
        self._epoch = 0             # +1 at every close: tickets of before are void

    @property
    def closed(self) -> bool:
        return self._closed

    def ticket(self) -> int:
        """What a request starting now passes to ``run`` with each of its copies."""
        return self._epoch

    def run(self, ticket: int, copy: Callable[[], object]) -> bool:
        """Run ``copy`` unless the gate is closed or was closed since ``ticket`` was taken;
        False when it did not run (or it returned False)."""
        with self._cv:
            if self._closed or ticket != self._epoch:
                return False
            self._inside += 1
        try:
            return copy() is not False
        finally:
            with self._cv:
                self._inside -= 1
                self._cv.notify_all()

    def close(self) -> None:
        """Keep copies out from now on; returns once none is running."""
        with self._cv:
            if not self._closed:
                self._closed = True
                self._epoch += 1
            self._cv.wait_for(lambda: self._inside == 0)

    def open(self) -> None:
        with self._cv:
            self._closed = False
