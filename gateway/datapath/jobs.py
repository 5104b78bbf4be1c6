"""Data requests in flight: a GET or PUT job, split into batches of ring slots (the
state; ``transfers`` moves it).

A job serves one request: one rank's own (independent) or every rank's part of
a collective one. The server hands it ring extents batch by batch (at most
``MAX_BATCHES_IN_FLIGHT`` at a time), so a request larger than the ring runs
in several batches and the ring size never limits a request.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union

from adpkv_core.wire import protocol as P

from adpkv_gateway.datapath.scatter import Scatter
from adpkv_gateway.door.regions import Region

if TYPE_CHECKING:
    from adpkv_gateway.datapath.ring_alloc import EngineRing

MAX_BATCHES_IN_FLIGHT = 2


class RegionTarget(NamedTuple):
    """The other end of a region request: a registered region (``door.Region``: the client's
    file, copied to and from by its descriptor) and each object's file offset in it."""

    region: Region
    places: list[int]


class ScatterTarget(NamedTuple):
    """The other end of a scattered request: the regions of its pieces (``Scatter``) and, for
    each object, the file offset of each of its pieces."""

    scatter: Scatter
    places: list[tuple[int, ...]]


Target = Union[RegionTarget, ScatterTarget]      # a job's other end; None: the ring (its ranks copy)


class Stage(enum.Enum):
    """Where a batch is in its life (``transfers``: one place moves it on)."""

    LOOKUP = "lookup"
    READ = "read"
    TO_RANKS = "to_ranks"
    TO_REGION = "to_region"
    FILL = "fill"
    WRITE = "write"
    RETIRED = "retired"


class Participant:
    """A rank taking part in a job: where replies go and which request id they echo."""

    __slots__ = ("identity", "req_id")

    def __init__(self, identity: bytes, req_id: int):
        self.identity = identity
        self.req_id = req_id


class Batch:
    """Objects ``first .. first+count-1`` of a job placed at ring ``offset`` (see
    ``transfers`` for its stages)."""

    __slots__ = ("id", "job", "first", "count", "offset", "nbytes", "stage", "pending",
                 "flags", "waiting", "filled", "direct", "writes")

    def __init__(self, batch_id: int, job: "DataJob", first: int, count: int, offset: int, nbytes: int):
        self.id = batch_id
        self.job = job
        self.first = first
        self.count = count
        self.offset = offset
        self.nbytes = nbytes
        self.stage: Optional[Stage] = None     # None until the batch enters its first stage
        self.pending = 0                       # pool / process tasks of the stage still running
        self.flags = bytearray(count)          # per object: found / still good (GET), in the ring / stored (PUT)
        self.waiting: set[bytes] = set()       # ranks that still have to RELEASE / FILL
        self.filled = True                     # PUT: every rank filled its part
        self.direct: set[int] = set()          # GET into a region: objects read straight into it
        self.writes: list[bytes] = []          # PUT in its WRITE stage: the keys it writes

    def object_offset(self, j: int) -> int:
        return self.offset + j * self.job.stride


class DataJob:
    """One GET or PUT request of one or more ranks, made whole by ``data_requests``: its keys
    (``n`` of them), its participants, the ring of the engine that asked (``ring``: only that
    ring carries its data) and that engine's namespace (the metrics' label)."""

    def __init__(self, op: P.Op, keys: Sequence[bytes], marks: Optional[Sequence[int]], object_bytes: int,
                 stride: int, participants: list[Participant], ring: "EngineRing", namespace: str,
                 unlock: bool = False, target: Optional[Target] = None, region_by: Optional[float] = None):
        self.op = op
        self.keys = list(keys)
        self.n = len(self.keys)
        self.marks = list(marks) if marks else None
        self.object_bytes = object_bytes
        self.stride = stride
        self.participants = participants
        self.ring = ring
        self.namespace = namespace
        self.next = 0
        self.batches: dict[int, Batch] = {}
        self.results = bytearray(len(self.keys))
        self.existed = bytearray(len(self.keys))   # PUT: already stored, not written again
        self.unlock = unlock                       # GET: release this rank's pins on the keys when done
        # into/out of a client's region (or the pieces of several): the gateway copies between
        # the ring and the regions' descriptors itself; None: through the ring, the ranks copy
        self.target = target
        # into (GET) / out of (PUT) a region: no write into it / nothing read from it stored
        # after this moment (the client's give-up time, monotonic clock)
        self.region_by = region_by
        self.started = time.monotonic()           # every part arrived (the request latency's start)

    def mark(self, i: int) -> int:
        return self.marks[i] if self.marks else 0

    def finished(self) -> bool:
        return self.next >= self.n and not self.batches

    def wants_more(self) -> bool:
        return self.next < self.n and len(self.batches) < MAX_BATCHES_IN_FLIGHT
