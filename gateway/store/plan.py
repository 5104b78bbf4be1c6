"""An object's fragments on a card: the store's one place that turns an object key, its size
and its dialog mark into the fragments its card I/O reads and writes (database, fragment key,
extent, slot tag, head last). The fragment-key format and the database hash are the cards'
(``cards.fragments``); this module only applies them. Plain values, no I/O, no state beyond
the gateway's settings."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import numpy as np

from adpkv_gateway.cards.fragments import db_hash, fragment_db, fragment_dbs, fragment_extents, fragment_key


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
    slot_tag: Optional[bytes] = b""       # its object's slot tag (``FragmentPlan.slot_tag``), given to the card;
    #                                       None: not known (a move's object whose head records none)
    write_id: Optional[int] = None        # the write its head named at lookup: every fragment must be of it


_fragment = functools.partial(tuple.__new__, Fragment)     # Fragment(*fields) without its Python __new__


class Holder(NamedTuple):
    """Where a read of an object goes (the lookup's row, ``lookup.Lookup.holders``): the first of
    its replica cards in service that holds all of it, the other replica cards a read may fall
    back on, and the write id the object's head carries there (its fragments are read against it)."""

    card: int
    others: tuple[int, ...]
    write_id: Optional[int]


class FragmentPlan:
    """How the gateway cuts objects (``fragment_size``) and spreads their fragments over a
    card's ``num_dbs`` databases (``spread``), and the slot tag a card gets with each
    (``placement_mode``)."""

    def __init__(self, num_dbs: int, fragment_size: int, spread: bool, placement_mode: str):
        self.num_dbs = num_dbs
        self.fragment_size = fragment_size
        self.spread = spread
        self.placement_mode = placement_mode

    def slot_tag(self, mark: int) -> bytes:
        """The slot tag the cards get with every fragment of an object (see ``cards.base``):
        with ``dialog`` placement its dialog mark, so that a card that groups keys (a Redis
        Cluster's hash tag) keeps a dialog together; else (``stripe``, or no mark) none, and
        such a card groups the fragments of each object alone. The same object gets the same
        tag at PUT, EXIST, GET and DELETE, as its placement."""
        return mark.to_bytes(8, "big") if self.placement_mode == "dialog" and mark else b""

    def slot_tags(self, marks: Optional[Sequence[int]], n: int) -> np.ndarray:
        """The slot tag of each object of a batch (``slot_tag``, each distinct mark once), as an
        object array."""
        tags = np.empty(n, object)
        if marks and self.placement_mode == "dialog":
            of_mark = {m: self.slot_tag(m) for m in set(marks)}
            tags[:] = list(map(of_mark.__getitem__, marks))
        else:
            tags[:] = b""
        return tags

    def extents(self, object_bytes: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of each fragment of an object of ``object_bytes``."""
        return fragment_extents(object_bytes, self.fragment_size)

    def at(self, key: bytes, index: int) -> tuple[int, bytes]:
        """``(database, fragment key)`` of fragment ``index`` of the object ``key``; index 0 is
        its head."""
        return fragment_db(key, index, self.num_dbs, self.spread), fragment_key(key, index)

    def layout(self, key: bytes, extents: Sequence[tuple[int, int]]) -> list[tuple[int, bytes, int, int]]:
        """``(db, fragment key, offset, length)`` of each fragment of an object cut into
        ``extents``, fragment 0 last (written last: its presence means the object is whole)."""
        dbs = fragment_dbs(key, len(extents), self.num_dbs, self.spread)
        parts = [(dbs[i], fragment_key(key, i), off, ln) for i, (off, ln) in enumerate(extents)]
        return parts[1:] + parts[:1]

    def fragments(self, card: int, key: bytes, object_bytes: int, tag: Optional[bytes] = b"") -> list[Fragment]:
        """The fragments of the object ``key`` of ``object_bytes`` on ``card``, head last."""
        return [Fragment(card, db, fkey, off, ln, 0, (), tag)
                for db, fkey, off, ln in self.layout(key, self.extents(object_bytes))]

    def read_plans(self, holders: Sequence[Optional[Holder]], keys: Sequence[bytes],
                   marks: Optional[Sequence[int]], object_bytes: int) -> list[tuple[int, Fragment]]:
        """The fragments to read, for a batch's objects at once: ``(j, fragment)`` for each
        fragment of each object ``j`` that ``holders`` found (on that card; its other replica
        cards ride along for the read to fall back on), an object's fragments one after the
        other. The fragment extents are cut once, each object's databases hashed once, each
        ``Fragment`` made by ``tuple.__new__``."""
        extents = self.extents(object_bytes)
        # per fragment, in read order (fragment 0 last, as ``layout``): its index's key suffix,
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
