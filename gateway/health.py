"""Card health: a check of every card every second, and I/O strikes.

A card leaves service when its check fails, or when ``io_timeout_strikes``
commands in a row pass ``io_timeout_ms`` or fail in the transport. It comes
back when it answers again with the same serial: at once, or after
``IO_ERROR_COOLDOWN_S`` when an I/O error took it out. A card that was not
available at startup joins (with the serial it holds, or a new one) when it
answers.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Collection, Sequence

from .cards.base import CardError
from .store import ObjectStore

logger = logging.getLogger("adpkv.gateway.health")

IO_ERROR_COOLDOWN_S = 10.0
CHECK_INTERVAL_S = 1.0


class HealthMonitor:
    """Watches the cards of a store and flips ``store.active``."""

    def __init__(self, store: ObjectStore, io_timeout_ms: int, io_timeout_strikes: int):
        self.store = store
        self.io_timeout_s = io_timeout_ms / 1000.0 if io_timeout_ms > 0 else None
        self.max_strikes = max(1, io_timeout_strikes)
        n = len(store.cards)
        self.strikes = [0] * n
        self.out_since = [0.0] * n
        self.out_by_io = [False] * n
        self.expected_fingerprint = ""
        self._impostor: list = [None] * n
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adpkv-health", daemon=True)
        store.on_io = self.record_io
        store.on_ios = self.record_ios
        for i, card in enumerate(store.cards):
            if not card.serial:
                logger.warning("Card %s is not available at startup; it joins when it answers", card.device)
                self.out_since[i] = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ I/O strikes (I/O threads)
    def record_io(self, card: int, transport_ok: bool, seconds: float) -> None:
        late = self.io_timeout_s is not None and seconds > self.io_timeout_s
        with self._lock:
            if transport_ok and not late:
                self.strikes[card] = 0
                return
            self.strikes[card] += 1
            out = self.strikes[card] >= self.max_strikes and self.store.active[card]
        if out:
            why = "I/O past io_timeout_ms" if transport_ok else "I/O errors"
            self._deactivate(card, f"{self.max_strikes} commands in a row failed ({why})", by_io=True)

    def record_ios(self, card: int, seconds: Sequence[float], failed: Collection[int] = ()) -> None:
        """``record_io`` of a card's I/Os in their order (an I/O process's task): ``seconds``
        each, ``failed`` the positions that failed in the transport. One lock when every one
        went well and in time (they only clear the strikes), else one by one."""
        if not seconds:
            return
        if not failed and (self.io_timeout_s is None or max(seconds) <= self.io_timeout_s):
            with self._lock:
                self.strikes[card] = 0
            return
        for k, s in enumerate(seconds):
            self.record_io(card, k not in failed, s)

    # ------------------------------------------------------------------ the check loop
    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            for i in range(len(self.store.cards)):
                try:
                    self.check_card(i)
                except Exception:
                    logger.exception("health check of card %s failed", self.store.cards[i].device)

    def check_card(self, i: int) -> None:
        card = self.store.cards[i]
        if self.store.active[i]:
            if not card.check():
                self._deactivate(i, "health check failed", by_io=False)
            return
        if not card.serial:
            try:
                card.open()
            except CardError:
                return
            self.store.rebuild_placement()
            logger.info("Card %s (%s) answered: serial %s joins", card.device, card.kind, card.serial)
            if self.expected_fingerprint and self.expected_fingerprint != self.store.fingerprint:
                logger.error("Key layout fingerprint is now %s, the configured one is %s",
                             self.store.fingerprint, self.expected_fingerprint)
            self._activate(i)
            return
        if self.out_by_io[i] and time.monotonic() - self.out_since[i] < IO_ERROR_COOLDOWN_S:
            return
        if card.check():
            self._activate(i)
        elif hasattr(card, "probe_serial"):
            other = card.probe_serial()
            if other is not None and other != card.serial and self._impostor[i] != other:
                self._impostor[i] = other
                logger.warning("Card %s answers with serial %r, not %s: another card, left unused",
                               card.device, other, card.serial)

    def _deactivate(self, i: int, why: str, by_io: bool) -> None:
        with self._lock:
            if not self.store.active[i]:
                return
            self.store.active[i] = False
            self.out_since[i] = time.monotonic()
            self.out_by_io[i] = by_io
        card = self.store.cards[i]
        logger.warning("Card %s (%s) moved from active to inactive: %s", card.serial, card.device, why)

    def _activate(self, i: int) -> None:
        card = self.store.cards[i]
        if hasattr(card, "reset_connections"):
            card.reset_connections()
        with self._lock:
            self.strikes[i] = 0
            self.store.active[i] = True
        logger.info("Card %s (%s) moved from inactive to active; Group Health: active", card.serial, card.device)
