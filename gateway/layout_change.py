"""A gateway's key layout over a card-set change: settles the layout recorded on the cards
(``gateway/layout_record.py``) at start, gives the store the previous placement to fall back
on and runs the mover (``gateway/mover.py``) until nothing is left, then drops the previous
layout: recorded on every card, logged once, shown in STATS and the status file.

Contract: ``open`` runs once the store is built (its cards opened); ``start`` once the
gateway's data path is built, ``stop`` at shutdown. ``figures`` is read on any thread.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from .config import GatewayConfig
from .layout_record import CardRecord, Layout, LayoutError, settle, write_all
from .mover import Mover
from .store import ObjectStore, PreviousPlacement

logger = logging.getLogger("adpkv.gateway.layout")


class LayoutChange:
    """The gateway's layout record and, during a change, its mover."""

    def __init__(self, store: ObjectStore, record: Optional[CardRecord], mover: Optional[Mover]):
        self.store = store
        self.record = record             # None: not every card answered at start (nothing recorded)
        self.mover = mover

    @classmethod
    def open(cls, store: ObjectStore, config: GatewayConfig) -> "LayoutChange":
        """Settle the layout (raises SystemExit with the reason when it does not fit)."""
        if not all(c.serial for c in store.cards):
            logger.warning("Not every card answered: the key layout recorded on the cards is checked at the "
                           "next start with every card")
            return cls(store, None, None)
        current = Layout.of([c.serial for c in store.cards], config.storage_slots, config.num_dbs,
                            config.key_placement, config.fragment_size, config.replicas)
        try:
            record = settle(store.cards, current, config.key_layout_fingerprint,
                            config.previous_key_layout_fingerprint)
        except LayoutError as exc:
            raise SystemExit(str(exc)) from None
        change = cls(store, record, None)
        if record.previous is not None:
            prev = record.previous
            store.previous = PreviousPlacement(prev.serials, store.cards, prev.storage_slots, prev.key_placement,
                                               prev.replicas)
            change.mover = Mover(store, prev.fingerprint, config.move_rate_bytes,
                                 sweep=config.key_placement == "stripe", on_complete=change._complete)
            store.on_previous_hit = change.mover.hit
        return change

    def start(self, engine_busy: Callable[[], bool]) -> None:
        """Start the mover, which yields to the engine while ``engine_busy()`` (any thread)."""
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
        record = CardRecord(self.record.layout, None, self.record.epoch + 1)
        self.store.on_previous_hit = lambda key, mark, card: None
        self.store.previous = None
        write_all(self.store.cards, record)
        self.record = record
        logger.info("Key layout %s: the previous layout is dropped", record.layout.fingerprint)
