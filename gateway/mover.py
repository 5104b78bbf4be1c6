"""The mover: during a card-set change, moves objects from the previous layout's cards to
their cards in the current one, in a thread of its own at a bounded rate.

Where the work comes from:

- hits: a lookup that missed in the current placement and hit in the previous one
  (``ObjectStore.on_previous_hit``) is moved ``MOVE_AFTER_S`` after it was served (the read
  that found it is done by then);
- the sweep: with ``key_placement: stripe`` an object's card follows from its key alone, so
  the mover lists the objects of every previous card (fs: its database directories; resp: a
  SCAN; a cluster card is not listed yet: its objects move when read) and moves those whose card
  changed. With ``dialog`` placement a key's card follows
  from its dialog mark, which a card does not store: objects move when they are read.

One move, and why it loses nothing acknowledged: the object is read whole from its old card
(every fragment checked, as any read), written whole to its new cards (head last), read back
from them and compared byte for byte, and only then removed from the old card (never while
an engine holds it pinned). A crash at any point leaves the old copy, the new one, or both:
the next gateway finds it either way (a lookup falls back; the sweep removes an old copy whose
new one is whole). Two gateways moving the same object write the same bytes.

When a sweep pass finds nothing left to move and no hit waits, the change is complete:
``on_complete`` drops the previous layout (once). Contract: ``store`` is the gateway's
``ObjectStore`` with ``previous`` set; the mover only reads ``store.active``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily

from . import metrics
from .cards.base import Card, CardIOError, Read
from .cards.fs_files import SUBDIR_NAMES
from .fragments import fragment_db, fragment_key
from .status import PREFIX
from .store import ObjectStore

logger = logging.getLogger("adpkv.gateway.mover")

MOVE_AFTER_S = 1.0            # a hit moves this long after it was served
YIELD_S = 0.005               # while the engine's requests are in flight the mover looks again after this
YIELD_AT_MOST_S = 0.25        # ... and moves one object after this long anyway (a busy engine never stops it)
MAX_WAITING = 1 << 18         # hits remembered at most (more: the sweep, or the next read, finds them)
RETRY_S = 5.0                 # a sweep pass that could not move everything runs again after this
HEAD_SUFFIX = fragment_key(b"", 0)


class Mover:
    """Moves the objects of ``store.previous`` to their current cards (see the module)."""

    def __init__(self, store: ObjectStore, previous_fingerprint: str, rate_bytes: int, sweep: bool,
                 on_complete: Callable[[], None]):
        self.store = store
        self.engine_busy: Callable[[], bool] = lambda: False      # the engine has requests in flight
        self.previous_fingerprint = previous_fingerprint
        self.rate_bytes = rate_bytes
        self.sweep_enabled = sweep
        self.on_complete = on_complete
        self.moved_objects = 0
        self.moved_bytes = 0
        self.left_objects = 0          # found by the running sweep pass, not moved yet (+ waiting hits)
        self.failed = 0                # moves that could not be done (a card failed): tried again
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
                "rate_bytes_per_s": self.moved_bytes / elapsed, "rate_limit_bytes_per_s": self.rate_bytes}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._move_waiting():
                    continue
                if self.sweep_enabled:
                    clean = self._sweep_pass()
                    if clean and not self._waiting and not self._stop.is_set():
                        self._finish()
                        return
                    self._wake.wait(RETRY_S)
                else:
                    self._wake.wait(MOVE_AFTER_S)
                self._wake.clear()
        except Exception:                  # the mover must never take the gateway down
            logger.exception("the mover stopped")

    def _finish(self) -> None:
        self.complete = True
        self.left_objects = 0
        logger.info("Card-set change complete: %d objects (%d bytes) moved; the previous layout is dropped",
                    self.moved_objects, self.moved_bytes)
        self.on_complete()

    def _move_waiting(self) -> bool:
        """Move the hits that are due; whether any was."""
        now = time.monotonic()
        with self._lock:
            due = []
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
        prev = self.store.previous
        clean = True
        for card_index in sorted({c for c in prev.card_of if c is not None}):
            if self._stop.is_set():
                return False
            if not self.store.active[card_index]:
                clean = False
                continue
            try:
                keys = list(object_keys(self.store.cards[card_index]))
            except (CardIOError, OSError) as exc:
                if card_index not in self._unlisted:        # once a card, not every pass
                    self._unlisted.add(card_index)
                    logger.warning("mover: cannot list card %s (its objects move when read): %s",
                                   self.store.cards[card_index].serial, exc)
                clean = False
                continue
            todo = [k for k in keys if card_index not in self.store.targets(k, 0, self.store.replicas)]
            self.left_objects = len(todo)
            for key in todo:
                if self._stop.is_set():
                    return False
                self._move_waiting()
                done = self._move(key, 0, card_index)
                clean = clean and done
                self.left_objects -= 1
        return clean

    def _yield_to_engine(self) -> None:
        """Wait while the engine's requests are in flight (at most ``YIELD_AT_MOST_S``): the
        engine's reads go first."""
        deadline = time.monotonic() + YIELD_AT_MOST_S
        while self.engine_busy() and time.monotonic() < deadline and not self._stop.wait(YIELD_S):
            pass

    def _move(self, key: bytes, mark: int, old: int) -> bool:
        """Move one object from card ``old`` to its current cards; whether nothing of it is left
        to move (moved, already there, or gone)."""
        store = self.store
        self._yield_to_engine()
        targets = store.targets(key, mark, store.replicas)
        if not targets or old in targets:
            return bool(targets)
        tag = store.slot_tag(mark)
        card = store.cards[old]
        head = (fragment_db(key, 0, store.num_dbs, store.spread), key + HEAD_SUFFIX)
        try:
            recorded, = card.heads([head], [tag])
        except CardIOError:
            self.failed += 1
            return False
        size = recorded.size if recorded is not None else 0
        if not size:
            return True                   # gone (or a head without a size: read as one fragment, left)
        if store.is_pinned(key):
            self.hit(key, mark, old)      # an engine holds it: later
            return False
        if not all(store._whole(t, [key], size, [tag])[0] is not None for t in targets):
            buf = bytearray(size)
            view = memoryview(buf)
            for frag in store._frags(old, key, size, tag):
                # every fragment of the write its head names (another write's: a writer in progress)
                verdict = store._read(frag._replace(write_id=recorded.write_id),
                                      view[frag.offset:frag.offset + frag.length])
                if verdict is not Read.HIT:
                    if verdict.drops:     # missing or corrupt on the old card: evidence about it
                        store._remove_object(old, key, size, tag)
                        return True
                    self.failed += 1
                    return False
            plans = store.write_plans(key, mark, size)
            if not store.write_replicas(plans, view) or not all(self._same(store, frags, view) for frags in plans):
                self.failed += 1
                return False
            self.moved_bytes += size
            self._pace(size)
        if store.is_pinned(key):
            self.hit(key, mark, old)
            return False
        store._remove_object(old, key, size, tag)
        self.moved_objects += 1
        return True

    @staticmethod
    def _same(store: ObjectStore, frags, obj: memoryview) -> bool:
        """Whether the object's fragments on their card read back as ``obj``, byte for byte."""
        back = bytearray(len(obj))
        view = memoryview(back)
        for frag in frags:
            if store._read(frag, view[frag.offset:frag.offset + frag.length]) is not Read.HIT:
                return False
        return back == obj

    def _pace(self, nbytes: int) -> None:
        """Hold the mover to ``rate_bytes`` per second."""
        self._stop.wait(nbytes / self.rate_bytes)


def object_keys(card: Card) -> Iterator[bytes]:
    """The key of every object whose head is on ``card`` (fs: file names; resp: a SCAN)."""
    if card.kind == "fs":
        for name in sorted(os.listdir(card.root)):
            if not (name.startswith("db") and name[2:].isdigit()):
                continue
            for sub in SUBDIR_NAMES:         # fs_files: a database's object subdirectories
                try:
                    it = os.scandir(os.path.join(card.root, name, sub))
                except FileNotFoundError:
                    continue
                with it:
                    for entry in it:
                        if entry.name.endswith(HEAD_SUFFIX.hex()) and entry.is_file(follow_symlinks=False):
                            try:
                                fkey = bytes.fromhex(entry.name)
                            except ValueError:
                                continue
                            yield fkey[:-len(HEAD_SUFFIX)]
    elif card.kind == "resp":
        cursor, prefix = b"0", b"adpkv:"
        while True:
            cursor, names = card._io(lambda c, cur=cursor: c.command(b"SCAN", cur, b"MATCH", prefix + b"[0-9]*",
                                                                     b"COUNT", b"1000"))
            for name in names:
                fkey = name.split(b":", 2)[2]
                if fkey.endswith(HEAD_SUFFIX):
                    yield fkey[:-len(HEAD_SUFFIX)]
            if cursor in (b"0", 0):
                return
    else:
        raise CardIOError(f"card {card.device}: the mover cannot list a {card.kind} card")


def families(figures: dict):
    """The change's metrics, from the STATS figures (``gateway/metrics.py`` FROM_FIGURES)."""
    change = figures.get("layout_change")
    active = GaugeMetricFamily(PREFIX + "layout_change_active", "1 while a card-set change is being moved")
    active.add_metric([], 0 if not change or change["complete"] else 1)
    yield active
    if not change:
        return
    for name, what, value in (
            ("layout_moved_objects", "Objects moved to their card in the current layout", change["moved_objects"]),
            ("layout_moved_bytes", "Bytes moved to their card in the current layout", change["moved_bytes"]),
            ("layout_left_objects", "Objects known to be left to move", change["left_objects"]),
            ("layout_move_rate_bytes", "Bytes moved per second since the change began",
             change["rate_bytes_per_s"])):
        g = GaugeMetricFamily(PREFIX + name, what)
        g.add_metric([], value)
        yield g


metrics.FROM_FIGURES.append(families)
