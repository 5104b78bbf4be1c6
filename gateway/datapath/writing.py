"""The keys whose card writes are in flight, and the lookups that wait for them.

A PUT batch in its WRITE stage holds objects whose bytes are in the gateway's ring (or an
engine's region) and whose card writes are queued or running. The engine that stored them
may already have let its blocks go (it waits for its copy into the ring, not for the card),
so the same prompt can come back before its objects are on a card. A GET's lookup stage
that names such a key waits for those writes, then reads what they stored (a restore planned
on objects found before, whose other layers are still being written, would otherwise miss);
a lookup of keys nobody is writing runs at once, never behind other prompts' writes (on an
H200 a prompt's lookup queued behind earlier prompts' writes waited 0.3-0.9 s). An EXIST never
waits here: the engine's scheduler waits for its answer, and on the H200 an EXIST held by a
prompt's own writes (behind a full card's evictions) stalled every request of the engine for
4.1 s; what it finds missing is recomputed, which was faster there every time.

Contract: ``begin(batch, keys)`` when a batch's writes start and ``end(batch, keys)`` (the
same batch id and keys, a key possibly named more than once) when they are all done, ok or
not; ``after(keys, then)`` calls ``then()`` once every batch writing one of ``keys`` at the
time of the call has ended (at once when none is): later writes of the same keys never hold
it. All on the gateway loop's thread.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence


class _Waiter:
    """One lookup waiting: the batches it still waits for, and what to run after them."""

    __slots__ = ("batches", "then")

    def __init__(self, batches: set[int], then: Callable[[], None]):
        self.batches = batches
        self.then = then


class Writing:
    """The batches writing each key now, and the lookups waiting for them."""

    def __init__(self) -> None:
        self._writers: dict[bytes, set[int]] = {}       # key -> ids of the batches writing it now
        self._waiting: dict[int, list[_Waiter]] = {}    # batch id -> lookups waiting for it

    def begin(self, batch: int, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._writers.setdefault(k, set()).add(batch)

    def end(self, batch: int, keys: Iterable[bytes]) -> None:
        for k in keys:
            writers = self._writers.get(k)
            if writers is None:
                continue                      # a key named twice in the batch: done already
            writers.discard(batch)
            if not writers:
                del self._writers[k]
        for waiter in self._waiting.pop(batch, ()):
            waiter.batches.discard(batch)
            if not waiter.batches:
                waiter.then()

    def after(self, keys: Sequence[bytes], then: Callable[[], None]) -> None:
        batches: set[int] = set()
        for k in keys:
            writers = self._writers.get(k)
            if writers:
                batches |= writers
        if not batches:
            then()
            return
        waiter = _Waiter(batches, then)
        for b in batches:
            self._waiting.setdefault(b, []).append(waiter)
