"""KV events of ``AdpSecondaryTier``: stored events for the rows it stored, removed events
for rows it announced and later found gone, and the sweep that looks for those.

Contract (``TierEvents``, one per tier; with events off every call does nothing):

- ``announce(keys)``: the gateway holds these rows now (after a store, also when it held
  them already): one stored event, and each key remembered (at most ``MAX_ANNOUNCED``,
  oldest forgotten first) with the number of its last stored event.
- ``forget(keys, seen=None)``: these rows were found missing while the gateway answered (a
  lookup or a load that missed, or the sweep): one removed event for the ones announced, and
  ``count_removed(n)``. ``seen``: the stored-event number each key had when it was looked
  for; a key announced again since is kept.
- ``sweep(session)`` (the scheduler's thread, between steps): every ``sweep_s`` one pass over
  all announced rows, one EXIST of ``SWEEP_KEYS`` keys at a time, spread evenly over the
  interval, never two in flight; missing rows are forgotten on the client's thread.
- ``take()``: the events not yet handed to vLLM, oldest first.

``announce`` and ``forget`` may run on any thread (the key book has its lock); events are
appended to a deque that ``take`` drains.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from typing import Callable, Optional

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from adpkv_core.attachment import Session

MAX_ANNOUNCED = 1 << 20    # stored keys remembered for removed events
SWEEP_KEYS = 4096          # announced keys checked by one EXIST of the events sweep


class TierEvents:
    """The KV events of one tier (``enabled``: vLLM's KV events on and the tier's own setting)."""

    def __init__(self, enabled: bool, medium: Medium, locality: Optional[Locality], sweep_s: float,
                 storage_key: Callable[[OffloadKey], bytes], count_removed: Callable[[int], None]):
        self.medium = medium
        self.locality = locality
        self._storage_key = storage_key
        self._count_removed = count_removed
        self._events: Optional[collections.deque] = collections.deque() if enabled else None
        # announced (stored) keys -> the number of their last stored event (a sweep forgets
        # a key only if no stored event came after it looked)
        self._announced: "collections.OrderedDict[bytes, int]" = collections.OrderedDict()
        self._announced_lock = threading.Lock()
        self._announces = 0
        self.sweep_s = max(0.0, float(sweep_s))
        self._sweep_todo: list[tuple[bytes, int]] = []
        self._sweep_next = time.monotonic() + self.sweep_s
        self._sweep_gap = self._sweep_chunk_at = 0.0       # the pass in progress: one EXIST per gap
        self._sweep_busy = False

    def announce(self, keys: list[OffloadKey]) -> None:
        if self._events is None or not keys:
            return
        with self._announced_lock:
            for k in keys:
                self._announces += 1
                self._announced[bytes(k)] = self._announces
                self._announced.move_to_end(bytes(k))
            while len(self._announced) > MAX_ANNOUNCED:
                self._announced.popitem(last=False)
        self._events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=False,
                                            locality=self.locality))

    def forget(self, keys: list[OffloadKey], seen: Optional[list[int]] = None) -> None:
        """Removed events for announced keys found missing (``seen``: the stored-event number
        each had when it was looked for; a key stored again since is kept)."""
        if self._events is None or not keys:
            return
        gone = []
        with self._announced_lock:
            for i, k in enumerate(keys):
                number = self._announced.get(bytes(k))
                if number is not None and (seen is None or seen[i] == number):
                    del self._announced[bytes(k)]
                    gone.append(k)
        if gone:
            self._count_removed(len(gone))
            self._events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True,
                                                locality=self.locality))

    def sweep(self, s: Optional[Session]) -> None:
        """(scheduler thread) Send the next EXIST of the events sweep, if one is due and none
        is in flight: every ``sweep_s`` one pass over all announced rows, ``SWEEP_KEYS``
        at a time, spread over the interval. Rows the gateway no longer holds become removed
        events (on the client's thread)."""
        if self._events is None or not self.sweep_s or self._sweep_busy or s is None or not s.enabled:
            return
        now = time.monotonic()
        if not self._sweep_todo:
            if now < self._sweep_next:
                return
            self._sweep_next = now + self.sweep_s
            with self._announced_lock:
                self._sweep_todo = list(self._announced.items())
            if not self._sweep_todo:
                return
            # one pass per sweep_s, its EXISTs spread evenly over it (1M rows, 60 s:
            # 17k keys a second), not all at once
            self._sweep_gap = self.sweep_s / -(-len(self._sweep_todo) // SWEEP_KEYS)
            self._sweep_chunk_at = now
        if now < self._sweep_chunk_at:
            return
        self._sweep_chunk_at += self._sweep_gap
        chunk = self._sweep_todo[-SWEEP_KEYS:]
        del self._sweep_todo[-SWEEP_KEYS:]
        self._sweep_busy = True
        client = s.client

        def answered(fut) -> None:
            try:
                flags = fut.result()
                if client.enabled and len(flags) == len(chunk):
                    missing = [(k, n) for (k, n), hit in zip(chunk, flags) if not hit]
                    self.forget([OffloadKey(k) for k, _ in missing], [n for _, n in missing])
            finally:
                self._sweep_busy = False

        client.exist([self._storage_key(OffloadKey(k)) for k, _ in chunk]).add_done_callback(answered)

    def take(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return
        while self._events:
            yield self._events.popleft()
