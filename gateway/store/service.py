"""Which cards are in service: the flags every lookup and write reads, and the way a card
leaves service (its I/O, through the ``CardObserver``, or a failed check) and comes back.
Imports nothing of the gateway but the card contract."""

from __future__ import annotations

import abc
import threading
from typing import Collection, Optional, Sequence

from adpkv_gateway.cards.base import Card


class CardObserver(abc.ABC):
    """What watches the cards' I/O through the store (``gateway/store/health.py``'s ``CardHealth``),
    given to the store when it is made.

    Contract: the store calls ``io``/``ios`` after card commands, from its I/O threads (many
    at once) and from the gateway's loop (an I/O process's task): they must be quick, take
    no card I/O and call nothing of the store. When one answers a reason, the store takes
    the card out of service (if it still is) and calls ``left`` with it, under the lock of
    the in-service flags (so ``left`` must not call the store either)."""

    @abc.abstractmethod
    def io(self, card: int, transport_ok: bool, seconds: float) -> Optional[str]:
        """One command of card ``card`` took ``seconds``; ``transport_ok`` False when it
        failed in the transport (a strike). Why the card must leave service now, or None
        when it stays."""

    @abc.abstractmethod
    def ios(self, card: int, seconds: Sequence[float], failed: Collection[int] = ()) -> Optional[str]:
        """``io`` of many commands of one card in their order (an I/O process's task):
        ``seconds`` each, ``failed`` the positions that failed in the transport; the first
        reason to leave service, or None."""

    @abc.abstractmethod
    def left(self, card: int, why: str, by_io: bool) -> None:
        """Card ``card`` has just left service (``CardService.take_out``): ``by_io`` when its
        I/O took it out (``io``/``ios``), else a failed check."""


class CardService:
    """The in-service flag of each card of the gateway (a card without a serial never is,
    until a check brings it back).

    ``active``: whether each card is in service now, as one immutable tuple that a change
    replaces whole (under the lock): a reader takes it once for a batch and sees one
    consistent set of cards for all of it, without a call or a copy."""

    def __init__(self, cards: Sequence[Card], observer: CardObserver):
        self.active: tuple[bool, ...] = tuple(bool(c.serial) for c in cards)
        self._lock = threading.Lock()
        self.observer = observer

    def in_service(self, card: int) -> bool:
        return self.active[card]

    def _set(self, card: int, on: bool) -> None:
        """Publish a new ``active`` with card ``card``'s flag ``on`` (under the lock)."""
        self.active = self.active[:card] + (on,) + self.active[card + 1:]

    def take_out(self, card: int, why: str, by_io: bool = False) -> None:
        """Take a card out of service (its I/O, through the observer, or a failed check);
        the observer hears of it (``CardObserver.left``) once, when it was in service."""
        with self._lock:
            if not self.active[card]:
                return
            self._set(card, False)
            self.observer.left(card, why, by_io)

    def bring_back(self, card: int) -> None:
        """Put a card (back) in service: it answered its check."""
        with self._lock:
            self._set(card, True)

    def observe(self, card: int, transport_ok: bool, seconds: float) -> None:
        """Tell the observer of one command of ``card``; take the card out when it says so."""
        why = self.observer.io(card, transport_ok, seconds)
        if why is not None:
            self.take_out(card, why, by_io=True)

    def observe_many(self, card: int, seconds: Sequence[float], failed: Collection[int] = ()) -> None:
        """``observe`` of many commands of one card in their order (an I/O process's task)."""
        why = self.observer.ios(card, seconds, failed)
        if why is not None:
            self.take_out(card, why, by_io=True)
