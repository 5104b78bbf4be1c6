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
    until a check brings it back)."""

    def __init__(self, cards: Sequence[Card], observer: CardObserver):
        self._active = [bool(c.serial) for c in cards]
        self._lock = threading.Lock()
        self.observer = observer

    @property
    def active(self) -> tuple[bool, ...]:
        """Whether each card is in service now (a snapshot)."""
        return tuple(self._active)

    def in_service(self, card: int) -> bool:
        return self._active[card]

    def take_out(self, card: int, why: str, by_io: bool = False) -> None:
        """Take a card out of service (its I/O, through the observer, or a failed check);
        the observer hears of it (``CardObserver.left``) once, when it was in service."""
        with self._lock:
            if not self._active[card]:
                return
            self._active[card] = False
            self.observer.left(card, why, by_io)

    def bring_back(self, card: int) -> None:
        """Put a card (back) in service: it answered its check."""
        with self._lock:
            self._active[card] = True

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
