"""The object store: all cards of one gateway seen as one key-value store of objects, and the
operations of a request batch over them. A thin facade over its parts, each one role:

- ``service``   which cards are in service (``service.CardService``; the health monitor takes
                cards out through it and brings them back)
- ``placement`` where an object's replicas go now and during a card-set change
                (``placement.CardPlacement``)
- ``plan``      an object's fragments on a card (``plan.FragmentPlan``)
- ``lookup``    which card holds each object whole (``lookup.Lookup``: the ``Holder`` rows)
- ``io``        accounted card I/O with the replica fallback, writes and removals (``card_io.CardIO``)
- ``pins``      the keys pinned now (``pins.Pins``); ``stats`` each card's I/O counters;
                ``counters`` each namespace's object counters (the loop's thread)

The operations here are a batch's (on the I/O pool): a GET's lookup and reads (``plan_reads``,
then ``io.read_many``, ``io.read_to_fds`` ...), a PUT's (``put``: which exist, where, the writes),
MAP's verified files (``open_verified``), EXIST (``lookup.exists``), DELETE, CLEAN. On the GET and
PUT paths nothing but the store calls a card; every batch's I/O answers an ``Outcome`` per object.

An object lives and dies whole: it is present on a card only when every fragment is there at
its size (the head records the object's size for lookups that do not know it); the rules that
keep it whole under failed reads, racing writes and removals are ``card_io``'s.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence

from adpkv_gateway.cards.base import Card, DirectReads, DirectWrites, Read
from adpkv_gateway.store.card_io import CardIO, OpenedFile, Outcome, PutSource
from adpkv_gateway.store.card_stats import CardStats
from adpkv_gateway.store.lookup import Lookup
from adpkv_gateway.store.pins import Pins
from adpkv_gateway.store.placement import CardPlacement
from adpkv_gateway.store.plan import Fragment, FragmentPlan
from adpkv_gateway.store.service import CardObserver, CardService


@dataclasses.dataclass
class ReadPlan:
    """A GET batch's reads (``ObjectStore.plan_reads``): ``(j, fragment)`` for each fragment
    of each object ``j`` found, an object's fragments one after the other; ``direct``: those
    whose card reads into a client's region itself (``cards.base.DirectReads``, asked for), the
    others go through the ring."""

    ring: list[tuple[int, Fragment]]
    direct: list[tuple[int, Fragment]]

    def found(self) -> set[int]:
        return {j for j, _ in self.ring} | {j for j, _ in self.direct}


class PutItem(NamedTuple):
    """One object of a PUT batch for ``ObjectStore.put``."""

    j: int
    key: bytes
    mark: int
    source: PutSource


class ObjectStore:
    """All cards of one gateway, seen as one key-value store of objects (see the module)."""

    def __init__(self, cards: Sequence[Card], storage_slots: int, num_dbs: int, placement: str,
                 fragment_size: int, spread: bool, replicas: int, observer: CardObserver, pins: Pins):
        self.cards = list(cards)
        self.stats = [CardStats() for _ in self.cards]
        self.pins = pins
        self.service = CardService(self.cards, observer)
        self.plan = FragmentPlan(num_dbs, fragment_size, spread, placement)
        self.placement = CardPlacement(self.cards, storage_slots, num_dbs, placement, fragment_size, replicas)
        self.lookup = Lookup(self.cards, self.service, self.placement, self.plan)
        self.io = CardIO(self.cards, self.service, self.plan, self.stats)
        # by namespace: hits, misses, stored, store_failed, restored_bytes, stored_bytes (the loop's thread only)
        self.counters: collections.defaultdict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def plan_reads(self, keys: Sequence[bytes], marks: Optional[Sequence[int]], object_bytes: int,
                   into_region: bool) -> ReadPlan:
        """A GET batch's lookup and its reads: ``lookup.holders``, then ``plan.read_plans``;
        with ``into_region``, the fragments whose card reads into a client's region itself
        are ``direct``."""
        plans = self.plan.read_plans(self.lookup.holders(keys, marks, object_bytes), keys, marks, object_bytes)
        if not into_region:
            return ReadPlan(plans, [])
        cards = self.cards
        ring: list[tuple[int, Fragment]] = []
        direct: list[tuple[int, Fragment]] = []
        for item in plans:
            (direct if isinstance(cards[item[1].card], DirectReads) else ring).append(item)
        return ReadPlan(ring, direct)

    def write_plans(self, key: bytes, mark: int, object_bytes: int, active: Sequence[bool]) -> list[list[Fragment]]:
        """One fragment list per replica (cards in service: ``active``, ``service.active`` taken
        once for a batch; in placement order)."""
        tag = self.plan.slot_tag(mark)
        return [self.plan.fragments(c, key, object_bytes, tag)
                for c in self.placement.targets(key, mark, self.placement.replicas, active)]

    def put(self, items: Sequence[PutItem], object_bytes: int) -> list[Outcome]:
        """Store the objects of (part of) a PUT batch: which exist already (``exists``: keys
        name content, an object stored under its key holds these bytes), the replica cards
        of each other one, and its write to all of them: straight from a client's region
        (``DirectWrites.write_from_fd``) when every one of those cards is ``DirectWrites`` and
        the source is a region, else from the ring (``PutSource.view``). An object with no
        card in service is not stored."""
        found = self.lookup.exists([it.key for it in items], [it.mark for it in items], object_bytes)
        active = self.service.active
        out = []
        for item, there in zip(items, found):
            if there:
                out.append(Outcome(item.j, True, existed=True))
                continue
            plans = self.write_plans(item.key, item.mark, object_bytes, active)
            if not plans:
                out.append(Outcome(item.j, False))
                continue
            region = item.source.region()
            if region is not None and all(isinstance(self.cards[f.card], DirectWrites) for frags in plans for f in frags):
                # the engine's region -> the card in one copy, by its descriptor (no ring)
                ok = self.io.write_from_fd(plans, region, object_bytes)
            else:
                view = item.source.view()
                ok = view is not None and self.io.write_replicas(plans, view)
            out.append(Outcome(item.j, ok))
        return out

    def open_verified(self, keys: Sequence[bytes], marks: Optional[Sequence[int]], object_bytes: int,
                      check: Callable[[list[OpenedFile]], list[Read]]) -> list[Optional[int]]:
        """For MAP: for each object, a read-only descriptor of its own file, verified in place
        (``CardIO.open_verified``), or None; only objects of one fragment. Contract: the caller
        has checked that every key is of a namespace the asker owns."""
        if len(self.plan.extents(object_bytes)) != 1:
            return [None] * len(keys)
        return self.io.open_verified(keys, self.lookup.holders(keys, marks, object_bytes), check)

    def delete(self, keys: Sequence[bytes], marks: Optional[Sequence[int]]) -> int:
        """Remove objects (all their fragments) from their replica cards (and, during a card-set
        change, from their cards in the previous layout); how many existed (an object counts once,
        however many cards held a copy: its replicas, or both ends of a move)."""
        deleted = 0
        where = self.placement
        prev = where.previous
        active = self.service.active
        for i, key in enumerate(keys):
            mark = marks[i] if marks else 0
            tag = self.plan.slot_tag(mark)
            cards = where.targets(key, mark, where.replicas, active)
            if prev is not None:           # during a card-set change: its copy on its previous card too
                cards += [c for c in prev.targets(key, mark, active) if c not in cards]
            existed = False
            for card_index in cards:
                existed = self.io.delete(card_index, key, tag) or existed
            deleted += existed
        return deleted

    def clean(self) -> int:
        """CLEAN: empty every card in service; how many objects it removed."""
        return sum(card.clean() for i, card in enumerate(self.cards) if self.service.in_service(i))

    # ------------------------------------------------------------------ counters (the loop's thread)
    def count_reads(self, namespace: str, hits: int, objects: int, object_bytes: int) -> None:
        """A GET batch of ``objects`` objects of ``object_bytes`` found ``hits`` of them."""
        counters = self.counters[namespace]
        counters["hits"] += hits
        counters["misses"] += objects - hits
        counters["restored_bytes"] += hits * object_bytes

    def count_writes(self, namespace: str, stored: int, objects: int, object_bytes: int) -> None:
        """A PUT batch of ``objects`` objects of ``object_bytes`` stored ``stored`` of them."""
        counters = self.counters[namespace]
        counters["stored"] += stored
        counters["store_failed"] += objects - stored
        counters["stored_bytes"] += stored * object_bytes
