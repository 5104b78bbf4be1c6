"""The object store: objects → fragments → (card, database), placement over the
cards in service, replicas, pins and I/O counters.

The server asks it where an object's fragments live and runs their I/O on its
thread pool; the store does the card calls, keeps the statistics and reports
every card command's outcome to its ``CardObserver`` (the health monitor), which
says when a card must leave service; which cards are in service is the store's
(``take_out``, ``bring_back``).

The interface the rest of the gateway uses (on the GET and PUT paths nothing else calls a card):
a GET batch's lookup and reads (``plan_reads``, then ``read_many``, ``read_to_fds`` and
``direct_replicas`` into a client's region, ``process_reads``/``process_reads_done`` around
the I/O processes, ``read_from_replicas``), a PUT batch's (``put``: which exist, where, the
writes), MAP's read-only files, verified in place (``open_verified``), EXIST (``exists``),
DELETE, CLEAN, the pins, which cards are in service, the namespace counters (``count_reads``,
``count_writes``), and the mover's (``listed_heads``, ``keys_by_tag``; on one object of one
card ``recorded_head``, ``read_object``, ``write_copies``, ``remove_object``, ``remove_write``). Every batch's
I/O answers an ``Outcome`` per object.

An object lives and dies whole: it is present on a card only when every fragment
is there at its size (the head records the object's size for lookups that do not
know it); a read whose verdict is evidence about the object (``Read.drops``: missing,
corrupt) removes the whole object from that card (the next PUT stores it again) and
reads the fragment from the next replica; any other miss (transient, I/O error,
another write's fragment) removes nothing; a write that fails halfway removes what it
wrote.

One writer's bytes: every write of an object draws a write id that all its fragments
carry; a lookup (``holders``) learns the head's, and every fragment is read against it,
so a hit is one write's whole object. Writes of one object (on one card) through this
gateway are serialized (``_write_locks``), so two racing writers leave the later one's
whole object, never a mix of both.

Removals (issue 40): a removal decided about one write of an object (a read's verdict, the
mover's copy) runs under that object's write lock and only while its head still records
that write (``remove_write``), and DELETE holds the lock too: none removes a later write
of the key through this gateway, or part of one in flight.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import logging
import os
import threading
import zlib
from typing import Callable, Collection, NamedTuple, Optional, Sequence

import numpy as np

from adpkv_gateway.cards.fragments import (
    db_hash, fragment_db, fragment_dbs, fragment_extents, fragment_key, head_dbs, object_key
)
from adpkv_gateway.store.card_stats import CardStats

from adpkv_gateway.cards.base import (
    BatchedReads, Card, CardIOError, DirectReads, DirectWrites, DropsItself, FirstExtent, HandsFiles, Head,
    IOProcessReads, KeysByTag, Listed, NodeIOError, NoProcessRead, PlacedFile, ProcessRead, Read
)
from adpkv_gateway.cards.objfmt import new_write_id
from adpkv_gateway.store.placement import Placement, key_layout_fingerprint

logger = logging.getLogger("adpkv.gateway.store")



def _log_io_error(exc: CardIOError) -> None:
    """A node of a cluster card that does not answer is logged once by the card; the
    failed commands (many, until the cluster fails over) only at debug level."""
    logger.log(logging.DEBUG if isinstance(exc, NodeIOError) else logging.WARNING, "%s", exc)


class Fragment(NamedTuple):
    """One fragment of an object on one card (a named tuple: a GET plans one per fragment of
    every object of a batch at once, so it must be cheap to make; ``_replace`` for a copy)."""

    card: int
    db: int
    fkey: bytes
    offset: int     # within the object
    length: int
    object_bytes: int = 0                 # size of the whole object
    others: tuple[int, ...] = ()          # replica cards to read it from when ``card`` misses
    slot_tag: Optional[bytes] = b""       # its object's slot tag (``ObjectStore.slot_tag``), given to the card;
    #                                       None: not known (a move's object whose head records none)
    write_id: Optional[int] = None        # the write its head named at lookup: every fragment must be of it


_fragment = functools.partial(tuple.__new__, Fragment)     # Fragment(*fields) without its Python __new__


class Holder(NamedTuple):
    """Where a read of an object goes (``holders``, a GET's lookup): the first of its replica
    cards in service that holds all of it, the other replica cards a read may fall back on, and
    the write id the object's head carries there (its fragments are read against it)."""

    card: int
    others: tuple[int, ...]
    write_id: Optional[int]


class _Written(NamedTuple):
    """One card write of one fragment (``ObjectStore._card_write``): stored, and whether the
    card answered at all (a transport failure leaves nothing known about what it holds)."""

    ok: bool
    transport_ok: bool


class _Found(NamedTuple):
    """``ObjectStore._lookup``'s answer for a batch, by position: the card holding each object
    whole (-1: none), its head's write id there, its rank among the object's replica cards
    (-1: found through the previous placement), its slot; and each slot's replica cards."""

    card: np.ndarray
    write_id: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    replicas: dict[int, list[int]]


class Outcome(NamedTuple):
    """What an I/O task did for one object of a batch: ``j`` its index in the batch; ``ok``:
    found and still good (GET), stored (PUT); ``existed``: a PUT found it stored already and
    wrote nothing (``ok`` too)."""

    j: int
    ok: bool
    existed: bool = False


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


class RegionBytes(NamedTuple):
    """An object's bytes in a client's region (``door.Region``): its descriptor, the object's
    offset there, and the monotonic time the client gives up at (None: never)."""

    fd: int
    offset: int
    read_by: Optional[float]


class OpenedFile(NamedTuple):
    """A placed object's file the store opened read-only for MAP (``ObjectStore.open_verified``),
    as its check in place sees it: the descriptor, the fragment key its header must name, and
    the write id the object's head carries (None: any)."""

    fd: int
    fkey: bytes
    write_id: Optional[int]


class PutSource(abc.ABC):
    """Where the bytes of an object a PUT stores are (``gateway/datapath/region_io.py``: the ring, a
    client's region). Contract: called on the I/O pool, once per object at most each."""

    @abc.abstractmethod
    def region(self) -> Optional[RegionBytes]:
        """The bytes in a client's region that a ``DirectWrites`` card reads itself, or
        None when they are not (the ring, a scattered region)."""

    @abc.abstractmethod
    def view(self) -> Optional[memoryview]:
        """The object's bytes in the ring (from a region: read into its ring slot first), or
        None when they cannot be had (a region shorter than the object, the client gave up):
        nothing is stored."""


class PutItem(NamedTuple):
    """One object of a PUT batch for ``ObjectStore.put``."""

    j: int
    key: bytes
    mark: int
    source: PutSource


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


WRITE_LOCKS = 4096          # stripes of the per-object write serialization


class CardObserver(abc.ABC):
    """What watches the cards' I/O through the store (``gateway/store/health.py``'s ``CardHealth``),
    given to the store when it is made.

    Contract: the store calls ``io``/``ios`` after card commands, from its I/O threads (many
    at once) and from the gateway's loop (an I/O process's task): they must be quick, take
    no card I/O and call nothing of the store. When one answers a reason, the store takes
    the card out of service (if it still is) and calls ``left`` with it, under the store's
    lock of the in-service flags (so ``left`` must not call the store either)."""

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
        """Card ``card`` has just left service (``ObjectStore.take_out``): ``by_io`` when its
        I/O took it out (``io``/``ios``), else a failed check."""


class Pins:
    """The keys pinned now (a GET with ``lock``), counted: a key stays pinned until every pin
    on it is dropped. Made before the cards (an fs card's eviction passes pinned objects
    over, from its first scan on) and given to the store, which is the way to it."""

    def __init__(self) -> None:
        self._pins: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def pin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                n = self._pins.get(key, 0)
                if n <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] = n - 1

    def holds(self, key: bytes) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._pins)


class ObjectStore:
    """All cards of one gateway, seen as one key-value store of objects."""

    def __init__(self, cards: Sequence[Card], storage_slots: int, num_dbs: int, placement: str,
                 fragment_size: int, spread: bool, replicas: int, observer: CardObserver, pins: Pins):
        self.cards = list(cards)
        self.num_dbs = num_dbs
        self.storage_slots = storage_slots
        self.placement_mode = placement
        self.fragment_size = fragment_size
        self.spread = spread
        self.replicas = max(1, replicas)
        self._active = [bool(c.serial) for c in self.cards]     # in service (``take_out``, ``bring_back``)
        self._service_lock = threading.Lock()
        self.stats = [CardStats() for _ in self.cards]
        self.observer = observer
        self.pins = pins
        # by namespace: hits, misses, stored, store_failed, restored_bytes, stored_bytes (server thread only)
        self.counters: collections.defaultdict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        # a card-set change (gateway/layout/record.py, gateway/layout/mover.py): the placement moved from
        self.previous: Optional[PreviousPlacement] = None
        self.on_previous_hit: Callable[[bytes, int, int], None] = lambda key, mark, card: None
        self.left_out: frozenset[str] = frozenset()       # serials of drained cards: read, never placed on
        # writes of one object to one card run one after the other (striped by object key)
        self._write_locks = [threading.Lock() for _ in range(WRITE_LOCKS)]
        self.rebuild_placement()

    # ------------------------------------------------------------------ service
    @property
    def active(self) -> tuple[bool, ...]:
        """Whether each card is in service now (a snapshot)."""
        return tuple(self._active)

    def in_service(self, card: int) -> bool:
        return self._active[card]

    def take_out(self, card: int, why: str, by_io: bool = False) -> None:
        """Take a card out of service (its I/O, through the observer, or a failed check);
        the observer hears of it (``CardObserver.left``) once, when it was in service."""
        with self._service_lock:
            if not self._active[card]:
                return
            self._active[card] = False
            self.observer.left(card, why, by_io)

    def bring_back(self, card: int) -> None:
        """Put a card (back) in service: it answered its check."""
        with self._service_lock:
            self._active[card] = True

    def _observe(self, card: int, transport_ok: bool, seconds: float) -> None:
        """Tell the observer of one command of ``card``; take the card out when it says so."""
        why = self.observer.io(card, transport_ok, seconds)
        if why is not None:
            self.take_out(card, why, by_io=True)

    def observe_many(self, card: int, seconds: Sequence[float], failed: Collection[int] = ()) -> None:
        """``_observe`` of many commands of one card in their order (an I/O process's task)."""
        why = self.observer.ios(card, seconds, failed)
        if why is not None:
            self.take_out(card, why, by_io=True)

    def rebuild_placement(self) -> None:
        """Recompute placement over the cards whose serial is known and not ``left_out``
        (atomic swap)."""
        serials = [c.serial if c.serial and c.serial not in self.left_out else None for c in self.cards]
        self.placement = Placement(serials, self.storage_slots, self.placement_mode)
        self.fingerprint = key_layout_fingerprint([s for s in serials if s], self.storage_slots,
                                                  self.num_dbs, self.placement_mode, self.fragment_size)

    # ------------------------------------------------------------------ layout
    def targets(self, key: bytes, mark: int, n: int = 1) -> list[int]:
        """The first ``n`` cards in service for a key, in placement order."""
        out = []
        for i in self.placement.ranking(key, mark):
            if self._active[i]:
                out.append(i)
                if len(out) == n:
                    break
        return out

    def slot_tag(self, mark: int) -> bytes:
        """The slot tag the cards get with every fragment of an object (see ``cards.base``):
        with ``dialog`` placement its dialog mark, so that a card that groups keys (a Redis
        Cluster's hash tag) keeps a dialog together; else (``stripe``, or no mark) none, and
        such a card groups the fragments of each object alone. The same object gets the same
        tag at PUT, EXIST, GET and DELETE, as its placement."""
        return mark.to_bytes(8, "big") if self.placement_mode == "dialog" and mark else b""

    def _layout(self, key: bytes, extents: Sequence[tuple[int, int]]) -> list[tuple[int, bytes, int, int]]:
        """``(db, fragment key, offset, length)`` of each fragment of an object cut into
        ``extents``, fragment 0 last (written last: its presence means the object is whole)."""
        dbs = fragment_dbs(key, len(extents), self.num_dbs, self.spread)
        parts = [(dbs[i], fragment_key(key, i), off, ln) for i, (off, ln) in enumerate(extents)]
        return parts[1:] + parts[:1]

    def _frags(self, card: int, key: bytes, object_bytes: int, tag: Optional[bytes] = b"") -> list[Fragment]:
        return [Fragment(card, db, fkey, off, ln, 0, (), tag)
                for db, fkey, off, ln in self._layout(key, fragment_extents(object_bytes, self.fragment_size))]

    def _read_plans(self, holders: Sequence[Optional[Holder]], keys: Sequence[bytes], marks: Optional[Sequence[int]],
                   object_bytes: int) -> list[tuple[int, Fragment]]:
        """The fragments to read, for a batch's objects at once: ``(j, fragment)`` for each
        fragment of each object ``j`` that ``holders`` found (on that card; its other replica
        cards ride along for ``read_many`` to fall back on), an object's fragments one after
        the other. One call per batch (``plan_reads``): the fragment extents are cut once, each
        object's databases hashed once, each ``Fragment`` made by ``tuple.__new__``."""
        extents = fragment_extents(object_bytes, self.fragment_size)
        # per fragment, in read order (fragment 0 last, as ``_layout``): its index's key suffix,
        # the step from the object's first database, offset and length
        order = list(range(1, len(extents))) + [0]
        cut = [(fragment_key(b"", i), i if self.spread else 0, *extents[i]) for i in order]
        dbs = self.num_dbs
        tags = [self.slot_tag(m) for m in marks] if self.placement_mode == "dialog" and marks else None
        out: list[tuple[int, Fragment]] = []
        add = out.append
        for j, holder in enumerate(holders):
            if holder is None:
                continue
            c, others, write_id, key = holder.card, holder.others, holder.write_id, keys[j]
            tag = tags[j] if tags else b""
            h = db_hash(key)                                  # once per object
            for suffix, step, off, ln in cut:
                add((j, _fragment((c, (h + step) % dbs, key + suffix, off, ln, object_bytes, others, tag,
                                   write_id))))
        return out

    def plan_reads(self, keys: Sequence[bytes], marks: Optional[Sequence[int]], object_bytes: int,
                   into_region: bool) -> ReadPlan:
        """A GET batch's lookup and its reads (on the pool): ``holders``, then ``_read_plans``;
        with ``into_region``, the fragments whose card reads into a client's region itself
        are ``direct``."""
        plans = self._read_plans(self.holders(keys, marks, object_bytes), keys, marks, object_bytes)
        if not into_region:
            return ReadPlan(plans, [])
        cards = self.cards
        ring: list[tuple[int, Fragment]] = []
        direct: list[tuple[int, Fragment]] = []
        for item in plans:
            (direct if isinstance(cards[item[1].card], DirectReads) else ring).append(item)
        return ReadPlan(ring, direct)

    def direct_replicas(self, frag: Fragment) -> list[Fragment]:
        """Where a read of ``frag`` straight into a client's region may go, in order: its card,
        then each other replica card in service that reads into regions (``DirectReads``)."""
        return [frag] + [frag._replace(card=c, others=()) for c in frag.others
                         if self._active[c] and isinstance(self.cards[c], DirectReads)]

    def open_verified(self, keys: Sequence[bytes], marks: Optional[Sequence[int]], object_bytes: int,
                      check: Callable[[list[OpenedFile]], list[Read]]) -> list[Optional[int]]:
        """For MAP (on the pool): for each object, a read-only descriptor of its own file, verified
        in place, that the caller now owns (to hand and close), or None. Only an object of one
        fragment, on the card ``holders`` finds it on, when that card hands files
        (``HandsFiles.open_placed``, read-only, of the placed file); ``check``
        gives the verdict on each file opened (``direct_reads.verify_in_place``: header, size,
        the head's write id, the payload's checksum, where the file lies). A file whose verdict
        is not ``HIT`` is closed, never handed, and its verdict goes to its card as a failed
        read's does (``HandsFiles.placed_checked``: a corrupt object is removed). Contract: the
        caller has checked that every key is of a namespace the asker owns."""
        out: list[Optional[int]] = [None] * len(keys)
        if len(fragment_extents(object_bytes, self.fragment_size)) != 1:
            return out
        opened: list[tuple[int, HandsFiles, PlacedFile, OpenedFile]] = []
        for i, holder in enumerate(self.holders(keys, marks, object_bytes)):
            if holder is None:
                continue
            handing = self.cards[holder.card]
            if not isinstance(handing, HandsFiles):
                continue
            fkey = fragment_key(keys[i], 0)
            placed = handing.open_placed(fkey)
            if placed is not None:
                opened.append((i, handing, placed, OpenedFile(placed.fd, fkey, holder.write_id)))
        try:
            verdicts = check([item[3] for item in opened])
        except BaseException:
            for item in opened:
                os.close(item[2].fd)
            raise
        for (i, hands, placed, file), verdict in zip(opened, verdicts):
            if verdict is Read.HIT:
                out[i] = placed.fd
                continue
            os.close(placed.fd)
            hands.placed_checked(file.fkey, placed, verdict)
        return out

    def process_reads(self, card: int, frags: Sequence[Fragment]) -> list[ProcessRead]:
        """For each fragment of ``card``: what an I/O process can read (``IOProcessReads``:
        an ``cards.base.FileRead``), or why none does (``NoProcessRead``: every read of a card
        that is not ``IOProcessReads`` is ``HERE``, on the gateway's pool)."""
        c = self.cards[card]
        if not isinstance(c, IOProcessReads):
            return [NoProcessRead.HERE] * len(frags)
        return c.process_reads([f.fkey for f in frags], [f.write_id for f in frags])

    def process_reads_done(self, card: int, files: Sequence, lengths: Sequence[int],
                           misses: Sequence[tuple[int, Read]], seconds: Sequence[float]) -> None:
        """An I/O process read ``files`` of ``card`` (``lengths`` bytes each; ``misses``: the
        ``(k, verdict)`` of those that missed, ``seconds`` each read's): accounted as the
        pool's reads are (the card's statistics and health at once for the task, the card's
        own bookkeeping of each verdict)."""
        lost = sum(lengths[k] for k, _ in misses)
        self.stats[card].record_reads(seconds, sum(lengths) - lost, len(misses))
        self.observe_many(card, seconds, {k for k, verdict in misses if verdict.strike})
        c = self.cards[card]
        assert isinstance(c, IOProcessReads)      # only such a card hands reads to the processes
        for k, verdict in misses:
            c.process_read_result(files[k], verdict)

    def write_plans(self, key: bytes, mark: int, object_bytes: int) -> list[list[Fragment]]:
        """One fragment list per replica (cards in service, in placement order)."""
        tag = self.slot_tag(mark)
        return [self._frags(c, key, object_bytes, tag) for c in self.targets(key, mark, self.replicas)]

    # ------------------------------------------------------------------ I/O (thread pool)
    def _card_read(self, frag: Fragment, call: Callable[[Card], Read]) -> Read:
        """The verdict of one card read of one fragment, timed and accounted: the card's
        statistics, and its health (``Read.IO_ERROR`` is a strike; a failed node of a
        cluster is ``TRANSIENT``, no strike). A card that raises anything else answers
        ``TRANSIENT``: nothing is concluded about the object."""
        card = self.cards[frag.card]
        token = self.stats[frag.card].begin()
        try:
            verdict = call(card)
        except NodeIOError as exc:
            verdict = Read.TRANSIENT
            _log_io_error(exc)
        except CardIOError as exc:
            verdict = Read.IO_ERROR
            _log_io_error(exc)
        except Exception:
            logger.exception("read from card %s failed", card.serial)
            verdict = Read.TRANSIENT
        seconds = self.stats[frag.card].end(token, False, verdict is Read.HIT, frag.length)
        self._observe(frag.card, not verdict.strike, seconds)
        return verdict

    def _card_write(self, frag: Fragment, call: Callable[[Card], bool]) -> "_Written":
        """``(ok, transport ok)`` of one card write of one fragment, timed and accounted: the
        card's statistics, and its health (a transport failure is a strike, unless only one
        node of a cluster failed)."""
        card = self.cards[frag.card]
        token = self.stats[frag.card].begin()
        transport_ok, ok, strike = True, False, True
        try:
            ok = bool(call(card))
        except CardIOError as exc:
            transport_ok, strike = False, not isinstance(exc, NodeIOError)
            _log_io_error(exc)
        except Exception:
            logger.exception("write to card %s failed", card.serial)
        seconds = self.stats[frag.card].end(token, True, ok, frag.length)
        self._observe(frag.card, transport_ok or not strike, seconds)
        return _Written(ok, transport_ok)

    def _read(self, frag: Fragment, buf: memoryview) -> Read:
        """The verdict of one fragment's read."""
        # a tag not known (None) finds what is keyed without one: a card that keys by tag holds
        # no object without a recorded tag (the mover passes those over, ``keys_by_tag``)
        return self._card_read(frag, lambda card: card.read(frag.db, frag.fkey, buf, frag.slot_tag or b"",
                                                            frag.write_id))

    def read_to_fds(self, items, write_by: Optional[float] = None) -> list[Outcome]:
        """Read ``(j, fragment, descriptor, offset)`` items straight into a client's buffer
        (``DirectReads.read_to_fd``, nothing written at or after ``write_by``); an ``Outcome`` each,
        with statistics, health and removal of what the verdict shows broken as
        ``read_many``."""
        out = []
        for j, frag, fd, offset in items:
            def into(card: Card, f: Fragment = frag, d: int = fd, o: int = offset) -> Read:
                assert isinstance(card, DirectReads)      # plan_reads sends only such cards' fragments here
                return card.read_to_fd(f.db, f.fkey, f.length, d, o, write_by, f.write_id)
            verdict = self._card_read(frag, into)
            if verdict.drops:
                self._remove_broken(frag.card, object_key(frag.fkey), frag.object_bytes, frag.slot_tag,
                                    frag.write_id)
            out.append(Outcome(j, verdict is Read.HIT))
        return out

    def _read_batched(self, items) -> list[Read]:
        """The verdict of each ``(j, fragment, view)`` item: the fragments of a card with
        ``BatchedReads`` in one ``Card.read_many`` call, the others one by one."""
        res: list[Read] = [Read.TRANSIENT] * len(items)
        by_card: dict[int, list[int]] = collections.defaultdict(list)
        for i, (_, frag, view) in enumerate(items):
            if isinstance(self.cards[frag.card], BatchedReads):
                by_card[frag.card].append(i)
            else:
                res[i] = self._read(frag, view)
        for c, idx in by_card.items():
            card, stats = self.cards[c], self.stats[c]
            token = stats.begin()
            try:
                got = card.read_many([(items[i][1].db, items[i][1].fkey, items[i][2], items[i][1].slot_tag,
                                       items[i][1].write_id) for i in idx])
            except CardIOError as exc:
                got = [exc] * len(idx)
            except Exception:
                logger.exception("read from card %s failed", card.serial)
                got = [Read.TRANSIENT] * len(idx)
            share = stats.finish(token) / len(idx)      # timed as a whole: each its share
            logged = False
            for i, r in zip(idx, got):
                if isinstance(r, CardIOError):
                    if not logged:
                        _log_io_error(r)
                        logged = True
                    r = Read.TRANSIENT if isinstance(r, NodeIOError) else Read.IO_ERROR
                stats.record(False, r is Read.HIT, len(items[i][2]), share)
                self._observe(c, not r.strike, share)
                res[i] = r
        return res

    def read_many(self, items) -> list[Outcome]:
        """Read ``(j, fragment, view)`` items (a ``BatchedReads`` card gets all of its
        fragments at once); an ``Outcome`` for each. A fragment that misses on its card is read
        from the object's next replica in service, and an object found missing or corrupt on
        a card is removed from that card, whole."""
        out = []
        broken: dict[tuple[int, bytes], tuple[int, bytes, Optional[int]]] = {}
        for (j, frag, view), verdict in zip(items, self._read_batched(items)):
            if verdict is not Read.HIT and frag.object_bytes:
                if verdict.drops:
                    broken[(frag.card, object_key(frag.fkey))] = (frag.object_bytes, frag.slot_tag, frag.write_id)
                for alt in frag.others:
                    if not self._active[alt]:
                        continue
                    # the same write id: the replicas of one write share it
                    verdict = self._read(frag._replace(card=alt, others=()), view)
                    if verdict is Read.HIT:
                        break
                    if verdict.drops:
                        broken[(alt, object_key(frag.fkey))] = (frag.object_bytes, frag.slot_tag, frag.write_id)
            out.append(Outcome(j, verdict is Read.HIT))
        for (card, key), (object_bytes, tag, write_id) in broken.items():
            self._remove_broken(card, key, object_bytes, tag, write_id)
        return out

    def read_from_replicas(self, items) -> list[Outcome]:
        """Read ``(j, fragment, view)`` items that missed on their card (e.g. in an I/O
        process) from the object's other replicas; an ``Outcome`` for each."""
        out = [Outcome(j, False) for j, frag, _ in items if not frag.others]
        return out + self.read_many([(j, frag._replace(card=frag.others[0], others=frag.others[1:]), view)
                                     for j, frag, view in items if frag.others])

    def _remove_broken(self, card: int, key: bytes, object_bytes: int, tag: bytes, write_id: Optional[int]) -> None:
        """A read's verdict showed an object broken on a card (the read was of write
        ``write_id``): remove that write whole (``remove_write``), unless the card already did
        (``DropsItself``: it knows whether the verdict is stale)."""
        if not isinstance(self.cards[card], DropsItself):
            self.remove_write(card, key, object_bytes, tag, write_id)

    def _write_lock(self, card: int, key: bytes) -> threading.Lock:
        """The lock every write of object ``key`` to ``card`` through this gateway holds
        (``_write_object``), and every removal of it (``remove_write``, ``delete``)."""
        return self._write_locks[zlib.crc32(key, card) % WRITE_LOCKS]

    def remove_write(self, card: int, key: bytes, object_bytes: int, tag: Optional[bytes],
                     write_id: Optional[int]) -> bool:
        """Remove the object ``key`` from ``card`` (``remove_object``) when it is still the
        write ``write_id`` (its head records it; or no head is left), under the lock a write
        of it holds: a removal decided about one write never removes a later one (None: any
        write). Whether it removed it; a card that does not answer keeps it."""
        with self._write_lock(card, key):
            if write_id is not None:
                try:
                    recorded = self.recorded_head(card, key, tag)
                except CardIOError as exc:
                    logger.warning("%s", exc)
                    return False
                if recorded is not None and recorded.write_id != write_id:
                    return False           # stored again since: the newer write stays
            self.remove_object(card, key, object_bytes, tag or b"")
            return True

    def remove_object(self, card: int, key: bytes, object_bytes: int, tag: Optional[bytes] = b"") -> None:
        """Remove every fragment of the object ``key`` of ``object_bytes`` bytes from ``card``
        (what is left of it; ``tag`` its slot tag), whatever write they are of. A card that
        does not answer is logged and keeps them (nothing raised)."""
        frags = self._frags(card, key, object_bytes)
        try:
            self.cards[card].delete_many([(f.db, f.fkey) for f in frags], [tag or b""] * len(frags))
        except CardIOError as exc:
            logger.warning("%s", exc)

    def listed_heads(self, card: int) -> list[Listed]:
        """Every object whose head is on ``card``, with the slot tag its head records
        (``Card.listed_heads``; slow: a header read per object). Raises ``CardIOError`` (or
        ``OSError``) when the card cannot be listed now."""
        return list(self.cards[card].listed_heads())

    def keys_by_tag(self, card: int) -> bool:
        """Whether ``card`` keys fragments by their slot tag (``KeysByTag``: the cluster
        card), so that an object whose head records no tag cannot be copied to or from it."""
        return isinstance(self.cards[card], KeysByTag)

    def recorded_head(self, card: int, key: bytes, tag: Optional[bytes]) -> Optional[Head]:
        """What the head of the object ``key`` (slot tag ``tag``) records on ``card``
        (``Card.heads``), None for no head. Raises ``CardIOError`` when the card does not answer."""
        recorded, = self.cards[card].heads([(fragment_db(key, 0, self.num_dbs, self.spread), fragment_key(key, 0))],
                                           [tag or b""])
        return recorded

    def read_object(self, card: int, key: bytes, head: Head, tag: Optional[bytes], buf: memoryview) -> Read:
        """Read the object ``key`` whole from ``card`` into ``buf`` (``head.size`` bytes): every
        fragment of the write ``head`` names (another write's is ``CHANGED``: a writer in
        progress), each timed and accounted as any read. ``HIT`` when all are; else the first
        other verdict, and nothing is removed (the caller decides: ``remove_object``)."""
        for frag in self._frags(card, key, head.size, tag):
            verdict = self._read(frag._replace(write_id=head.write_id), buf[frag.offset:frag.offset + frag.length])
            if verdict is not Read.HIT:
                return verdict
        return Read.HIT

    def write_copies(self, cards: Sequence[int], key: bytes, tag: Optional[bytes], obj: memoryview) -> bool:
        """Write the object ``key`` (its bytes ``obj``; ``tag`` its slot tag, None: recorded as
        not known) whole to each of ``cards``, one write id for all, head last
        (``write_replicas``); True if at least one holds all of it."""
        return self.write_replicas([self._frags(c, key, len(obj), tag) for c in cards], obj)

    def put(self, items: Sequence[PutItem], object_bytes: int) -> list[Outcome]:
        """Store the objects of (part of) a PUT batch: which exist already (``exists``: keys
        name content, an object stored under its key holds these bytes), the replica cards
        of each other one, and its write to all of them: straight from a client's region
        (``DirectWrites.write_from_fd``) when every one of those cards is ``DirectWrites`` and
        the source is a region, else from the ring (``PutSource.view``). An object with no
        card in service is not stored."""
        found = self.exists([it.key for it in items], [it.mark for it in items], object_bytes)
        out = []
        for item, there in zip(items, found):
            if there:
                out.append(Outcome(item.j, True, existed=True))
                continue
            plans = self.write_plans(item.key, item.mark, object_bytes)
            if not plans:
                out.append(Outcome(item.j, False))
                continue
            region = item.source.region()
            if region is not None and all(isinstance(self.cards[f.card], DirectWrites) for frags in plans for f in frags):
                # the engine's region -> the card in one copy, by its descriptor (no ring)
                ok = self._write_from_fd(plans, region, object_bytes)
            else:
                view = item.source.view()
                ok = view is not None and self.write_replicas(plans, view)
            out.append(Outcome(item.j, ok))
        return out

    def write_replicas(self, plans: Sequence[Sequence[Fragment]], obj: memoryview) -> bool:
        """Write one object to every replica (one write id for all); True if at least one holds
        all of it."""
        write_id = new_write_id()
        return any([self._write_object(frags, len(obj), write_id, lambda card, f: card.write(
            f.db, f.fkey, obj[f.offset:f.offset + f.length], object_bytes=len(obj) if f.offset == 0 else 0,
            tag=f.slot_tag, write_id=write_id)) for frags in plans])

    def _write_from_fd(self, plans: Sequence[Sequence[Fragment]], src: RegionBytes, n: int) -> bool:
        """Write one object of ``n`` bytes to every replica straight from a client's buffer
        (``DirectWrites.write_from_fd``: every card of the plans is one), nothing read
        at or after ``src.read_by``; True as ``write_replicas``."""
        write_id = new_write_id()

        def put(card: Card, f: Fragment) -> bool:
            assert isinstance(card, DirectWrites)         # put() checked every card of the plans
            return card.write_from_fd(f.db, f.fkey, f.length, src.fd, src.offset + f.offset,
                                      object_bytes=n if f.offset == 0 else 0, tag=f.slot_tag,
                                      read_by=src.read_by, write_id=write_id)
        return any([self._write_object(frags, n, write_id, put) for frags in plans])

    def _write_object(self, frags: Sequence[Fragment], object_bytes: int, write_id: int,
                      put: Callable[[Card, Fragment], bool]) -> bool:
        """Write an object's fragments (``put(card, fragment)``, all stamped ``write_id``), head
        last (it records the object's size and its presence makes the object whole), while
        no other write of this object to this card runs through this gateway; one that fails
        removes what was written, so no part of the object is left behind."""
        if not frags:
            return True
        first = frags[0]
        with self._write_lock(first.card, object_key(first.fkey)):
            for frag in frags:
                def write_one(card: Card, f: Fragment = frag) -> bool:
                    return put(card, f)
                ok, transport_ok = self._card_write(frag, write_one)
                if not ok:
                    if transport_ok:
                        self.remove_object(frag.card, object_key(frag.fkey), object_bytes, frag.slot_tag)
                    return False
        return True

    # ------------------------------------------------------------------ metadata
    def exists(self, keys: Sequence[bytes], marks: Optional[Sequence[int]],
               object_bytes: Optional[int] = None) -> list[bool]:
        """Whether each object is whole on a card in service that would serve it."""
        return (self._lookup(keys, marks, object_bytes).card >= 0).tolist()

    def holders(self, keys: Sequence[bytes], marks: Optional[Sequence[int]],
                object_bytes: Optional[int] = None) -> list[Optional[Holder]]:
        """For each object, where a read of it goes (``Holder``: the first of its replica cards
        in service that holds all of it, every fragment at the sizes ``object_bytes`` gives,
        or else the size its head records), or None."""
        found = self._lookup(keys, marks, object_bytes)
        out: list[Optional[Holder]] = [None] * len(keys)
        hit = np.flatnonzero(found.card >= 0)
        for i, card, write_id, rank, slot in zip(hit.tolist(), found.card[hit].tolist(), found.write_id[hit].tolist(),
                                                 found.rank[hit].tolist(), found.slot[hit].tolist()):
            out[i] = Holder(card, tuple(found.replicas[slot][rank + 1:]) if rank >= 0 else (), write_id)
        return out

    def _lookup(self, keys: Sequence[bytes], marks: Optional[Sequence[int]],
                object_bytes: Optional[int]) -> "_Found":
        """``holders`` of a batch as arrays, on the pool: the slots of all keys at once
        (``Placement.slots``), each slot's replica cards in service found once, then per
        replica rank one ``Card.heads_found`` per card for the keys still missing there."""
        n = len(keys)
        slots = self.placement.slots(keys, marks)
        replicas = {s: [c for c in self.placement.rankings[s] if self._active[c]][:self.replicas]
                    for s in set(slots.tolist())}
        by_rank = np.full((self.storage_slots, self.replicas), -1, np.int64)    # slot, rank -> card
        for s, cards in replicas.items():
            by_rank[s, :len(cards)] = cards
        found = _Found(np.full(n, -1, np.int64), np.zeros(n, np.uint64), np.full(n, -1, np.int64), slots, replicas)
        if not n:
            return found
        all_keys = np.array(keys, dtype=object)
        dbs = head_dbs(keys, self.num_dbs)
        tags = self._tags(marks, n)
        pending = np.arange(n)
        for r in range(self.replicas):
            on = by_rank[slots[pending], r]
            for card in set(on.tolist()) - {-1}:
                idx = pending[on == card]
                whole, write_ids = self._whole(card, all_keys[idx].tolist(), dbs[idx], object_bytes, tags[idx].tolist())
                hit = idx[whole]
                found.card[hit], found.write_id[hit], found.rank[hit] = card, write_ids[whole], r
            pending = pending[found.card[pending] < 0]
            if not pending.size:
                break
        prev = self.previous
        if pending.size and prev is not None:
            self._previous_holders(prev, keys, marks, object_bytes, all_keys, dbs, tags, found, pending.tolist())
        return found

    def _tags(self, marks: Optional[Sequence[int]], n: int) -> np.ndarray:
        """The slot tag of each object of a batch (``slot_tag``, each distinct mark once), as an
        object array."""
        tags = np.empty(n, object)
        if marks and self.placement_mode == "dialog":
            of_mark = {m: self.slot_tag(m) for m in set(marks)}
            tags[:] = list(map(of_mark.__getitem__, marks))
        else:
            tags[:] = b""
        return tags

    def _previous_holders(self, prev: "PreviousPlacement", keys, marks, object_bytes, all_keys, dbs, tags,
                          found: "_Found", pending: list[int]) -> None:
        """During a card-set change: look the objects that missed up on their cards of the
        previous placement (those not asked already); a hit is served from there (``found``, no
        other replicas) and reported to ``on_previous_hit`` (the mover moves it to its card now)."""
        by_card: dict[int, list[int]] = collections.defaultdict(list)
        for i in pending:
            asked = found.replicas[int(found.slot[i])]
            for c in prev.targets(keys[i], marks[i] if marks else 0, self._active):
                if c not in asked:
                    by_card[c].append(i)
                    break
        for card, idx in by_card.items():
            at = np.array(idx, np.int64)
            whole, write_ids = self._whole(card, all_keys[at].tolist(), dbs[at], object_bytes, tags[at].tolist())
            hit = at[whole]
            found.card[hit], found.write_id[hit], found.rank[hit] = card, write_ids[whole], -1
            for i in hit.tolist():
                self.on_previous_hit(keys[i], marks[i] if marks else 0, card)

    def _whole(self, card: int, keys: list[bytes], dbs: np.ndarray, object_bytes: Optional[int],
               tags: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(whether each object has all its fragments on ``card``, the write id its head
        carries there); a card that fails to answer holds none of them. The heads and
        whether each holds its first extent come in one call (``Card.heads_found``: one index
        lookup on the fs card, one round trip per server on the resp and cluster cards); only
        objects of several fragments need a second, for their other fragments."""
        c = self.cards[card]
        frag = self.fragment_size
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
            _log_io_error(exc)
            self._observe(card, isinstance(exc, NodeIOError), 0.0)
            return np.zeros(len(keys), bool), np.zeros(len(keys), np.uint64)
        return whole, heads.write_id

    def _rest_held(self, c: Card, keys: list[bytes], which: list[int], sizes: np.ndarray,
                   tags: list[bytes]) -> list[bool]:
        """Whether the objects ``which`` (of ``keys``, of ``sizes``: several fragments each,
        their heads checked) hold every other fragment at its length on card ``c``."""
        frag = self.fragment_size
        cuts: dict[int, list[tuple[int, int]]] = {}       # object size -> its fragment extents
        items: list[tuple[int, bytes]] = []
        lengths: list[Optional[int]] = []
        item_tags: list[bytes] = []
        spans = []
        for i in which:
            size = int(sizes[i])
            extents = cuts.get(size)
            if extents is None:
                extents = cuts[size] = fragment_extents(size, frag)
            start = len(items)
            for db, fkey, _, length in self._layout(keys[i], extents)[:-1]:
                items.append((db, fkey))
                lengths.append(length)
            item_tags.extend([tags[i]] * (len(items) - start))
            spans.append((start, len(items)))
        found = c.contains_many(items, lengths, item_tags)
        return [all(found[a:b]) for a, b in spans]

    def delete(self, keys: Sequence[bytes], marks: Optional[Sequence[int]]) -> int:
        """Remove objects (all their fragments) from their replica cards (and, during a card-set
        change, from their cards in the previous layout); how many existed (an object counts once,
        however many cards held a copy: its replicas, or both ends of a move)."""
        deleted = 0
        prev = self.previous
        for i, key in enumerate(keys):
            mark = marks[i] if marks else 0
            tag = self.slot_tag(mark)
            cards = self.targets(key, mark, self.replicas)
            if prev is not None:           # during a card-set change: its copy on its previous card too
                cards += [c for c in prev.targets(key, mark, self._active) if c not in cards]
            existed = False
            for card_index in cards:
                card = self.cards[card_index]
                head = (fragment_db(key, 0, self.num_dbs, self.spread), fragment_key(key, 0))
                try:
                    with self._write_lock(card_index, key):     # never part of a write in flight
                        size, = card.object_sizes([head], [tag])
                        if size:
                            frags = self._frags(card_index, key, size)
                            found = card.delete_many([(f.db, f.fkey) for f in frags], [tag] * len(frags)) > 0
                        else:
                            index, found = 0, False
                            while card.delete(fragment_db(key, index, self.num_dbs, self.spread),
                                              fragment_key(key, index), tag):
                                found = True
                                index += 1
                except CardIOError as exc:
                    logger.warning("%s", exc)
                    found = False
                existed = existed or found
            deleted += existed
        return deleted

    def clean(self) -> int:
        total = 0
        for i, card in enumerate(self.cards):
            if self._active[i]:
                total += card.clean()
        return total

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

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Sequence[bytes]) -> None:
        self.pins.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.pins.unpin(keys)

    def is_pinned(self, key: bytes) -> bool:
        return self.pins.holds(key)

    def pinned_count(self) -> int:
        return len(self.pins)
