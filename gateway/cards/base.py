"""The card interface: one storage backend instance behind the gateway.

A card stores fragments (the unit of storage, see ``adpkv_core.fragments``) in
``num_dbs`` databases. Only the gateway talks to cards. Every method may be
called from many I/O threads at once. A read that cannot return exactly the
bytes that were written (missing, truncated, corrupt, foreign) returns False:
a miss, never wrong data.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional


@dataclasses.dataclass
class CardUsage:
    used_bytes: int
    capacity_bytes: int
    objects: int


class CardError(Exception):
    """A card cannot be opened or used (bad path, another card's files, ...)."""


class CardUnavailable(CardError):
    """The card does not answer (yet): the gateway starts without it and retries."""


class CardIOError(Exception):
    """A transport failure (timeout, lost connection, I/O error): counts as a strike
    against the card's health, unlike a plain miss."""


class Card(abc.ABC):
    """One storage backend instance with a stable serial number."""

    kind: str = ""

    def __init__(self, device: str):
        self.device = device
        self.serial: str = ""

    @abc.abstractmethod
    def open(self) -> None:
        """Connect/prepare the card and learn (or assign) its serial; raises CardError."""

    @abc.abstractmethod
    def read(self, db: int, fkey: bytes, buf: memoryview) -> bool:
        """Fill ``buf`` (exactly its length) with the fragment; False on any miss."""

    @abc.abstractmethod
    def write(self, db: int, fkey: bytes, buf: memoryview) -> bool:
        """Store ``buf`` atomically under ``fkey``; False if it could not be stored."""

    @abc.abstractmethod
    def contains(self, db: int, fkey: bytes) -> bool:
        """Whether the fragment is stored (cheap; may be stale, a later read decides)."""

    def contains_many(self, items: list[tuple[int, bytes]], lengths: Optional[list[int]] = None) -> list[bool]:
        """``contains`` of many fragments (a card may batch them into one round trip).

        With ``lengths``, a fragment only counts when it holds that many payload bytes.
        """
        return [self.contains(db, fkey) for db, fkey in items]

    @abc.abstractmethod
    def delete(self, db: int, fkey: bytes) -> bool:
        """Remove one fragment; True if it existed."""

    @abc.abstractmethod
    def clean(self) -> int:
        """Remove every object of the card; returns how many were removed."""

    @abc.abstractmethod
    def usage(self) -> CardUsage:
        """Bytes used, capacity and object count."""

    @abc.abstractmethod
    def check(self) -> bool:
        """Health probe: the card answers and still has the same serial."""

    def close(self) -> None:
        """Release resources."""
