"""Accounted card I/O: every read, write and removal of an object's fragments on a card, timed
into the card's statistics and reported to its health (``CardService.observe``), with the
replica fallback of a read that misses and the rules that keep an object whole: a read whose
verdict is evidence about the object (``Read.drops``: missing, corrupt) removes that write of it
from that card, whole (the next PUT stores it again); any other miss removes nothing; a write
that fails halfway removes what it wrote.

One writer's bytes: every write of an object draws a write id that all its fragments carry; a
lookup learns the head's, and every fragment is read against it, so a hit is one write's whole
object. Writes of one object (on one card) through this gateway are serialized (``write_lock``),
so two racing writers leave the later one's whole object, never a mix of both; a removal decided
about one write (a read's verdict, the mover's copy) runs under the same lock and only while the
head still records that write (``remove_write``), and a DELETE holds it too (``delete``).

Called on the gateway's I/O pool (many at once), and from the loop for an I/O process's task
(``process_reads_done``)."""

from __future__ import annotations

import abc
import collections
import logging
import os
import threading
import zlib
from typing import Callable, NamedTuple, Optional, Sequence

from adpkv_gateway.cards.base import (
    BatchedReads, Card, CardIOError, DirectReads, DirectWrites, DropsItself, HandsFiles, Head, IOProcessReads,
    NodeIOError, NoProcessRead, PlacedFile, ProcessRead, Read
)
from adpkv_gateway.cards.fragments import object_key
from adpkv_gateway.cards.objfmt import new_write_id
from adpkv_gateway.store.card_stats import CardStats
from adpkv_gateway.store.plan import Fragment, FragmentPlan, Holder
from adpkv_gateway.store.service import CardService

logger = logging.getLogger("adpkv.gateway.store")

WRITE_LOCKS = 4096          # stripes of the per-object write serialization


def log_io_error(exc: CardIOError) -> None:
    """A node of a cluster card that does not answer is logged once by the card; the
    failed commands (many, until the cluster fails over) only at debug level."""
    logger.log(logging.DEBUG if isinstance(exc, NodeIOError) else logging.WARNING, "%s", exc)


class Outcome(NamedTuple):
    """What an I/O task did for one object of a batch: ``j`` its index in the batch; ``ok``:
    found and still good (GET), stored (PUT); ``existed``: a PUT found it stored already and
    wrote nothing (``ok`` too)."""

    j: int
    ok: bool
    existed: bool = False


class ReadInto(NamedTuple):
    """One fragment of object ``j`` of a batch to read into ``view`` (its place in the ring)."""

    j: int
    frag: Fragment
    view: memoryview


class ReadToFd(NamedTuple):
    """One fragment of object ``j`` of a batch to read into a client's region: its descriptor
    ``fd`` at ``offset``."""

    j: int
    frag: Fragment
    fd: int
    offset: int


class RegionBytes(NamedTuple):
    """An object's bytes in a client's region (``door.Region``): its descriptor, the object's
    offset there, and the monotonic time the client gives up at (None: never)."""

    fd: int
    offset: int
    read_by: Optional[float]


class OpenedFile(NamedTuple):
    """A placed object's file opened read-only for MAP (``CardIO.open_verified``), as its check
    in place sees it: the descriptor, the fragment key its header must name, and the write id
    the object's head carries (None: any)."""

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


class _Written(NamedTuple):
    """One card write of one fragment (``CardIO._card_write``): stored, and whether the
    card answered at all (a transport failure leaves nothing known about what it holds)."""

    ok: bool
    transport_ok: bool


class CardIO:
    """The accounted I/O of one gateway's cards (see the module)."""

    def __init__(self, cards: Sequence[Card], service: CardService, plan: FragmentPlan, stats: Sequence[CardStats]):
        self.cards = cards
        self.service = service
        self.plan = plan
        self.stats = stats
        # writes of one object to one card run one after the other (striped by object key)
        self._write_locks = [threading.Lock() for _ in range(WRITE_LOCKS)]

    # ------------------------------------------------------------------ one command, accounted
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
            log_io_error(exc)
        except CardIOError as exc:
            verdict = Read.IO_ERROR
            log_io_error(exc)
        except Exception:
            logger.exception("read from card %s failed", card.serial)
            verdict = Read.TRANSIENT
        seconds = self.stats[frag.card].end(token, False, verdict is Read.HIT, frag.length)
        self.service.observe(frag.card, not verdict.strike, seconds)
        return verdict

    def _card_write(self, frag: Fragment, call: Callable[[Card], bool]) -> _Written:
        """One card write of one fragment, timed and accounted: the card's statistics, and its
        health (a transport failure is a strike, unless only one node of a cluster failed)."""
        card = self.cards[frag.card]
        token = self.stats[frag.card].begin()
        transport_ok, ok, strike = True, False, True
        try:
            ok = bool(call(card))
        except CardIOError as exc:
            transport_ok, strike = False, not isinstance(exc, NodeIOError)
            log_io_error(exc)
        except Exception:
            logger.exception("write to card %s failed", card.serial)
        seconds = self.stats[frag.card].end(token, True, ok, frag.length)
        self.service.observe(frag.card, transport_ok or not strike, seconds)
        return _Written(ok, transport_ok)

    # ------------------------------------------------------------------ reads
    def read(self, frag: Fragment, buf: memoryview) -> Read:
        """The verdict of one fragment's read into ``buf``, accounted; nothing removed."""
        # a tag not known (None) finds what is keyed without one: a card that keys by tag holds
        # no object without a recorded tag (the mover passes those over)
        return self._card_read(frag, lambda card: card.read(frag.db, frag.fkey, buf, frag.slot_tag or b"",
                                                            frag.write_id))

    def read_to_fds(self, items: Sequence[ReadToFd], write_by: Optional[float] = None) -> list[Outcome]:
        """Read fragments straight into a client's buffer (``DirectReads.read_to_fd``, nothing
        written at or after ``write_by``); an ``Outcome`` each, with statistics, health and
        removal of what the verdict shows broken as ``read_many``."""
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

    def direct_replicas(self, frag: Fragment) -> list[Fragment]:
        """Where a read of ``frag`` straight into a client's region may go, in order: its card,
        then each other replica card in service that reads into regions (``DirectReads``)."""
        return [frag] + [frag._replace(card=c, others=()) for c in frag.others
                         if self.service.in_service(c) and isinstance(self.cards[c], DirectReads)]

    def _read_batched(self, items: Sequence[ReadInto]) -> list[Read]:
        """The verdict of each item: the fragments of a card with ``BatchedReads`` in one
        ``Card.read_many`` call, the others one by one."""
        res: list[Read] = [Read.TRANSIENT] * len(items)
        by_card: dict[int, list[int]] = collections.defaultdict(list)
        for i, (_, frag, view) in enumerate(items):
            if isinstance(self.cards[frag.card], BatchedReads):
                by_card[frag.card].append(i)
            else:
                res[i] = self.read(frag, view)
        for c, idx in by_card.items():
            card, stats = self.cards[c], self.stats[c]
            token = stats.begin()
            got: list
            try:
                got = card.read_many([(items[i].frag.db, items[i].frag.fkey, items[i].view, items[i].frag.slot_tag or b"",
                                       items[i].frag.write_id) for i in idx])
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
                        log_io_error(r)
                        logged = True
                    r = Read.TRANSIENT if isinstance(r, NodeIOError) else Read.IO_ERROR
                stats.record(False, r is Read.HIT, len(items[i].view), share)
                self.service.observe(c, not r.strike, share)
                res[i] = r
        return res

    def read_many(self, items: Sequence[ReadInto]) -> list[Outcome]:
        """Read fragments into the ring (a ``BatchedReads`` card gets all of its fragments at
        once); an ``Outcome`` for each. A fragment that misses on its card is read from the
        object's next replica in service, and an object found missing or corrupt on a card is
        removed from that card, whole."""
        out = []
        broken: dict[tuple[int, bytes], tuple[int, Optional[bytes], Optional[int]]] = {}
        for (j, frag, view), verdict in zip(items, self._read_batched(items)):
            if verdict is not Read.HIT and frag.object_bytes:
                if verdict.drops:
                    broken[(frag.card, object_key(frag.fkey))] = (frag.object_bytes, frag.slot_tag, frag.write_id)
                for alt in frag.others:
                    if not self.service.in_service(alt):
                        continue
                    # the same write id: the replicas of one write share it
                    verdict = self.read(frag._replace(card=alt, others=()), view)
                    if verdict is Read.HIT:
                        break
                    if verdict.drops:
                        broken[(alt, object_key(frag.fkey))] = (frag.object_bytes, frag.slot_tag, frag.write_id)
            out.append(Outcome(j, verdict is Read.HIT))
        for (card, key), (object_bytes, tag, write_id) in broken.items():
            self._remove_broken(card, key, object_bytes, tag, write_id)
        return out

    def read_from_replicas(self, items: Sequence[ReadInto]) -> list[Outcome]:
        """Read fragments that missed on their card (e.g. in an I/O process) from the object's
        other replicas; an ``Outcome`` for each."""
        out = [Outcome(j, False) for j, frag, _ in items if not frag.others]
        return out + self.read_many([ReadInto(j, frag._replace(card=frag.others[0], others=frag.others[1:]), view)
                                     for j, frag, view in items if frag.others])

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
        self.service.observe_many(card, seconds, {k for k, verdict in misses if verdict.strike})
        c = self.cards[card]
        assert isinstance(c, IOProcessReads)      # only such a card hands reads to the processes
        for k, verdict in misses:
            c.process_read_result(files[k], verdict)

    def open_verified(self, keys: Sequence[bytes], holders: Sequence[Optional[Holder]],
                      check: Callable[[list[OpenedFile]], list[Read]]) -> list[Optional[int]]:
        """For MAP: for each object of one fragment, a read-only descriptor of its own file on
        the card ``holders`` found it on, verified in place, that the caller now owns (to hand
        and close), or None: only a card that hands files (``HandsFiles.open_placed``, of the
        placed file). ``check`` gives the verdict on each file opened (header, size, the head's
        write id, the payload's checksum, where the file lies). A file whose verdict is not
        ``HIT`` is closed, never handed, and its verdict goes to its card as a failed read's
        does (``HandsFiles.placed_checked``: a corrupt object is removed)."""
        out: list[Optional[int]] = [None] * len(keys)
        opened: list[tuple[int, HandsFiles, PlacedFile, OpenedFile]] = []
        for i, holder in enumerate(holders):
            if holder is None:
                continue
            handing = self.cards[holder.card]
            if not isinstance(handing, HandsFiles):
                continue
            _, fkey = self.plan.at(keys[i], 0)
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

    # ------------------------------------------------------------------ writes
    def write_replicas(self, plans: Sequence[Sequence[Fragment]], obj: memoryview) -> bool:
        """Write one object to every replica (one write id for all); True if at least one holds
        all of it."""
        write_id = new_write_id()
        return any([self._write_object(frags, len(obj), write_id, lambda card, f: card.write(
            f.db, f.fkey, obj[f.offset:f.offset + f.length], object_bytes=len(obj) if f.offset == 0 else 0,
            tag=f.slot_tag, write_id=write_id)) for frags in plans])

    def write_from_fd(self, plans: Sequence[Sequence[Fragment]], src: RegionBytes, n: int) -> bool:
        """Write one object of ``n`` bytes to every replica straight from a client's buffer
        (``DirectWrites.write_from_fd``: every card of the plans must be one), nothing read
        at or after ``src.read_by``; True as ``write_replicas``."""
        write_id = new_write_id()

        def put(card: Card, f: Fragment) -> bool:
            assert isinstance(card, DirectWrites)         # the caller checked every card of the plans
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
        with self.write_lock(first.card, object_key(first.fkey)):
            for frag in frags:
                def write_one(card: Card, f: Fragment = frag) -> bool:
                    return put(card, f)
                ok, transport_ok = self._card_write(frag, write_one)
                if not ok:
                    if transport_ok:
                        self.remove_object(frag.card, object_key(frag.fkey), object_bytes, frag.slot_tag)
                    return False
        return True

    # ------------------------------------------------------------------ heads and removals
    def write_lock(self, card: int, key: bytes) -> threading.Lock:
        """The lock every write of object ``key`` to ``card`` through this gateway holds, and
        every removal of it (``remove_write``, ``delete``)."""
        return self._write_locks[zlib.crc32(key, card) % WRITE_LOCKS]

    def recorded_head(self, card: int, key: bytes, tag: Optional[bytes]) -> Optional[Head]:
        """What the head of the object ``key`` (slot tag ``tag``) records on ``card``
        (``Card.heads``), None for no head. Raises ``CardIOError`` when the card does not answer."""
        recorded, = self.cards[card].heads([self.plan.at(key, 0)], [tag or b""])
        return recorded

    def _remove_broken(self, card: int, key: bytes, object_bytes: int, tag: Optional[bytes],
                       write_id: Optional[int]) -> None:
        """A read's verdict showed an object broken on a card (the read was of write
        ``write_id``): remove that write whole (``remove_write``), unless the card already did
        (``DropsItself``: it knows whether the verdict is stale)."""
        if not isinstance(self.cards[card], DropsItself):
            self.remove_write(card, key, object_bytes, tag, write_id)

    def remove_write(self, card: int, key: bytes, object_bytes: int, tag: Optional[bytes],
                     write_id: Optional[int]) -> bool:
        """Remove the object ``key`` from ``card`` (``remove_object``) when it is still the
        write ``write_id`` (its head records it; or no head is left), under the lock a write
        of it holds: a removal decided about one write never removes a later one (None: any
        write). Whether it removed it; a card that does not answer keeps it."""
        with self.write_lock(card, key):
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
        frags = self.plan.fragments(card, key, object_bytes)
        try:
            self.cards[card].delete_many([(f.db, f.fkey) for f in frags], [tag or b""] * len(frags))
        except CardIOError as exc:
            logger.warning("%s", exc)

    def delete(self, card_index: int, key: bytes, tag: bytes) -> bool:
        """DELETE of the object ``key`` on one card, never part of a write in flight: its
        fragments at the size its head records, or (no head) each fragment found from the
        first on. Whether any was there; a card that does not answer is logged (False)."""
        card = self.cards[card_index]
        try:
            with self.write_lock(card_index, key):
                size, = card.object_sizes([self.plan.at(key, 0)], [tag])
                if size:
                    frags = self.plan.fragments(card_index, key, size)
                    return card.delete_many([(f.db, f.fkey) for f in frags], [tag] * len(frags)) > 0
                index, found = 0, False
                while card.delete(*self.plan.at(key, index), tag):
                    found = True
                    index += 1
                return found
        except CardIOError as exc:
            logger.warning("%s", exc)
            return False
