"""Placement: which card holds a key, computed by every gateway on its own.

``storage_slots`` slots are assigned to cards by serial number (balanced
rendezvous hashing, see ``slot_rankings``), so the order of the cards in the
configuration does not matter, every card owns its share of the slots, and a new
card takes about its share. A key goes to the first card of its slot's
ranking that is in service (its replicas to the next ones): ``CardPlacement`` over
the cards in service, ``PreviousPlacement`` during a card-set change; both are told which
cards are in service (``active``: ``CardService.active``, the snapshot the caller takes once
per batch) and never ask for it themselves. ``dialog``
placement picks the slot from the dialog mark (all blocks of a dialog on one
card); ``stripe`` from the chunk itself (one long restore reads all cards).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from typing import Callable, Optional, Sequence

import numpy as np
import xxhash

from adpkv_gateway.cards.base import Card

_DIGEST = operator.itemgetter(slice(9, 25))       # a key's chunk digest (adpkv_core.keys)


def slot_rankings(serials: Sequence[Optional[str]], storage_slots: int) -> list[list[int]]:
    """For each slot, the indices of the cards with a known serial, owner first.

    Owners are balanced: every (slot, card) pair gets a score hash(serial, slot); pairs are
    taken best score first and a slot goes to its card while that card owns fewer than
    floor(slots / cards) slots, then the remaining slots the same way up to the ceiling. Scores depend only on serials, so a new card takes the
    slots where it scores best, about its share. After the owner, a slot ranks the other
    cards by score (where its keys go while the owner is out of service).
    """
    known = [i for i, s in enumerate(serials) if s]
    if not known:
        return [[] for _ in range(storage_slots)]
    score = {(slot, i): xxhash.xxh3_64_intdigest(f"{serials[i]}/{slot}".encode())
             for slot in range(storage_slots) for i in known}
    pairs = sorted(score.items(), key=lambda kv: (-kv[1], serials[kv[0][1]], kv[0][0]))
    owner: dict[int, int] = {}
    owned = dict.fromkeys(known, 0)
    # first every card up to floor(slots / cards), then the rest up to the ceiling
    for cap in (storage_slots // len(known), -(-storage_slots // len(known))):
        for (slot, i), _ in pairs:
            if slot not in owner and owned[i] < cap:
                owner[slot] = i
                owned[i] += 1
    return [[owner[slot]] + sorted((i for i in known if i != owner[slot]),
                                   key=lambda i: (-score[(slot, i)], serials[i]))
            for slot in range(storage_slots)]


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

    def slots(self, keys: Sequence[bytes], marks: Optional[Sequence[int]]) -> np.ndarray:
        """``slot`` of every key of a batch at once (``int64``): each distinct dialog mark
        hashed once, the chunk digests of the others hashed in one pass of C calls (no Python
        code a key: a 16,384-key EXIST places its keys in about a millisecond)."""
        n = len(keys)
        if self.mode == "dialog" and marks:
            of_mark = {m: self.slot(b"", m) for m in set(marks) if m}
            out = np.fromiter(map(of_mark.get, marks, itertools.repeat(-1)), np.int64, n)
            unmarked = np.flatnonzero(out < 0)
            if unmarked.size:
                out[unmarked] = self._digest_slots([keys[i] for i in unmarked.tolist()])
            return out
        return self._digest_slots(keys)

    def _digest_slots(self, keys: Sequence[bytes]) -> np.ndarray:
        digests = np.fromiter(map(xxhash.xxh3_64_intdigest, map(_DIGEST, keys)), np.uint64, len(keys))
        return (digests % np.uint64(self.storage_slots)).astype(np.int64)

    def ranking(self, key: bytes, mark: int) -> list[int]:
        return self.rankings[self.slot(key, mark)]


class PreviousPlacement:
    """The placement of the layout a card-set change moves from, over the cards of this
    gateway that it names (a card no longer configured holds nothing for it)."""

    def __init__(self, serials: Sequence[str], cards: Sequence[Card], storage_slots: int, mode: str,
                 replicas: int):
        here = {c.serial: i for i, c in enumerate(cards) if c.serial}
        self.serials = list(serials)
        self.placement = Placement(self.serials, storage_slots, mode)
        self.card_of = [here.get(s) for s in self.serials]      # its index -> the card's index here
        self.replicas = max(1, replicas)

    def targets(self, key: bytes, mark: int, active: Sequence[bool]) -> list[int]:
        """The cards here that held the key's replicas in the previous layout, in service."""
        out = []
        for i in self.placement.ranking(key, mark)[:self.replicas]:
            c = self.card_of[i]
            if c is not None and active[c]:
                out.append(c)
        return out


class CardPlacement:
    """Where the objects of this gateway's cards go now: the ``Placement`` over the cards whose
    serial is known and not ``left_out`` (drained: read, never placed on), the fingerprint of
    that key layout, and during a card-set change the placement moved from (``previous``, set
    by ``gateway/layout``) with what a hit found there reports (``on_previous_hit``)."""

    def __init__(self, cards: Sequence[Card], storage_slots: int, num_dbs: int, mode: str, fragment_size: int,
                 replicas: int):
        self.cards = cards
        self.storage_slots = storage_slots
        self.num_dbs = num_dbs
        self.mode = mode
        self.fragment_size = fragment_size
        self.replicas = max(1, replicas)
        self.left_out: frozenset[str] = frozenset()
        self.previous: Optional[PreviousPlacement] = None
        self.on_previous_hit: Callable[[bytes, int, int], None] = lambda key, mark, card: None
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute placement over the cards whose serial is known and not ``left_out``
        (atomic swap)."""
        serials = [c.serial if c.serial and c.serial not in self.left_out else None for c in self.cards]
        self.current = Placement(serials, self.storage_slots, self.mode)
        self.fingerprint = key_layout_fingerprint([s for s in serials if s], self.storage_slots,
                                                  self.num_dbs, self.mode, self.fragment_size)

    def targets(self, key: bytes, mark: int, n: int, active: Sequence[bool]) -> list[int]:
        """The first ``n`` cards in service (``active``) for a key, in placement order."""
        out = []
        for i in self.current.ranking(key, mark):
            if active[i]:
                out.append(i)
                if len(out) == n:
                    break
        return out

    def replica_cards(self, slot: int, active: Sequence[bool]) -> list[int]:
        """The replica cards of a slot: the first ``replicas`` of its ranking in service (``active``)."""
        return [c for c in self.current.rankings[slot] if active[c]][:self.replicas]
