"""The card interface: one storage backend instance behind the gateway.

A card stores fragments (the unit of storage, see ``adpkv_gateway.cards.fragments``) in
``num_dbs`` databases. Only the gateway talks to cards. Every method may be
called from many I/O threads at once. A read answers a ``Read`` verdict: ``HIT``
only when the bytes are exactly those written by the write its caller expects;
anything else is a miss, never wrong data, and the verdict says whether it is
evidence about the object itself (which drops the object) or not (which drops
nothing).

Whole objects under racing writers: every write of an object stamps a random
``write_id`` into the header of each of its fragments (the head, written last,
too). A lookup learns the head's write id (``heads``) and every fragment read is
checked against it: a fragment of another write (a writer in progress, or an
object torn by two writers of different gateways) is ``Read.CHANGED``, a miss
that removes nothing. So a hit is always one write's whole object.

A fragment key is its object's key followed by a 2-byte fragment index
(``adpkv_gateway.cards.fragments.fragment_key``); fragment 0, the head, is written last
and records the size of the whole object. An object lives and dies whole: a card
that evicts, deletes or drops a fragment drops every fragment of its object.

Slot tags: every method that names fragments on the card also takes the objects' slot
tag (``tag`` / ``tags``, bytes; ``b""`` for none), which the store derives the same way
for every call about an object: with ``key_placement: dialog`` the dialog mark (8 bytes,
big-endian; every object of a dialog has the same), else ``b""`` (the object alone). A
card that groups keys (the cluster card: a Redis Cluster hash tag, so that a dialog's
objects share one slot and one node) keys fragments by it, and must be given the same
tag to find them again; every other card keys fragments without it. Every card records
the tag in the header of each fragment it writes (``objfmt``; ``tag=None``: not known,
recorded as a header written before tags were), and ``listed_heads`` hands it back: with
it the mover's sweep over a card-set change knows where an object belongs.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np

from adpkv_gateway.cards.fragments import fragment_key



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


class Read(enum.Enum):
    """The verdict of one fragment read. Only evidence about the object itself (``drops``)
    ever removes an object; ``IO_ERROR`` is also a strike against the card's health."""

    HIT = "hit"                              # the fragment, whole, of the expected write
    ABSENT = "missing"                       # not stored (no such file or key)
    TRUNCATED = "truncated"                  # shorter than its header says
    BAD_HEADER = "bad header"                # not a header of this key and size (or an older format's)
    BAD_CHECKSUM = "checksum mismatch"       # the payload is not what its header's checksum says
    FOREIGN = "not a file of the card"       # a symlink or other non-regular file at the fragment's name
    CHANGED = "of another write"             # another write of the object than the one looked up (a writer
                                             # in progress, a torn object) or stored again since: no drop
    TRANSIENT = "not readable now"           # EMFILE, ENFILE, ENOMEM, EAGAIN, EINTR, EACCES, a busy server or
                                             # one node of a cluster away: says nothing about the object
    IO_ERROR = "I/O error"                   # EIO, a lost connection, a timeout: a strike, no drop
    UNDELIVERED = "not delivered"            # the client's buffer refused the bytes (or it gave up)

    @property
    def drops(self) -> bool:
        """Whether this verdict is evidence about the object itself: the object goes, whole."""
        return self in _DROPS

    @property
    def strike(self) -> bool:
        """Whether this verdict counts against the card's health."""
        return self is Read.IO_ERROR


class NoProcessRead(enum.Enum):
    """What ``Card.process_reads`` answers for a fragment that no I/O process reads."""

    ABSENT = "not stored"                    # the card knows it is not stored: a miss, nothing to read
    HERE = "read here"                       # this card's reads cannot run in another process


class FileRead:
    """A read of one object file that an I/O process does (``Card.process_reads``): its
    directory as the reader opens it (``dir_ref``: ``/proc/<gateway>/fd/<the card's
    descriptor of the database>``, the very directory the card checked, reached through the
    gateway's descriptor, not by a path), its fragment key (the file's name there:
    ``fs_files.object_name``),
    O_DIRECT or not, the write id expected (None: any), and ``entry``, the card's index
    entry of the file (it stays in the gateway's process: the card's ``process_read_result``
    applies a failed read's verdict only while the index still holds that entry). The
    gateway packs a batch's reads into ``io_procs.ReadTask``s; the reader calls
    ``objfile.read_object_file``."""

    __slots__ = ("dir_ref", "fkey", "o_direct", "write_id", "entry")

    def __init__(self, dir_ref: str, fkey: bytes, o_direct: bool, write_id: Optional[int], entry: tuple[int, int]):
        self.dir_ref, self.fkey, self.o_direct, self.write_id, self.entry = dir_ref, fkey, o_direct, write_id, entry


ProcessRead = Union[FileRead, NoProcessRead]


_DROPS = frozenset((Read.ABSENT, Read.TRUNCATED, Read.BAD_HEADER, Read.BAD_CHECKSUM, Read.FOREIGN))


class Head(NamedTuple):
    """What an object's head fragment records: the whole object's size (always recorded, more
    than 0: every readable header is of ``objfmt.FORMAT`` 2, which has always carried it, and
    objects are never empty) and the write id stamped in every fragment of the write that
    stored it."""

    size: int
    write_id: int


@dataclasses.dataclass(frozen=True)
class FirstExtent:
    """The payload an object's head fragment must hold for the object to count (``heads_found``):
    its first extent, of the size a GET names (``object_bytes``) or else of the size the head
    records, cut at ``fragment_size`` (0: objects are not cut)."""

    object_bytes: Optional[int]
    fragment_size: int

    def __call__(self, head: Head) -> int:
        """The payload length for a head that records ``head.size``, as ``heads_holding``'s
        ``payload_len`` (every supported head records its object's size, never 0)."""
        size = self.object_bytes or head.size
        return min(size, self.fragment_size) if self.fragment_size > 0 else size

    def lengths(self, sizes: np.ndarray) -> np.ndarray:
        """The same for heads recording ``sizes`` (``int64``)."""
        size = np.full(len(sizes), self.object_bytes, np.int64) if self.object_bytes else sizes.astype(np.int64)
        return np.minimum(size, self.fragment_size) if self.fragment_size > 0 else size


class HeadsFound(NamedTuple):
    """``Card.heads_found``'s answer, by position: whether each object's head is stored
    holding its first extent, the object size it records (0: not recorded) and its write id."""

    found: np.ndarray           # bool
    size: np.ndarray            # int64
    write_id: np.ndarray        # uint64

    @classmethod
    def of(cls, heads: Sequence[Optional[Head]]) -> "HeadsFound":
        there = [h is not None for h in heads]
        return cls(np.array(there, bool), np.array([h.size if h else 0 for h in heads], np.int64),
                   np.array([h.write_id if h else 0 for h in heads], np.uint64))


class Listed(NamedTuple):
    """An object a card holds (``Card.listed_heads``): its head's database, the object's key
    and the slot tag its head records (None: not recorded, a header written before)."""

    db: int
    key: bytes
    tag: Optional[bytes]


class PlacedFile(NamedTuple):
    """A stored fragment's file a card opened read-only for MAP (``Card.open_placed``): the
    descriptor, and the card's own record of what it opened (the fs card: the index entry),
    handed back with the verdict of the file's check (``Card.placed_checked``)."""

    fd: int
    entry: tuple[int, int]


def claim_record(uid: int) -> bytes:
    """How a card records the owner of a namespace: its uid in decimal, one line."""
    return b"%d\n" % uid


def parse_claim(data: bytes, what: str) -> int:
    """The uid of a claim record (``claim_record``); CardError for anything else."""
    text = data.strip()
    if not text.isdigit() or len(text) > 10 or data != claim_record(int(text)):
        raise CardError(f"{what}: the claim record {data[:32]!r} is not an owner's uid")
    return int(text)


# One fragment to read: (database, fragment key, the buffer to fill, slot tag, the write id its
# head named at lookup: every fragment must be of it; None: any)
ReadItem = tuple[int, bytes, memoryview, bytes, Optional[int]]


class Card(abc.ABC):
    """One storage backend instance with a stable serial number: what every card does (open,
    read, write, heads, contains, delete, clean, usage, check, namespace claims, close). What
    only some cards can do is a capability below (``DirectReads``, ``DirectWrites``,
    ``HandsFiles``, ``IOProcessReads``, ``KeyedLayoutRecord``; ``BatchedReads``, ``DropsItself``,
    ``KeysByTag`` say how a card behaves), which the store asks with ``isinstance``."""

    kind: str = ""

    def __init__(self, device: str):
        self.device = device
        self.serial: str = ""

    @abc.abstractmethod
    def open(self) -> None:
        """Connect/prepare the card and learn (or assign) its serial; raises CardError."""

    @abc.abstractmethod
    def read(self, db: int, fkey: bytes, buf: memoryview, tag: bytes = b"",
             write_id: Optional[int] = None) -> Read:
        """Fill ``buf`` (exactly its length) with the fragment; its verdict (``HIT`` only when
        the fragment is whole and, with ``write_id``, of that write). May raise
        ``CardIOError`` (a transport failure)."""

    def read_many(self, items: list[ReadItem]) -> list[Union[Read, CardIOError]]:
        """Read ``(db, fragment key, buf, slot tag, write id)`` items, each as ``read`` does;
        for each: its ``Read`` verdict, or the ``CardIOError`` that failed it (a transport
        failure: nothing may be concluded about the fragment). A card that is ``BatchedReads``
        does it in fewer round trips (the cluster card: one pipeline per node, all at once)."""
        out: list[Union[Read, CardIOError]] = []
        for db, fkey, buf, tag, write_id in items:
            try:
                out.append(self.read(db, fkey, buf, tag, write_id))
            except CardIOError as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    def write(self, db: int, fkey: bytes, buf: memoryview, object_bytes: int = 0, tag: Optional[bytes] = b"",
              write_id: int = 0) -> bool:
        """Store ``buf`` atomically under ``fkey``; False if it could not be stored. ``tag``:
        the object's slot tag (None: not known, recorded as a header written before tags were).
        ``object_bytes``: the size of the whole object, recorded in its head fragment;
        ``write_id``: the write's id, stamped in the fragment's header (every fragment of one
        write of an object carries the same)."""

    @abc.abstractmethod
    def contains_many(self, items: list[tuple[int, bytes]],
                      lengths: Optional[list[Optional[int]]] = None,
                      tags: Optional[list[bytes]] = None) -> list[bool]:
        """Whether each ``(db, fragment key)`` is stored (cheap, batched; may be stale, a
        later read decides). With ``lengths``, a fragment only counts when it holds that
        many payload bytes (None: any)."""

    @abc.abstractmethod
    def heads(self, heads: list[tuple[int, bytes]], tags: Optional[list[bytes]] = None) -> list[Optional[Head]]:
        """For each ``(db, head fragment key)``: what its head records (``Head``), None for no
        head (or none this card can read)."""

    def heads_holding(self, heads: list[tuple[int, bytes]], payload_len: Callable[[Head], Optional[int]],
                      tags: Optional[list[bytes]] = None) -> list[Optional[Head]]:
        """For each ``(db, head fragment key)``: what its head records (``Head``) when the head
        fragment is stored holding ``payload_len(head)`` payload bytes (None: any), else None
        -- ``heads`` and then ``contains_many`` of the heads found at those lengths, which is
        what an EXIST asks of a card for objects of one fragment. Cards on servers do both in
        one round trip per server (the resp card: one pipeline; the cluster card: one per
        node); this default makes the two calls. A card that cannot answer raises as
        ``contains_many``."""
        recorded = self.heads(heads, tags)
        there = [i for i, h in enumerate(recorded) if h is not None]
        if not there:
            return recorded
        found = self.contains_many([heads[i] for i in there], [payload_len(h) for h in recorded if h is not None],
                                   [tags[i] for i in there] if tags else None)
        out: list[Optional[Head]] = [None] * len(heads)
        for i, hit in zip(there, found):
            if hit:
                out[i] = recorded[i]
        return out

    def heads_found(self, keys: Sequence[bytes], dbs: np.ndarray, first: FirstExtent,
                    tags: list[bytes]) -> HeadsFound:
        """``heads_holding`` of the heads of many objects (object ``keys``, their heads in
        databases ``dbs``), as arrays: what a store's EXIST asks of a card. The fs card looks
        them all up in its index at once; this default asks ``heads_holding``."""
        return HeadsFound.of(self.heads_holding([(db, fragment_key(key, 0)) for key, db in zip(keys, dbs.tolist())],
                                                first, tags))

    def object_sizes(self, heads: list[tuple[int, bytes]],
                     tags: Optional[list[bytes]] = None) -> list[Optional[int]]:
        """For each ``(db, head fragment key)``: the object size its head records, None for
        no head."""
        return [None if h is None else h.size for h in self.heads(heads, tags)]

    def listed_heads(self) -> Iterator[Listed]:
        """Every object whose head is on the card, with the slot tag its head records (for the
        mover's sweep, ``gateway/layout/mover.py``; slow: a header read per object). Raises
        ``CardIOError`` when the card cannot be listed now."""
        raise CardIOError(f"card {self.device}: a {self.kind} card cannot list its objects")

    @abc.abstractmethod
    def delete(self, db: int, fkey: bytes, tag: bytes = b"") -> bool:
        """Remove a fragment (fs: with every fragment of its object); True if it existed."""

    def delete_many(self, items: list[tuple[int, bytes]], tags: Optional[list[bytes]] = None) -> int:
        """Remove many fragments; how many of them existed."""
        return sum(self.delete(db, fkey, tags[i] if tags else b"") for i, (db, fkey) in enumerate(items))

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
        (``adpkv_gateway.cards.quotas.TenantUsage``), from memory (no I/O). Only a card that keeps
        an index knows them (fs); the others report none."""
        return []

    @abc.abstractmethod
    def check(self) -> bool:
        """Health probe: the card answers and still has the same serial."""

    # ------------------------------------------------------------------ namespace claims
    # Who owns a key namespace is recorded on the cards themselves (``adpkv_gateway.store.namespaces``
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


# =============================================================================== capabilities
# What only some cards can do, each an ABC a card class also derives from; the store asks
# ``isinstance(card, DirectReads)`` and so on. A capability of methods declares them abstract;
# ``BatchedReads``, ``DropsItself`` and ``KeysByTag`` say how a card behaves.

class DirectReads(abc.ABC):
    """A client's region is filled without the ring (the fs card)."""

    @abc.abstractmethod
    def read_to_fd(self, db: int, fkey: bytes, length: int, out_fd: int, out_offset: int,
                   write_by: Optional[float] = None, write_id: Optional[int] = None) -> Read:
        """Copy the fragment (``length`` bytes) into a client's buffer by descriptor, at
        ``out_offset``, without the ring and without touching the buffer from user space;
        its verdict as ``read`` (``UNDELIVERED`` when the buffer took less, or ``write_by``,
        monotonic, came before a write into it: the client gave up, nothing more is
        written)."""


class DirectWrites(abc.ABC):
    """A client's region is stored without the ring (the fs card)."""

    @abc.abstractmethod
    def write_from_fd(self, db: int, fkey: bytes, length: int, in_fd: int, in_offset: int,
                      object_bytes: int = 0, tag: Optional[bytes] = b"", read_by: Optional[float] = None,
                      write_id: int = 0) -> bool:
        """``write`` of the ``length`` bytes at ``in_offset`` of a client's buffer, read by
        descriptor (``pread``) straight into the card's object, without the ring; the checksum
        is of exactly the bytes stored. False when it could not be stored: the buffer is
        shorter now than that, or its last byte was read at or after ``read_by`` (monotonic;
        the client had given up, its engine may have reused the buffer); nothing is left
        behind."""


class HandsFiles(abc.ABC):
    """A stored fragment's own file can be handed out, opened read-only (MAP; the fs card)."""

    @abc.abstractmethod
    def open_placed(self, fkey: bytes) -> Optional[PlacedFile]:
        """A read-only descriptor of a stored fragment's file, one that is never written again
        while placed (what the descriptor reads stays that file's bytes whatever happens to
        its name), for MAP to check in place and hand; None when it is not stored or does
        not open."""

    @abc.abstractmethod
    def placed_checked(self, fkey: bytes, placed: PlacedFile, verdict: Read) -> Read:
        """Account for the verdict of the in-place check of a file ``open_placed`` opened, as a
        read's (a verdict that ``drops`` removes the object unless it is stale): the verdict
        the gateway acts on."""


class IOProcessReads(abc.ABC):
    """Reads an I/O process can do (``datapath.io_procs``; the fs card): a card that is not one
    has every read on the gateway's own pool."""

    @abc.abstractmethod
    def process_reads(self, fkeys: list[bytes], write_ids: list[Optional[int]]) -> list[ProcessRead]:
        """For each fragment (expected of the write ``write_ids`` names), an ``FileRead`` that
        an I/O process can do (the gateway packs them into ``io_procs.ReadTask``s),
        ``NoProcessRead.ABSENT`` when the card knows it is not stored, or
        ``NoProcessRead.HERE`` when this one cannot be read in another process. Called with a
        GET batch's fragments at once, on the gateway's loop (a card with an index looks them
        all up under one lock)."""

    @abc.abstractmethod
    def process_read_result(self, task, verdict: Read) -> Read:
        """Account for the verdict of a ``process_reads`` task (in the gateway's process): the
        verdict the gateway acts on."""


class KeyedLayoutRecord(abc.ABC):
    """The key layout record (``adpkv_gateway.layout.record``) is a key of the card's own (resp
    and cluster cards: ``resp.LAYOUT_KEY``); the fs card keeps it as a file in its directory,
    which ``layout.record`` reads and writes itself."""

    @abc.abstractmethod
    def get_layout_record(self) -> Optional[bytes]:
        """The layout record as last written, None when the card holds none. Raises
        ``CardIOError`` when the card cannot answer now."""

    @abc.abstractmethod
    def set_layout_record(self, data: bytes) -> None:
        """Replace the layout record with ``data`` (one command: atomic on the server). Raises
        ``CardIOError`` when the card cannot answer now."""


class BatchedReads(abc.ABC):
    """``Card.read_many`` does better than a loop over ``read`` (the store hands it whole
    batches: the cluster card, one pipeline per node)."""


class DropsItself(abc.ABC):
    """A read whose verdict ``drops`` has already removed the object on the card (the fs card:
    it knows whether the verdict is stale); for the others the store removes it."""


class KeysByTag(abc.ABC):
    """Fragments are keyed by their slot tag (see the module): found only with it (the cluster
    card)."""
