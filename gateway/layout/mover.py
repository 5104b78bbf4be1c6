"""The mover: during a card-set change, moves objects from the previous layout's cards to
their cards in the current one, in a thread of its own at a bounded rate.

Where the work comes from:

- hits: a lookup that missed in the current placement and hit in the previous one
  (``CardPlacement.on_previous_hit``) is moved ``MOVE_AFTER_S`` after it was served (the read
  that found it is done by then);
- the sweep: the mover lists the objects of every previous card (``Card.listed_heads``: fs,
  its index and each head's header; resp, a SCAN; a cluster card, a SCAN of each primary)
  with the slot tag each head records (``cards.objfmt``: with ``dialog`` placement the dialog
  mark, so the tag gives the slot as the PUT's mark did; with ``stripe`` the key alone) and
  moves those whose card changed.

An object whose head records no tag (written by a gateway before tags were recorded) cannot
be placed with ``dialog`` placement: its slot is one of those its card owned in the previous
layout, so the sweep copies it, whole, to every card that owns one of those slots now (and
removes it from its card only when that card owns none of them any more): whichever its slot
is, a lookup finds it, and the copies on the other cards are never read and age out (evicted
as the least recently used). A cluster card keys fragments by their tag, so such an object is
neither copied to nor from one: it stays where it is (``unplaceable_objects``), moved only
when a lookup reads it during the change.

One move, and why it loses nothing acknowledged: the object is read whole from its old card
(every fragment checked, as any read), written whole to its new cards (head last), read back
from them and compared byte for byte, and only then removed from the old card (never while
an engine holds it pinned). A crash at any point leaves the old copy, the new one, or both:
the next gateway finds it either way (a lookup falls back; the sweep removes an old copy whose
new one is whole). Two gateways moving the same object write the same bytes.

When a sweep pass finds nothing left to move and no hit waits, the change is complete:
``on_complete`` drops the previous layout (once). Contract: ``store`` is the gateway's
``ObjectStore`` with ``placement.previous`` set; the mover lists a card's heads itself
(``Card.listed_heads``) and does every other card command through the store's accounted I/O
(``CardIO.recorded_head``, ``read``, ``write_replicas``, ``remove_write``: the old copy is removed
only while it is still the write it copied, issue 40), and reads which cards are in service
there (``CardService.in_service``)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Iterable, Optional

from prometheus_client.core import GaugeMetricFamily, Metric

from adpkv_core.wire.protocol import GatewayStats

from adpkv_gateway.observe import metrics
from adpkv_gateway.cards.base import CardIOError, Head, KeysByTag, Read
from adpkv_gateway.observe.status import PREFIX
from adpkv_gateway.store.object_store import ObjectStore
from adpkv_gateway.store.placement import PreviousPlacement

logger = logging.getLogger("adpkv.gateway.mover")

MOVE_AFTER_S = 1.0            # a hit moves this long after it was served
YIELD_S = 0.005               # while the engine's requests are in flight the mover looks again after this
YIELD_AT_MOST_S = 0.25        # ... and moves one object after this long anyway (a busy engine never stops it)
MAX_WAITING = 1 << 18         # hits remembered at most (more: the sweep, or the next read, finds them)
RETRY_S = 5.0                 # a sweep pass that could not move everything runs again after this


class Mover:
    """Moves the objects of ``store.placement.previous`` to their current cards (see the module)."""

    def __init__(self, store: ObjectStore, previous_fingerprint: str, rate_bytes: int,
                 on_complete: Callable[[], None]):
        self.store = store
        self.engine_busy: Callable[[], bool] = lambda: False      # the engine has requests in flight
        self.previous_fingerprint = previous_fingerprint
        self.rate_bytes = rate_bytes
        self.on_complete = on_complete
        self.moved_objects = 0
        self.moved_bytes = 0
        self.left_objects = 0          # found by the running sweep pass, not moved yet (+ waiting hits)
        self.failed = 0                # moves that could not be done (a card failed): tried again
        self.copied_objects = 0        # copies of objects without a recorded tag (see the module)
        self.unplaceable_objects = 0   # such objects the last sweep pass left where they are (cluster cards)
        self.complete = False
        self._unlisted: set[int] = set()   # cards whose listing failed (warned once)
        self._waiting: "collections.OrderedDict[bytes, tuple[int, int, float]]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="adpkv-mover", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def hit(self, key: bytes, mark: int, card: int) -> None:
        """A lookup found ``key`` on ``card`` of the previous placement (any thread)."""
        with self._lock:
            if key not in self._waiting and len(self._waiting) < MAX_WAITING:
                self._waiting[key] = (mark, card, time.monotonic() + MOVE_AFTER_S)

    def figures(self) -> dict:
        """What STATS and the status file show of the change."""
        elapsed = max(1e-9, time.monotonic() - self._started)
        return {"previous_fingerprint": self.previous_fingerprint, "complete": self.complete,
                "moved_objects": self.moved_objects, "moved_bytes": self.moved_bytes,
                "left_objects": self.left_objects + len(self._waiting), "failed": self.failed,
                "copied_objects": self.copied_objects, "unplaceable_objects": self.unplaceable_objects,
                "rate_bytes_per_s": self.moved_bytes / elapsed, "rate_limit_bytes_per_s": self.rate_bytes}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._move_waiting():
                    continue
                clean = self._sweep_pass()
                if clean and not self._waiting and not self._stop.is_set():
                    self._finish()
                    return
                self._wake.wait(RETRY_S)
                self._wake.clear()
        except Exception:                  # the mover must never take the gateway down
            logger.exception("the mover stopped")

    def _finish(self) -> None:
        """Nothing is left: the previous layout is dropped (``on_complete``: the cards' records
        rewritten) before STATS says ``complete``."""
        self.left_objects = 0
        self.on_complete()
        self.complete = True

    def _move_waiting(self) -> bool:
        """Move the hits that are due; whether any was."""
        now = time.monotonic()
        with self._lock:
            due: list[tuple[bytes, int, int]] = []
            while self._waiting and len(due) < 64:
                key, (mark, card, at) = next(iter(self._waiting.items()))
                if at > now:
                    break
                self._waiting.popitem(last=False)
                due.append((key, mark, card))
        for key, mark, card in due:
            if self._stop.is_set():
                break
            self._move(key, mark, card)
        return bool(due)

    def _sweep_pass(self) -> bool:
        """One pass over the previous cards; whether it found nothing left to move."""
        store, prev = self.store, self._previous()
        clean = True
        unplaceable = 0
        for card_index in sorted({c for c in prev.card_of if c is not None}):
            if self._stop.is_set():
                return False
            if not store.service.in_service(card_index):
                clean = False
                continue
            try:
                listed = list(store.cards[card_index].listed_heads())     # slow: a header read per object
            except (CardIOError, OSError) as exc:
                if card_index not in self._unlisted:        # once a card, not every pass
                    self._unlisted.add(card_index)
                    logger.warning("mover: cannot list card %s (its objects move when read): %s",
                                   store.cards[card_index].serial, exc)
                clean = False
                continue
            todo: list[tuple[bytes, Optional[int]]] = []
            untagged_targets: Optional[list[int]] = None
            for item in listed:
                mark = self._mark_of(item.tag)
                if mark is None:
                    if untagged_targets is None:
                        untagged_targets = self._untagged_targets(card_index)
                    if untagged_targets != [card_index]:
                        todo.append((item.key, None))
                elif card_index not in store.placement.targets(item.key, mark, store.placement.replicas,
                                                               store.service.active):
                    todo.append((item.key, mark))
            self.left_objects = len(todo)
            for key, mark in todo:
                if self._stop.is_set():
                    return False
                self._move_waiting()
                if mark is not None:
                    done = self._move(key, mark, card_index)
                else:
                    assert untagged_targets is not None     # set above when this untagged object was listed
                    done, placeable = self._copy_untagged(key, card_index, untagged_targets)
                    unplaceable += not placeable
                clean = clean and done
                self.left_objects -= 1
        self.unplaceable_objects = unplaceable
        return clean

    def _previous(self) -> PreviousPlacement:
        prev = self.store.placement.previous
        assert prev is not None     # set before the mover is made; dropped only by its own _finish, after the sweep
        return prev

    def _mark_of(self, tag: Optional[bytes]) -> Optional[int]:
        """The dialog mark that gives an object the slot tag its head records (0: none, the key
        places it); None when the tag does not place it (not recorded, with ``dialog``)."""
        store = self.store
        if store.plan.placement_mode == "stripe":
            return 0                      # the key alone places it, whatever its head records
        if tag is None:
            return None
        mark = int.from_bytes(tag, "big") if tag else 0
        return mark if store.plan.slot_tag(mark) == tag else None

    def _untagged_targets(self, old: int) -> list[int]:
        """The cards (in service) that now hold the replicas of a slot whose replicas card
        ``old`` held in the previous layout: where an object of ``old`` without a tag may belong."""
        store, prev = self.store, self._previous()
        out: set[int] = set()
        active = store.service.active
        for slot, ranking in enumerate(prev.placement.rankings):
            if old not in (prev.card_of[i] for i in ranking[:prev.replicas]):
                continue
            out.update(store.placement.replica_cards(slot, active))
        return sorted(out)

    def _copy_untagged(self, key: bytes, old: int, targets: list[int]) -> tuple[bool, bool]:
        """Copy an object without a tag from ``old`` to every card of ``targets`` (see the
        module), removing it from ``old`` when ``old`` is not one of them. (whether nothing of
        it is left to do, whether it could be placed at all)."""
        store = self.store
        if any(isinstance(store.cards[c], KeysByTag) for c in set(targets) | {old}):
            return True, False            # keyed by the tag it does not record: it stays (see the module)
        if not targets:
            return False, True            # no card of its slots in service now: the next pass
        others = [c for c in targets if c != old]
        if not others:
            return True, True
        return self._transfer(key, old, None, None, others, drop=old not in targets), True

    def _move(self, key: bytes, mark: int, old: int) -> bool:
        """Move one object from card ``old`` to its current cards; whether nothing of it is left
        to move (moved, already there, or gone)."""
        store = self.store
        targets = store.placement.targets(key, mark, store.placement.replicas, store.service.active)
        if not targets or old in targets:
            return bool(targets)
        return self._transfer(key, old, mark, store.plan.slot_tag(mark), targets, drop=True)

    def _yield_to_engine(self) -> None:
        """Wait while the engine's requests are in flight (at most ``YIELD_AT_MOST_S``): the
        engine's reads go first."""
        deadline = time.monotonic() + YIELD_AT_MOST_S
        while self.engine_busy() and time.monotonic() < deadline and not self._stop.wait(YIELD_S):
            pass

    def _transfer(self, key: bytes, old: int, mark: Optional[int], tag: Optional[bytes], targets: list[int],
                  drop: bool) -> bool:
        """Make each card of ``targets`` hold the object on card ``old`` whole (fragments with
        ``tag``), checked byte for byte against the write its head names there, then (``drop``)
        remove it from ``old``; whether nothing of it is left to do. A pinned object waits
        (``mark``: as a hit)."""
        store = self.store
        self._yield_to_engine()
        try:
            recorded = store.io.recorded_head(old, key, tag)
        except CardIOError:
            self.failed += 1
            return False
        if recorded is None:
            return True                   # gone
        size = recorded.size
        if store.pins.holds(key):
            return self._later(key, mark, old)
        buf = bytearray(size)
        view = memoryview(buf)
        # every fragment of the write its head names (another write's: a writer in progress)
        verdict = self._read_object(old, key, recorded, tag, view)
        if verdict is not Read.HIT:
            if verdict.drops:             # missing or corrupt on the old card: evidence about it (that write)
                store.io.remove_write(old, key, size, tag, recorded.write_id)
                return True
            self.failed += 1
            return False
        missing = [t for t in targets if not self._holds(t, key, tag, view)]
        if missing:
            if not self._write_copies(missing, key, tag, view) or not all(self._holds(t, key, tag, view)
                                                                         for t in missing):
                self.failed += 1          # a card failed, or another gateway wrote it at once: next pass
                return False
            self.moved_bytes += size
            self._pace(size)
        if not drop:
            self.copied_objects += 1
            return True
        if store.pins.holds(key):
            return self._later(key, mark, old)
        if not store.io.remove_write(old, key, size, tag, recorded.write_id):
            self.failed += 1              # stored again on the old card since, or it did not answer: next pass
            return False
        self.moved_objects += 1
        return True

    def _holds(self, card: int, key: bytes, tag: Optional[bytes], obj: memoryview) -> bool:
        """Whether ``card`` holds the object whole as ``obj``, byte for byte: every fragment of
        the one write its head names there (two gateways copying an object at once may leave
        fragments of two writes: then it does not)."""
        store = self.store
        try:
            recorded = store.io.recorded_head(card, key, tag)
        except CardIOError:
            return False
        if recorded is None or recorded.size != len(obj):
            return False
        back = bytearray(len(obj))
        if self._read_object(card, key, recorded, tag, memoryview(back)) is not Read.HIT:
            return False
        return back == obj

    def _read_object(self, card: int, key: bytes, head: Head, tag: Optional[bytes], buf: memoryview) -> Read:
        """Read the object ``key`` whole from ``card`` into ``buf`` (``head.size`` bytes): every
        fragment of the write ``head`` names (another write's is ``CHANGED``: a writer in
        progress), each accounted as any read. ``HIT`` when all are; else the first other
        verdict, and nothing is removed (the caller decides)."""
        store = self.store
        for frag in store.plan.fragments(card, key, head.size, tag):
            verdict = store.io.read(frag._replace(write_id=head.write_id), buf[frag.offset:frag.offset + frag.length])
            if verdict is not Read.HIT:
                return verdict
        return Read.HIT

    def _write_copies(self, cards: list[int], key: bytes, tag: Optional[bytes], obj: memoryview) -> bool:
        """Write the object ``key`` (its bytes ``obj``; ``tag`` its slot tag, None: recorded as
        not known) whole to each of ``cards``, one write id for all, head last; True if at least
        one holds all of it."""
        store = self.store
        return store.io.write_replicas([store.plan.fragments(c, key, len(obj), tag) for c in cards], obj)

    def _later(self, key: bytes, mark: Optional[int], old: int) -> bool:
        """An engine holds the object pinned: moved later (as a hit, or by the next pass)."""
        if mark is not None:
            self.hit(key, mark, old)
        return False

    def _pace(self, nbytes: int) -> None:
        """Hold the mover to ``rate_bytes`` per second."""
        self._stop.wait(nbytes / self.rate_bytes)


def families(figures: GatewayStats) -> Iterable[Metric]:
    """The change's metrics, from the STATS figures (``gateway/observe/metrics.py`` FROM_FIGURES)."""
    change = figures.layout_change
    active = GaugeMetricFamily(PREFIX + "layout_change_active", "1 while a card-set change is being moved")
    active.add_metric([], 0 if change is None or change.complete else 1)
    yield active
    if change is None:
        return
    for name, what, value in (
            ("layout_moved_objects", "Objects moved to their card in the current layout", change.moved_objects),
            ("layout_moved_bytes", "Bytes moved to their card in the current layout", change.moved_bytes),
            ("layout_left_objects", "Objects known to be left to move", change.left_objects),
            ("layout_copied_objects", "Copies of objects without a recorded slot tag, to every card that may own "
             "them", change.copied_objects),
            ("layout_unplaceable_objects", "Objects without a recorded slot tag the last sweep pass left in place "
             "(cluster cards)", change.unplaceable_objects),
            ("layout_move_rate_bytes", "Bytes moved per second since the change began",
             change.rate_bytes_per_s)):
        g = GaugeMetricFamily(PREFIX + name, what)
        g.add_metric([], value)
        yield g


metrics.FROM_FIGURES.append(families)
