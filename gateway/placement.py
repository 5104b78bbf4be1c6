"""Placement: which card holds a key, computed by every gateway on its own.

``storage_slots`` slots are ranked over the cards by serial number (rendezvous
hashing: for slot s, the cards in decreasing order of hash(serial, s)), so the
order of the cards in the configuration does not matter and a new card takes
only its share of the slots. A key goes to the first card of its slot's
ranking that is in service (its replicas to the next ones). ``dialog``
placement picks the slot from the dialog mark (all blocks of a dialog on one
card); ``stripe`` from the chunk itself (one long restore reads all cards).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import xxhash


def slot_rankings(serials: Sequence[Optional[str]], storage_slots: int) -> list[list[int]]:
    """For each slot, the indices of the cards with a known serial, best first."""
    known = [i for i, s in enumerate(serials) if s]
    rankings = []
    for slot in range(storage_slots):
        scores = {i: xxhash.xxh3_64_intdigest(f"{serials[i]}/{slot}".encode()) for i in known}
        rankings.append(sorted(known, key=lambda i: (-scores[i], serials[i])))
    return rankings


def key_layout_fingerprint(serials: Sequence[str], storage_slots: int, num_dbs: int, placement: str,
                           fragment_size: int = 0) -> str:
    """16 hex digits over everything that decides where a key lives."""
    canon = "|".join(sorted(serials)) + f"#{storage_slots}#{num_dbs}#{placement}#{fragment_size}"
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


class Placement:
    """Maps (key, dialog mark) to the ranking of cards for it."""

    def __init__(self, serials: Sequence[Optional[str]], storage_slots: int, mode: str = "dialog"):
        if mode not in ("dialog", "stripe"):
            raise ValueError(f"unknown key_placement {mode!r}")
        self.mode = mode
        self.storage_slots = storage_slots
        self.rankings = slot_rankings(serials, storage_slots)

    def slot(self, key: bytes, mark: int) -> int:
        if self.mode == "dialog" and mark:
            return xxhash.xxh3_64_intdigest(mark.to_bytes(8, "big")) % self.storage_slots
        # stripe, or no mark given: the chunk digest picks the slot (all layers of a chunk together)
        return xxhash.xxh3_64_intdigest(key[9:25]) % self.storage_slots

    def ranking(self, key: bytes, mark: int) -> list[int]:
        return self.rankings[self.slot(key, mark)]

    def card(self, key: bytes, mark: int) -> Optional[int]:
        """The owner of the key's slot (in service or not)."""
        r = self.ranking(key, mark)
        return r[0] if r else None
