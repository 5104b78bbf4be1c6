"""Card health: a check of every card every second, and I/O strikes.

A card leaves service when its check fails, or when ``io_timeout_strikes``
commands in a row pass ``io_timeout_ms`` or fail in the transport. It comes
back when it answers again with the same serial: at once, or after
``IO_ERROR_COOLDOWN_S`` when an I/O error took it out. A card that was not
available at startup joins (with the serial it holds, or a new one) when it
answers.

Two parts, made in the order the gateway needs them: ``CardHealth`` (the strikes and
since when each card is out) is the store's ``CardObserver``, made before the store;
``HealthMonitor`` (the check loop) is made with the store and takes cards out and
back through it (``CardService.take_out``, ``bring_back``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Collection, Optional, Sequence

from adpkv_gateway.cards.base import Card, CardError
from adpkv_gateway.store.object_store import ObjectStore
from adpkv_gateway.store.service import CardObserver

logger = logging.getLogger("adpkv.gateway.health")

IO_ERROR_COOLDOWN_S = 10.0
CHECK_INTERVAL_S = 1.0


class CardHealth(CardObserver):
    """The I/O strikes of each card and since when a card is out of service (the store's observer)."""

    def __init__(self, cards: Sequence[Card], io_timeout_ms: int, io_timeout_strikes: int):
        self.cards = list(cards)
        self.io_timeout_s = io_timeout_ms / 1000.0 if io_timeout_ms > 0 else None
        self.max_strikes = max(1, io_timeout_strikes)
        n = len(self.cards)
        self.strikes = [0] * n
        self.out_since = [0.0] * n
        self.out_by_io = [False] * n
        self._lock = threading.Lock()
        for i, card in enumerate(self.cards):
            if not card.serial:
                logger.warning("Card %s is not available at startup; it joins when it answers", card.device)
                self.out_since[i] = time.monotonic()

    # ------------------------------------------------------------------ I/O strikes (I/O threads)
    def io(self, card: int, transport_ok: bool, seconds: float) -> Optional[str]:
        late = self.io_timeout_s is not None and seconds > self.io_timeout_s
        with self._lock:
            if transport_ok and not late:
                self.strikes[card] = 0
                return None
            self.strikes[card] += 1
            if self.strikes[card] < self.max_strikes:
                return None
        why = "I/O past io_timeout_ms" if transport_ok else "I/O errors"
        return f"{self.max_strikes} commands in a row failed ({why})"

    def ios(self, card: int, seconds: Sequence[float], failed: Collection[int] = ()) -> Optional[str]:
        """One lock when every one went well and in time (they only clear the strikes), else
        one by one."""
        if not seconds:
            return None
        if not failed and (self.io_timeout_s is None or max(seconds) <= self.io_timeout_s):
            with self._lock:
                self.strikes[card] = 0
            return None
        out = None
        for k, s in enumerate(seconds):
            why = self.io(card, k not in failed, s)
            out = out or why
        return out

    def left(self, card: int, why: str, by_io: bool) -> None:
        with self._lock:
            self.out_since[card] = time.monotonic()
            self.out_by_io[card] = by_io
        c = self.cards[card]
        logger.warning("Card %s (%s) moved from active to inactive: %s", c.serial, c.device, why)

    def cooling(self, card: int) -> bool:
        """Whether an I/O error took the card out less than ``IO_ERROR_COOLDOWN_S`` ago."""
        return self.out_by_io[card] and time.monotonic() - self.out_since[card] < IO_ERROR_COOLDOWN_S

    def reset(self, card: int) -> None:
        """The card is back: no strikes."""
        with self._lock:
            self.strikes[card] = 0


class HealthMonitor:
    """Checks the cards of a store every second and takes them out of service and back."""

    def __init__(self, store: ObjectStore, health: CardHealth):
        self.store = store
        self.health = health
        self.expected_fingerprint = ""
        self._impostor: list = [None] * len(store.cards)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adpkv-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

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
        if self.store.service.in_service(i):
            if not card.check():
                self.store.service.take_out(i, "health check failed")
            return
        if not card.serial:
            try:
                card.open()
            except CardError:
                return
            self.store.placement.rebuild()
            logger.info("Card %s (%s) answered: serial %s joins", card.device, card.kind, card.serial)
            if self.expected_fingerprint and self.expected_fingerprint != self.store.placement.fingerprint:
                logger.error("Key layout fingerprint is now %s, the configured one is %s",
                             self.store.placement.fingerprint, self.expected_fingerprint)
            self._activate(i)
            return
        if self.health.cooling(i):
            return
        if card.check():
            self._activate(i)
        elif hasattr(card, "probe_serial"):
            other = card.probe_serial()
            if other is not None and other != card.serial and self._impostor[i] != other:
                self._impostor[i] = other
                logger.warning("Card %s answers with serial %r, not %s: another card, left unused",
                               card.device, other, card.serial)

    def _activate(self, i: int) -> None:
        card = self.store.cards[i]
        if hasattr(card, "reset_connections"):
            card.reset_connections()
        self.health.reset(i)
        self.store.service.bring_back(i)
        logger.info("Card %s (%s) moved from inactive to active; Group Health: active", card.serial, card.device)
