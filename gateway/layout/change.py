"""A gateway's key layout over a card-set change: settles the layout recorded on the cards
(``gateway/layout/record.py``) at start, gives the store the previous placement to fall back
on and runs the mover (``gateway/layout/mover.py``) until nothing is left, then drops the previous
layout: recorded on every card, logged once, shown in STATS and the status file.

Contract: ``open`` runs once the store is built (its cards opened); ``start`` once the
gateway's data path is built, ``stop`` at shutdown. ``figures`` is read on any thread.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from adpkv_gateway.config import GatewayConfig
from adpkv_gateway.layout.record import CardRecord, Layout, LayoutError, settle, write_all
from adpkv_gateway.layout.mover import Mover
from adpkv_gateway.store.object_store import ObjectStore
from adpkv_gateway.store.placement import PreviousPlacement

logger = logging.getLogger("adpkv.gateway.layout")


class LayoutChange:
    """The gateway's layout record and, during a change, its mover."""

    def __init__(self, store: ObjectStore, record: Optional[CardRecord], move_rate_bytes: int):
        self.store = store
        self.record = record             # None: not every card answered at start (nothing recorded)
        self.move_rate_bytes = move_rate_bytes
        self.mover: Optional[Mover] = None
        self.engine_busy: Callable[[], bool] = lambda: False

    @classmethod
    def open(cls, store: ObjectStore, config: GatewayConfig) -> "LayoutChange":
        """Settle the layout (raises SystemExit with the reason when it does not fit)."""
        if not all(c.serial for c in store.cards):
            logger.warning("Not every card answered: the key layout recorded on the cards is checked at the "
                           "next start with every card")
            return cls(store, None, config.move_rate_bytes)
        current = Layout.of([c.serial for c in store.cards], config.storage_slots, config.num_dbs,
                            config.key_placement, config.fragment_size, config.replicas)
        try:
            record = settle(store.cards, current, config.key_layout_fingerprint,
                            config.previous_key_layout_fingerprint)
        except LayoutError as exc:
            raise SystemExit(str(exc)) from None
        change = cls(store, record, config.move_rate_bytes)
        store.placement.left_out = frozenset(c.serial for c in store.cards) - frozenset(record.layout.serials)
        store.placement.rebuild()
        if record.previous is not None:
            change._begin(record.previous)
        return change

    def _begin(self, prev: Layout) -> None:
        """Fall back to ``prev`` and move its objects (the mover starts with ``start``)."""
        store = self.store
        store.placement.previous = PreviousPlacement(prev.serials, store.cards, prev.storage_slots, prev.key_placement,
                                           prev.replicas)
        self.mover = Mover(store, prev.fingerprint, self.move_rate_bytes, on_complete=self._complete)
        store.placement.on_previous_hit = self.mover.hit

    def drain_refusal(self, serial: str) -> Optional[str]:
        """Why ``serial`` cannot be drained now, or None (on the gateway's loop)."""
        if self.record is None:
            return "not every card answered at start: the layout is not recorded"
        if self.store.placement.previous is not None:
            return "a card-set change is being moved; drain when it is complete"
        if serial not in self.record.layout.serials:
            return f"card {serial} is not in the layout"
        if len(self.record.layout.serials) == 1:
            return "the last card cannot be drained"
        return None

    def drain(self, serial: str) -> Layout:
        """Leave card ``serial`` out of the layout (on the gateway's loop, after ``drain_refusal``
        found nothing): lookups fall back to the layout with it; ``record_drain`` (on the pool)
        then records the change on every card and starts the mover. The layout after it."""
        recorded = self.record
        assert recorded is not None         # drain_refusal found nothing: a layout is recorded
        store, old = self.store, recorded.layout
        self.record = CardRecord(old.without([serial]), old, recorded.epoch + 1)
        self._begin(old)
        store.placement.left_out = store.placement.left_out | {serial}
        store.placement.rebuild()
        logger.info("Drain of card %s: layout %s -> %s; its objects move to the other cards", serial,
                    old.fingerprint, self.record.layout.fingerprint)
        return self.record.layout

    def record_drain(self) -> None:
        record, mover = self.record, self.mover
        assert record is not None and mover is not None     # drain set both (_begin made the mover)
        write_all(self.store.cards, record)
        mover.engine_busy = self.engine_busy
        mover.start()

    def start(self, engine_busy: Callable[[], bool]) -> None:
        """Start the mover, which yields to the engine while ``engine_busy()`` (any thread)."""
        self.engine_busy = engine_busy
        if self.mover:
            self.mover.engine_busy = engine_busy
            self.mover.start()

    def stop(self) -> None:
        if self.mover:
            self.mover.stop()

    def figures(self) -> Optional[dict]:
        """The change for STATS (None: no change since this gateway started)."""
        return None if self.mover is None else self.mover.figures()

    def _complete(self) -> None:
        """Nothing is left to move (the mover's thread): the previous layout is dropped."""
        recorded, m = self.record, self.mover
        assert recorded is not None and m is not None   # only the mover calls this: _begin made it, with a record
        record = CardRecord(recorded.layout, None, recorded.epoch + 1)
        self.store.placement.on_previous_hit = lambda key, mark, card: None
        self.store.placement.previous = None
        write_all(self.store.cards, record)
        self.record = record
        logger.info("Card-set change to key layout %s complete: %d objects (%d bytes) moved, %d copies of objects "
                    "without a recorded slot tag, %d such objects left in place; the previous layout is dropped",
                    record.layout.fingerprint, m.moved_objects, m.moved_bytes, m.copied_objects,
                    m.unplaceable_objects)
