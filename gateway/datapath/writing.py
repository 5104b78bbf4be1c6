"""The keys whose card writes are in flight, and the lookups that wait for them.

A PUT batch in its WRITE stage holds objects whose bytes are in the gateway's ring (or an
engine's region) and whose card writes are queued or running. The engine that stored them
may already have let its blocks go (it waits for its copy into the ring, not for the card),
so the same prompt can come back before its objects are on a card. A lookup (EXIST, or a
GET's lookup stage) that names such a key waits for those writes, then finds what they
stored; a lookup of keys nobody is writing runs at once, never behind other prompts' writes
(on an H200 a prompt's lookup queued behind earlier prompts' writes waited 0.3-0.9 s; one
answered before its own writes landed found half of a 32k prompt).

Contract: ``begin(keys)`` when a batch's writes start and ``end(keys)`` (the same keys) when
they are all done, ok or not; ``after(keys, then)`` calls ``then()`` once no key of ``keys``
is being written (at once when none is). All on the gateway loop's thread.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence


class _Waiter:
    """One lookup waiting: the keys still being written, and what to run after them."""

    __slots__ = ("keys", "then")

    def __init__(self, keys: set[bytes], then: Callable[[], None]):
        self.keys = keys
        self.then = then


class Writing:
    """The keys being written now (how many batches write each), and the lookups waiting."""

    def __init__(self) -> None:
        self._batches: dict[bytes, int] = {}             # key -> batches writing it now
        self._waiting: dict[bytes, list[_Waiter]] = {}   # key -> lookups waiting for its writes

    def begin(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._batches[k] = self._batches.get(k, 0) + 1

    def end(self, keys: Iterable[bytes]) -> None:
        ready = []
        for k in keys:
            n = self._batches[k] - 1
            if n:
                self._batches[k] = n
                continue
            del self._batches[k]
            for waiter in self._waiting.pop(k, ()):
                waiter.keys.discard(k)
                if not waiter.keys:
                    ready.append(waiter)
        for waiter in ready:
            waiter.then()

    def after(self, keys: Sequence[bytes], then: Callable[[], None]) -> None:
        busy = {k for k in keys if k in self._batches}
        if not busy:
            then()
            return
        waiter = _Waiter(busy, then)
        for k in busy:
            self._waiting.setdefault(k, []).append(waiter)
