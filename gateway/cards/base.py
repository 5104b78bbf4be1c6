"""The card interface: one storage backend instance behind the gateway.

A card stores fragments (the unit of storage, see ``adpkv_gateway.fragments``) in
``num_dbs`` databases. Only the gateway talks to cards. Every method may be
called from many I/O threads at once. A read that cannot return exactly the
bytes that were written (missing, truncated, corrupt, foreign) returns False:
a miss, never wrong data.

A fragment key is its object's key followed by a 2-byte fragment index
(``adpkv_gateway.fragments.fragment_key``); fragment 0, the head, is written last
and records the size of the whole object. An object lives and dies whole: a card
that evicts, deletes or drops a fragment drops every fragment of its object.

Slot tags: every method that names fragments on the card also takes the objects' slot
tag (``tag`` / ``tags``, bytes; ``b""`` for none), which the store derives the same way
for every call about an object: with ``key_placement: dialog`` the dialog mark (8 bytes,
big-endian; every object of a dialog has the same), else ``b""`` (the object alone). A
card that groups keys (the cluster card: a Redis Cluster hash tag, so that a dialog's
objects share one slot and one node) keys fragments by it, and must be given the same
tag to find them again; every other card ignores it.
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


class NodeIOError(CardIOError):
    """A transport failure of one node of a card made of several (a Redis Cluster): the
    fragment is unavailable for now, a miss that removes nothing, but the card as a whole
    answers, so it is no strike against the card's health."""


def object_key(fkey: bytes) -> bytes:
    """The key of the object a fragment key belongs to."""
    return fkey[:-2]


def is_head(fkey: bytes) -> bool:
    """Whether a fragment key names its object's head (fragment 0)."""
    return fkey[-2:] == b"\0\0"


def claim_record(uid: int) -> bytes:
    """How a card records the owner of a namespace: its uid in decimal, one line."""
    return b"%d\n" % uid


def parse_claim(data: bytes, what: str) -> int:
    """The uid of a claim record (``claim_record``); CardError for anything else."""
    text = data.strip()
    if not text.isdigit() or len(text) > 10 or data != claim_record(int(text)):
        raise CardError(f"{what}: the claim record {data[:32]!r} is not an owner's uid")
    return int(text)


class Card(abc.ABC):
    """One storage backend instance with a stable serial number."""

    kind: str = ""
    direct_reads: bool = False   # read_to_fd works: a client's region is filled without the ring
    direct_writes: bool = False  # write_from_fd works: a client's region is stored without the ring
    batched_reads: bool = False  # read_many does better than a loop over read (the store uses it)

    def __init__(self, device: str):
        self.device = device
        self.serial: str = ""

    @abc.abstractmethod
    def open(self) -> None:
        """Connect/prepare the card and learn (or assign) its serial; raises CardError."""

    @abc.abstractmethod
    def read(self, db: int, fkey: bytes, buf: memoryview, tag: bytes = b"") -> bool:
        """Fill ``buf`` (exactly its length) with the fragment; False on any miss."""

    def read_many(self, items: list[tuple[int, bytes, memoryview, bytes]]) -> list:
        """Read ``(db, fragment key, buf, slot tag)`` items, each as ``read`` does; for each:
        True, False (a miss), or the ``CardIOError`` that failed it (a transport failure:
        nothing may be concluded about the fragment). Cards with ``batched_reads`` do it in
        fewer round trips (the cluster card: one pipeline per node, all nodes at once)."""
        out: list = []
        for db, fkey, buf, tag in items:
            try:
                out.append(self.read(db, fkey, buf, tag))
            except CardIOError as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    def write(self, db: int, fkey: bytes, buf: memoryview, object_bytes: int = 0, tag: bytes = b"") -> bool:
        """Store ``buf`` atomically under ``fkey``; False if it could not be stored.
        ``object_bytes``: the size of the whole object, recorded in its head fragment."""

    @abc.abstractmethod
    def contains_many(self, items: list[tuple[int, bytes]],
                      lengths: Optional[list[Optional[int]]] = None,
                      tags: Optional[list[bytes]] = None) -> list[bool]:
        """Whether each ``(db, fragment key)`` is stored (cheap, batched; may be stale, a
        later read decides). With ``lengths``, a fragment only counts when it holds that
        many payload bytes (None: any)."""

    @abc.abstractmethod
    def object_sizes(self, heads: list[tuple[int, bytes]],
                     tags: Optional[list[bytes]] = None) -> list[Optional[int]]:
        """For each ``(db, head fragment key)``: the object size its head records, 0 for a
        head that records none (written before sizes were recorded), None for no head."""

    @abc.abstractmethod
    def delete(self, db: int, fkey: bytes, tag: bytes = b"") -> bool:
        """Remove a fragment (fs: with every fragment of its object); True if it existed."""

    def delete_many(self, items: list[tuple[int, bytes]], tags: Optional[list[bytes]] = None) -> int:
        """Remove many fragments; how many of them existed."""
        return sum(self.delete(db, fkey, tags[i] if tags else b"") for i, (db, fkey) in enumerate(items))

    def read_to_fd(self, db: int, fkey: bytes, length: int, out_fd: int, out_offset: int,
                   write_by: Optional[float] = None) -> Optional[bool]:
        """Copy the fragment (``length`` bytes) into a client's buffer by descriptor, at
        ``out_offset``, without the ring and without touching the buffer from user space;
        False on any miss (or when the buffer took less, or ``write_by``, monotonic, came
        before a write into it: the client gave up, nothing more is written). None: this card
        cannot (the gateway then reads into the ring and copies from there)."""
        return None

    def write_from_fd(self, db: int, fkey: bytes, length: int, in_fd: int, in_offset: int,
                      object_bytes: int = 0, tag: bytes = b"", read_by: Optional[float] = None) -> bool:
        """``write`` of the ``length`` bytes at ``in_offset`` of a client's buffer, read by
        descriptor (``pread``) straight into the card's object, without the ring; the checksum
        is of exactly the bytes stored. False when it could not be stored: the buffer is
        shorter now than that, or its last byte was read at or after ``read_by`` (monotonic;
        the client had given up, its engine may have reused the buffer); nothing is left
        behind. Only cards with ``direct_writes``."""
        raise NotImplementedError(f"{type(self).__name__} has no direct writes")

    def process_reads(self, fkeys: list[bytes]) -> list:
        """For each fragment, an ``objfile.FileRead`` that an I/O process can do (the gateway
        packs them into ``io_procs.ReadTask``s), False when the card knows it is not stored,
        or None when this card's reads cannot run in another process. Called
        with a GET batch's fragments at once, on the gateway's loop (a card with an index looks
        them all up under one lock)."""
        return [None] * len(fkeys)

    def process_read_result(self, task, problem: Optional[str]) -> bool:
        """Account for the outcome of a ``process_reads`` task (in the gateway's process)."""
        return problem is None

    def details(self) -> dict:
        """Extra facts for STATS and the status file, cached by the card (no I/O: called on
        the control loop), e.g. a cluster's state and its nodes' roles."""
        return {}

    @abc.abstractmethod
    def clean(self) -> int:
        """Remove every object of the card; returns how many were removed."""

    @abc.abstractmethod
    def usage(self) -> CardUsage:
        """Bytes used, capacity and object count."""

    def tenant_usage(self) -> list:
        """Bytes, objects, quota and quota evictions of each namespace on the card
        (``adpkv_gateway.quotas.TenantUsage``), from memory (no I/O). Only a card that keeps
        an index knows them (fs); the others report none."""
        return []

    @abc.abstractmethod
    def check(self) -> bool:
        """Health probe: the card answers and still has the same serial."""

    # ------------------------------------------------------------------ namespace claims
    # Who owns a key namespace is recorded on the cards themselves (``adpkv_gateway.namespaces``
    # decides what a claim means), so that it survives restarts of the gateway and is the same
    # for every gateway on a shared card. ``nsid`` is the 8-byte namespace id keys carry.

    @abc.abstractmethod
    def namespace_owner(self, nsid: bytes) -> Optional[int]:
        """The uid recorded on this card as the owner of namespace ``nsid``, None when none
        is. Raises ``CardIOError`` when the card cannot answer now, ``CardError`` when a
        record is there but is not an owner this gateway wrote (damaged or planted)."""

    @abc.abstractmethod
    def claim_namespace(self, nsid: bytes, uid: int) -> int:
        """Record ``uid`` as the owner of namespace ``nsid`` unless an owner is recorded
        already; the owner recorded now (``uid``, or the one before). Atomic: of gateways
        claiming at once on a shared card exactly one wins, and a record is never replaced.
        Durable before it returns, where the card can make it so. Raises as
        ``namespace_owner``."""

    def keep_claims(self) -> None:
        """Keep the claim records from the card's own eviction (a Redis server evicts by
        its ``maxmemory-policy``, claims as any key): called every few seconds."""

    def close(self) -> None:
        """Release resources."""
