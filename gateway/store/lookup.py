"""Lookups: which card in service holds each object of a batch whole, and the write its head
names there (``Holder``, the typed row a read is planned from), for GET, EXIST, MAP and a PUT's
"stored already". Card calls only to ask (``Card.heads_found``, ``Card.contains_many``),
accounted to the card's health when a card does not answer."""

from __future__ import annotations

import collections
from typing import NamedTuple, Optional, Sequence

import numpy as np

from adpkv_gateway.cards.base import Card, CardIOError, FirstExtent, NodeIOError
from adpkv_gateway.cards.fragments import head_dbs
from adpkv_gateway.store.card_io import log_io_error
from adpkv_gateway.store.placement import CardPlacement, PreviousPlacement
from adpkv_gateway.store.plan import FragmentPlan, Holder
from adpkv_gateway.store.service import CardService


class _Found(NamedTuple):
    """``Lookup._find``'s answer for a batch, by position: the card holding each object
    whole (-1: none), its head's write id there, its rank among the object's replica cards
    (-1: found through the previous placement), its slot; and each slot's replica cards."""

    card: np.ndarray
    write_id: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    replicas: dict[int, list[int]]


class Lookup:
    """The lookups of one gateway's cards (on the I/O pool; many at once)."""

    def __init__(self, cards: Sequence[Card], service: CardService, placement: CardPlacement, plan: FragmentPlan):
        self.cards = cards
        self.service = service
        self.placement = placement
        self.plan = plan

    def exists(self, keys: Sequence[bytes], marks: Optional[Sequence[int]],
               object_bytes: Optional[int] = None) -> list[bool]:
        """Whether each object is whole on a card in service that would serve it."""
        return (self._find(keys, marks, object_bytes).card >= 0).tolist()

    def holders(self, keys: Sequence[bytes], marks: Optional[Sequence[int]],
                object_bytes: Optional[int] = None) -> list[Optional[Holder]]:
        """For each object, where a read of it goes (``Holder``: the first of its replica cards
        in service that holds all of it, every fragment at the sizes ``object_bytes`` gives,
        or else the size its head records), or None."""
        found = self._find(keys, marks, object_bytes)
        out: list[Optional[Holder]] = [None] * len(keys)
        hit = np.flatnonzero(found.card >= 0)
        for i, card, write_id, rank, slot in zip(hit.tolist(), found.card[hit].tolist(), found.write_id[hit].tolist(),
                                                 found.rank[hit].tolist(), found.slot[hit].tolist()):
            out[i] = Holder(card, tuple(found.replicas[slot][rank + 1:]) if rank >= 0 else (), write_id)
        return out

    def _find(self, keys: Sequence[bytes], marks: Optional[Sequence[int]], object_bytes: Optional[int]) -> _Found:
        """``holders`` of a batch as arrays: the slots of all keys at once (``Placement.slots``),
        each slot's replica cards in service found once (the cards in service: one snapshot for
        the batch), then per replica rank one ``Card.heads_found`` per card for the keys still
        missing there."""
        n = len(keys)
        where = self.placement
        replicas_n = where.replicas
        active = self.service.active
        slots = where.current.slots(keys, marks)
        replicas = {s: where.replica_cards(s, active) for s in set(slots.tolist())}
        by_rank = np.full((where.storage_slots, replicas_n), -1, np.int64)    # slot, rank -> card
        for s, cards in replicas.items():
            by_rank[s, :len(cards)] = cards
        found = _Found(np.full(n, -1, np.int64), np.zeros(n, np.uint64), np.full(n, -1, np.int64), slots, replicas)
        if not n:
            return found
        all_keys = np.array(keys, dtype=object)
        dbs = head_dbs(keys, self.plan.num_dbs)
        tags = self.plan.slot_tags(marks, n)
        pending = np.arange(n)
        for r in range(replicas_n):
            on = by_rank[slots[pending], r]
            for card in set(on.tolist()) - {-1}:
                idx = pending[on == card]
                whole, write_ids = self._whole(card, all_keys[idx].tolist(), dbs[idx], object_bytes, tags[idx].tolist())
                hit = idx[whole]
                found.card[hit], found.write_id[hit], found.rank[hit] = card, write_ids[whole], r
            pending = pending[found.card[pending] < 0]
            if not pending.size:
                break
        prev = where.previous
        if pending.size and prev is not None:
            self._previous_holders(prev, active, keys, marks, object_bytes, all_keys, dbs, tags, found,
                                   pending.tolist())
        return found

    def _previous_holders(self, prev: PreviousPlacement, active: Sequence[bool], keys: Sequence[bytes],
                          marks: Optional[Sequence[int]], object_bytes: Optional[int], all_keys: np.ndarray,
                          dbs: np.ndarray, tags: np.ndarray, found: _Found, pending: list[int]) -> None:
        """During a card-set change: look the objects that missed up on their cards of the
        previous placement (those not asked already); a hit is served from there (``found``, no
        other replicas) and reported to ``on_previous_hit`` (the mover moves it to its card now)."""
        by_card: dict[int, list[int]] = collections.defaultdict(list)
        for i in pending:
            asked = found.replicas[int(found.slot[i])]
            for c in prev.targets(keys[i], marks[i] if marks else 0, active):
                if c not in asked:
                    by_card[c].append(i)
                    break
        for card, idx in by_card.items():
            at = np.array(idx, np.int64)
            whole, write_ids = self._whole(card, all_keys[at].tolist(), dbs[at], object_bytes, tags[at].tolist())
            hit = at[whole]
            found.card[hit], found.write_id[hit], found.rank[hit] = card, write_ids[whole], -1
            for i in hit.tolist():
                self.placement.on_previous_hit(keys[i], marks[i] if marks else 0, card)

    def _whole(self, card: int, keys: list[bytes], dbs: np.ndarray, object_bytes: Optional[int],
               tags: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(whether each object has all its fragments on ``card``, the write id its head
        carries there); a card that fails to answer holds none of them. The heads and
        whether each holds its first extent come in one call (``Card.heads_found``: one index
        lookup on the fs card, one round trip per server on the resp and cluster cards); only
        objects of several fragments need a second, for their other fragments."""
        c = self.cards[card]
        frag = self.plan.fragment_size
        try:
            heads = c.heads_found(keys, dbs, FirstExtent(object_bytes, frag), tags)
            whole = heads.found.copy()
            if object_bytes is not None:
                # A head that records another size than a GET asks is another object (a GET at a
                # smaller size must not take a larger object's first fragments).
                whole &= heads.size == object_bytes
            if frag > 0:
                sizes = heads.size if object_bytes is None else np.full(len(keys), object_bytes, np.int64)
                several = np.flatnonzero(whole & (sizes > frag))
                if several.size:
                    whole[several] = self._rest_held(c, keys, several.tolist(), sizes, tags)
        except CardIOError as exc:
            log_io_error(exc)
            self.service.observe(card, isinstance(exc, NodeIOError), 0.0)
            return np.zeros(len(keys), bool), np.zeros(len(keys), np.uint64)
        return whole, heads.write_id

    def _rest_held(self, c: Card, keys: list[bytes], which: list[int], sizes: np.ndarray,
                   tags: list[bytes]) -> list[bool]:
        """Whether the objects ``which`` (of ``keys``, of ``sizes``: several fragments each,
        their heads checked) hold every other fragment at its length on card ``c``."""
        cuts: dict[int, list[tuple[int, int]]] = {}       # object size -> its fragment extents
        items: list[tuple[int, bytes]] = []
        lengths: list[Optional[int]] = []
        item_tags: list[bytes] = []
        spans = []
        for i in which:
            size = int(sizes[i])
            extents = cuts.get(size)
            if extents is None:
                extents = cuts[size] = self.plan.extents(size)
            start = len(items)
            for db, fkey, _, length in self.plan.layout(keys[i], extents)[:-1]:
                items.append((db, fkey))
                lengths.append(length)
            item_tags.extend([tags[i]] * (len(items) - start))
            spans.append((start, len(items)))
        found = c.contains_many(items, lengths, item_tags)
        return [all(found[a:b]) for a, b in spans]
