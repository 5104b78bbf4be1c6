"""The key layout a gateway ran with, recorded on the cards themselves.

Every card carries one ``CardRecord``: the layout the gateways on these cards place keys
with now (``layout``), the layout of a card-set change still being moved (``previous``, or
None) and an ``epoch`` that grows with every record written. An operator changes only
``storage_devices`` (adds, removes or replaces a card) and restarts: the gateway finds the
previous layout on the cards, reads fall back to it and the mover (``gateway/layout/mover.py``)
moves its objects until nothing is left, and then the previous layout is dropped.

Where the record lives:

- fs card: ``DIR/adpkv-layout.json``, written atomically (a temporary file opened with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``, fsynced, renamed into place, the directory fsynced) and
  read with ``O_NOFOLLOW``;
- resp and cluster cards: the key ``adpkv:card:layout`` (beside ``adpkv:card:serial``; an
  object's keys are ``adpkv:<db digits>:...`` or ``adpkv:{<tag>}:...``, so none collides).

The rule at start (``resolve``), when every configured card answered:

- no card holds a record: a first start; the current layout is recorded;
- records that are neither the newest one's layout nor its previous: a mixed layout, refused;
- a configured card that holds a record but is not in the newest record's layout was drained
  (``adpkv drain``): it is left out of the current layout (read during the move, never placed on);
- the newest record's layout is the current one: its ``previous`` (if any) is resumed;
- else a change from the recorded layout to the current one: refused when the recorded
  change is not finished yet (the mover's sweep finishes it, with either placement: a card
  records each object's slot tag), or when anything but the card
  set differs (``storage_slots``, ``num_dbs``, ``key_placement``, ``fragment_size`` move every
  key: that is a new cache, not a change of cards). With ``key_layout_fingerprint`` set, ``previous_key_layout_fingerprint``
  must name the recorded layout's fingerprint: the operator declares the change.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Optional, Sequence

import msgspec

from adpkv_gateway.cards.base import Card, CardIOError, KeyedLayoutRecord
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.store.placement import key_layout_fingerprint

logger = logging.getLogger("adpkv.gateway.layout")

LAYOUT_FILE = "adpkv-layout.json"
_TMP_SUFFIX = ".tmp"


class Layout(msgspec.Struct, frozen=True):
    """Everything that decides where a key lives (``fingerprint`` over it), and the replicas."""

    serials: tuple[str, ...]          # sorted
    storage_slots: int
    num_dbs: int
    key_placement: str
    fragment_size: int
    replicas: int
    fingerprint: str

    @classmethod
    def of(cls, serials: Sequence[str], storage_slots: int, num_dbs: int, key_placement: str,
           fragment_size: int, replicas: int) -> "Layout":
        return cls(tuple(sorted(serials)), storage_slots, num_dbs, key_placement, fragment_size, replicas,
                   key_layout_fingerprint(serials, storage_slots, num_dbs, key_placement, fragment_size))

    def without(self, serials: Sequence[str]) -> "Layout":
        """This layout without the cards ``serials`` (a drain)."""
        return Layout.of([s for s in self.serials if s not in serials], self.storage_slots, self.num_dbs,
                         self.key_placement, self.fragment_size, self.replicas)

    def same_keys_but_cards(self, other: "Layout") -> bool:
        """Whether only the card set differs (a key's slot and fragments are the same)."""
        return (self.storage_slots, self.num_dbs, self.key_placement, self.fragment_size) == \
            (other.storage_slots, other.num_dbs, other.key_placement, other.fragment_size)


class CardRecord(msgspec.Struct, frozen=True):
    layout: Layout
    previous: Optional[Layout] = None
    epoch: int = 0


class LayoutError(Exception):
    """The cards and the configuration do not make one layout: the gateway refuses to start."""


# ---------------------------------------------------------------------------- on a card
def read_record(card: Card) -> Optional[CardRecord]:
    """The card's record, or None when it has none. Raises ``LayoutError`` on a record that
    cannot be read (the gateway must not guess), ``CardIOError`` when the card fails."""
    if isinstance(card, FsCard):
        path = os.path.join(card.root, LAYOUT_FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LayoutError(f"fs card {card.root}: cannot read {LAYOUT_FILE}: {exc}") from None
        try:
            with os.fdopen(fd, "rb") as fh:
                raw = fh.read(1 << 20)
        except OSError as exc:
            raise LayoutError(f"fs card {card.root}: cannot read {LAYOUT_FILE}: {exc}") from None
    else:
        kept = _keyed(card).get_layout_record()
        if kept is None:
            return None
        raw = kept
    try:
        return msgspec.json.decode(raw, type=CardRecord)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LayoutError(f"card {card.serial} ({card.device}): its layout record is unreadable: {exc}") from None


def write_record(card: Card, record: CardRecord) -> None:
    """Replace the card's record atomically. Raises ``CardIOError`` or ``OSError``."""
    data = msgspec.json.encode(record)
    if not isinstance(card, FsCard):
        _keyed(card).set_layout_record(data)
        return
    path = os.path.join(card.root, LAYOUT_FILE)
    tmp = path + _TMP_SUFFIX
    try:
        os.unlink(tmp)                    # what an interrupted write left
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, card.file_mode)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(card.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _keyed(card: Card) -> KeyedLayoutRecord:
    """``card``, which keeps its record under a key of its own (resp, cluster: ``KeyedLayoutRecord``)."""
    if not isinstance(card, KeyedLayoutRecord):
        raise LayoutError(f"card {card.device}: kind {card.kind!r} keeps no layout record")
    return card


def write_all(cards: Sequence[Card], record: CardRecord) -> None:
    """Record ``record`` on every card (one that fails is logged: its record is checked at the
    next start, where an older one is still a consistent one)."""
    for card in cards:
        try:
            write_record(card, record)
        except (CardIOError, OSError) as exc:
            logger.warning("card %s: cannot record the key layout: %s", card.serial, exc)


# ---------------------------------------------------------------------------- the rule
def resolve(records: Sequence[Optional[CardRecord]], serials: Sequence[str], current: Layout,
            configured_fingerprint: str, previous_fingerprint: str) -> CardRecord:
    """The record the gateway runs with (write it to every card), from each card's record
    (None: none; ``serials[i]`` is the serial of the card of ``records[i]``) and the configured
    layout ``current`` (over every configured card); raises ``LayoutError`` with the reason to
    refuse. A configured card whose record does not name it in the newest layout was drained
    (``adpkv drain``): it is left out (the layout returned does not name it)."""
    found = [r for r in records if r is not None]
    if not found:
        if configured_fingerprint and configured_fingerprint != current.fingerprint:
            raise LayoutError(_differs(current, configured_fingerprint))
        if previous_fingerprint:
            raise LayoutError(f"previous_key_layout_fingerprint is {previous_fingerprint} but no card records "
                              "a layout: nothing to change from; refusing to start")
        return CardRecord(current)
    newest = max(found, key=lambda r: r.epoch)
    allowed = {newest.layout, newest.previous}
    mixed = sorted({r.layout.fingerprint for r in found if r.layout not in allowed})
    if mixed:
        raise LayoutError(f"the cards record different key layouts ({newest.layout.fingerprint} and "
                          f"{', '.join(mixed)}): they were run by gateways with different storage_devices or "
                          "settings; refusing to start")
    drained = [s for s, r in zip(serials, records) if r is not None and s not in newest.layout.serials]
    if drained:
        logger.warning("Card(s) %s were drained: left out of the layout (remove them from storage_devices)",
                       ", ".join(drained))
        current = current.without(drained)
    if configured_fingerprint and configured_fingerprint != current.fingerprint:
        raise LayoutError(_differs(current, configured_fingerprint))
    if newest.layout == current:
        if previous_fingerprint and newest.previous is not None and \
                previous_fingerprint != newest.previous.fingerprint:
            raise LayoutError(f"previous_key_layout_fingerprint {previous_fingerprint} is not the layout being "
                              f"moved from ({newest.previous.fingerprint}); refusing to start")
        return newest
    old = newest.layout
    if newest.previous is not None:              # the sweep finishes a change: wait for it
        raise LayoutError(f"the cards are in the middle of a change from layout {newest.previous.fingerprint} "
                          f"to {old.fingerprint}; start with the storage_devices of {old.fingerprint} "
                          f"({', '.join(old.serials)}) until it is finished, then change again")
    if not current.same_keys_but_cards(old):
        raise LayoutError(f"the cards record layout {old.fingerprint} (storage_slots {old.storage_slots}, "
                          f"num_dbs {old.num_dbs}, key_placement {old.key_placement}, fragment_size "
                          f"{old.fragment_size}); only storage_devices may change over cards that hold a cache; "
                          "refusing to start")
    if configured_fingerprint and previous_fingerprint != old.fingerprint:
        raise LayoutError(f"the cards record layout {old.fingerprint} and this gateway would run "
                          f"{current.fingerprint}: a change of the card set; set previous_key_layout_fingerprint "
                          f"to {old.fingerprint} to declare it (it is {previous_fingerprint or 'unset'}); "
                          "refusing to start")
    if previous_fingerprint and previous_fingerprint != old.fingerprint:
        raise LayoutError(f"previous_key_layout_fingerprint {previous_fingerprint} is not the layout the cards "
                          f"record ({old.fingerprint}); refusing to start")
    return CardRecord(current, old, newest.epoch + 1)


def _differs(current: Layout, configured: str) -> str:
    return (f"key layout fingerprint {current.fingerprint} differs from the configured key_layout_fingerprint "
            f"{configured}: this gateway would place keys elsewhere than its peers; refusing to start")


def settle(cards: Sequence[Card], current: Layout, configured_fingerprint: str,
           previous_fingerprint: str) -> CardRecord:
    """Read every card's record, ``resolve`` them and record the result on every card; a card
    that cannot be read refuses the start (``LayoutError``), as a layout that does not fit."""
    records = []
    for card in cards:
        try:
            records.append(read_record(card))
        except CardIOError as exc:
            raise LayoutError(f"card {card.serial} ({card.device}): cannot read its layout record: {exc}") from None
    record = resolve(records, [c.serial for c in cards], current, configured_fingerprint, previous_fingerprint)
    if record.previous is not None:
        logger.info("Card-set change from layout %s (cards %s) to %s (cards %s): reads fall back to the previous "
                    "layout and its objects move", record.previous.fingerprint, ", ".join(record.previous.serials),
                    current.fingerprint, ", ".join(current.serials))
    if record not in records or any(r != record for r in records):
        write_all(cards, record)
    return record
