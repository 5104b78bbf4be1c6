"""Placement: which card holds a key, computed by every gateway on its own.

``storage_slots`` slots are assigned to cards by serial number (rendezvous
hashing: slot s goes to the card with the highest hash of (serial, s)), so the
order of the cards in the configuration does not matter and a new card takes
only its share of the slots. ``dialog`` placement picks the slot from the
dialog mark (all blocks of a dialog on one card); ``stripe`` from the chunk
itself (one long restore reads all cards).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import xxhash


def slot_owners(serials: Sequence[str], storage_slots: int) -> list[int]:
    """For each slot, the index (into ``serials``) of the card that owns it."""
    if not serials:
        raise ValueError("no cards")
    owners = []
    for slot in range(storage_slots):
        scores = [xxhash.xxh3_64_intdigest(f"{serial}/{slot}".encode()) for serial in serials]
        owners.append(max(range(len(serials)), key=scores.__getitem__))
    return owners


def key_layout_fingerprint(serials: Sequence[str], storage_slots: int, num_dbs: int, placement: str,
                           fragment_size: int = 0) -> str:
    """16 hex digits over everything that decides where a key lives."""
    canon = "|".join(sorted(serials)) + f"#{storage_slots}#{num_dbs}#{placement}#{fragment_size}"
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


class Placement:
    """Maps (key, dialog mark) to a card index."""

    def __init__(self, serials: Sequence[str], storage_slots: int, mode: str = "dialog"):
        if mode not in ("dialog", "stripe"):
            raise ValueError(f"unknown key_placement {mode!r}")
        self.mode = mode
        self.storage_slots = storage_slots
        self.owners = slot_owners(serials, storage_slots)

    def slot(self, key: bytes, mark: int) -> int:
        if self.mode == "dialog" and mark:
            return xxhash.xxh3_64_intdigest(mark.to_bytes(8, "big")) % self.storage_slots
        # stripe, or no mark given: the chunk digest picks the slot (all layers of a chunk together)
        return xxhash.xxh3_64_intdigest(key[9:25]) % self.storage_slots

    def card(self, key: bytes, mark: int) -> int:
        return self.owners[self.slot(key, mark)]
