"""GET and PUT requests -> data jobs (``jobs.DataJob``) that ``transfers.Transfers`` runs.

Contract (``DataRequests``, one per gateway, on the loop's thread only):

- ``serve(identity, peer, msg, settled)``: one rank's GET or PUT, in its turn among the requests
  that name keys (the loop serves them in the order they came), checked and run in one call.
  It refuses a bad one with ``ProtocolError`` before anything is done for it (the loop answers
  ERROR; nothing changed, nothing claimed): from a lookup peer (no rank), of no key, an object
  whose ring stride is over half the ring (TOO_LARGE), a region or piece its session did not
  register or a place outside its region (BAD_REGION); then one that names a namespace its
  session's user may not use (FORBIDDEN: ``NamespaceOwners.verdict``). It answers
  ``namespaces.Unresolved`` when the owners of some of its namespaces must be looked up first
  (the loop has them resolved, then serves it again with what was found: ``settled``), else
  None: the request is a job, or a part of a collective (below).
- A region request (``region``) or a scattered one (``pieces``) is a job of its rank at once,
  and so is a request without ``tag`` or any request of a one-rank engine.
- A tagged request of a multi-rank engine is its rank's part of a collective: it waits until
  every rank of the engine sent its part of that tag, then all parts run as one job (one ring
  extent per batch for every rank). A rank that sends a tag twice, or parts that differ (op,
  keys, object size), fail the collective: COLLECTIVE_MISMATCH to every rank in it.
- ``rank_left(identity, rank)``: a rank detached; every collective still waiting fails for the
  other ranks in it (it needs every rank), the rank that left gets no answer.
- Counters (the gateway's, shown by STATS): ``get_requests``/``put_requests`` per job started,
  ``get_region_requests``/``put_region_requests`` per region or scattered request.
"""

from __future__ import annotations

import collections
import logging
from typing import Optional, Union

from adpkv_core.wire import protocol as P
from adpkv_core.memory.ring import max_parallel_ios, object_stride

from adpkv_gateway.door.entry import Session
from adpkv_gateway.door.engines import EngineRegistry, EngineSession, Peer
from adpkv_gateway.datapath.jobs import DataJob, Participant, RegionTarget, ScatterTarget, Target
from adpkv_gateway.datapath.replies import Replies
from adpkv_gateway.datapath.scatter import Scatter
from adpkv_gateway.datapath.transfers import Transfers
from adpkv_gateway.store.namespaces import Found, NamespaceOwners, Unresolved

logger = logging.getLogger("adpkv.gateway")


class DataRequests:
    """The GET/PUT requests of the attached ranks, and the collectives not complete yet.

    ``sessions_by_peer``: the door session each attached connection came with (its user, its
    regions); ``namespaces``: who owns each key namespace; ``replies`` sends to a rank
    (``replies.Replies``)."""

    def __init__(self, engines: EngineRegistry, sessions_by_peer: dict[bytes, Session], namespaces: NamespaceOwners,
                 transfers: Transfers, counters: collections.Counter, replies: Replies):
        self.engines = engines
        self.sessions_by_peer = sessions_by_peer
        self.namespaces = namespaces
        self.transfers = transfers
        self.counters = counters
        self._replies = replies
        self.ring_size = transfers.ring_size
        self.max_batch_bytes = transfers.max_batch_bytes
        self.object_sizes_logged: set[int] = set()
        # tag -> rank -> (its connection, its request): the parts of collectives not complete yet
        self.collectives: dict[str, dict[int, tuple[bytes, Union[P.Get, P.Put]]]] = {}

    def serve(self, identity: bytes, peer: Peer, msg: Union[P.Get, P.Put],
              settled: Optional[Found] = None) -> Optional[Unresolved]:
        """Check one rank's GET or PUT and run it (see the module's contract)."""
        target = self._check(identity, peer, msg)
        unresolved = self.namespaces.verdict(self.sessions_by_peer[identity].uid, msg, settled)
        if unresolved is None:
            self._on_data(identity, peer, msg, target)
        return unresolved

    def _check(self, identity: bytes, peer: Peer, msg: Union[P.Get, P.Put]) -> Optional[Target]:
        """Refuse a bad GET or PUT (see the module's contract); the other end of a region or
        scattered request (``jobs.RegionTarget``, ``jobs.ScatterTarget``: its region(s) and
        each object's places there, checked); None for one through the ring."""
        if peer.rank is None:
            raise P.ProtocolError(P.BAD_MESSAGE, f"a lookup peer cannot {msg.op}; attach as a rank")
        if not msg.keys:         # a job of no object never finishes: no answer, and CLEAN refused for good
            raise P.ProtocolError(P.BAD_MESSAGE, f"{msg.op} names no key")
        obj, region = msg.obj, msg.region
        stride = object_stride(obj)
        if obj not in self.object_sizes_logged and len(self.object_sizes_logged) < 8:
            self.object_sizes_logged.add(obj)
            logger.info("Objects of %d bytes (io_size): max_parallel_ios = %d", obj,
                        max_parallel_ios(self.ring_size, obj))
        if stride > self.max_batch_bytes:
            raise P.ProtocolError(P.TOO_LARGE, f"an object of {obj} bytes does not fit half the ring "
                                  f"({self.max_batch_bytes} bytes); raise shared_memory_size")
        at = msg.at
        if at is None:                  # through the ring (a region or scattered request names its places: decoded so)
            return None
        regions = self.sessions_by_peer[identity].regions
        if msg.pieces is not None:
            if any(piece.region >= len(regions) for piece in msg.pieces):
                raise P.ProtocolError(P.BAD_REGION, "a piece names a region this session did not register")
            scatter = Scatter([regions[p.region] for p in msg.pieces], [p.length for p in msg.pieces])
            return ScatterTarget(scatter, scatter.places(at, len(msg.keys)))
        assert region is not None       # at names places of a region or of pieces (the protocol's check)
        if region >= len(regions):
            raise P.ProtocolError(P.BAD_REGION, f"region {region} is not registered by this session")
        return RegionTarget(regions[region], regions[region].places(at, obj))

    def _on_data(self, identity: bytes, peer: Peer, msg: Union[P.Get, P.Put], target: Optional[Target]) -> None:
        """One rank's GET or PUT that passed its checks (``target``: what ``_check`` found): a job,
        or a part of a collective (see the module's contract)."""
        engine, tag = self.engines.engine, msg.tag
        assert engine is not None          # attached: the request came from one of its ranks
        if target is not None or tag is None or engine.world == 1:
            self._start(engine, msg, [Participant(identity, msg.id)], target)
            return
        rank = peer.rank
        assert rank is not None             # _check() refused a lookup peer (no rank)
        parts = self.collectives.setdefault(tag, {})
        if rank in parts:
            del self.collectives[tag]
            self._fail_collective(parts, f"rank {peer.rank} sent tag {tag!r} twice")
            raise P.ProtocolError(P.COLLECTIVE_MISMATCH, f"rank {peer.rank} sent tag {tag!r} twice")
        parts[rank] = (identity, msg)
        if len(parts) < engine.world:
            return
        del self.collectives[tag]
        first = parts[0][1] if 0 in parts else next(iter(parts.values()))[1]
        for ident, m in parts.values():
            if type(m) is not type(first) or m.keys != first.keys or m.obj != first.obj:
                self._fail_collective(parts, f"ranks sent different requests for tag {tag!r}")
                return
        self._start(engine, msg, [Participant(ident, m.id) for ident, m in parts.values()], None)

    def _fail_collective(self, parts, why: str) -> None:
        for ident, m in parts.values():
            self._replies.send(ident, P.error(m.id, P.COLLECTIVE_MISMATCH, why))

    def _start(self, engine: EngineSession, msg: Union[P.Get, P.Put], participants: list[Participant],
               target: Optional[Target]) -> None:
        """The job of ``msg`` (a collective's last part: its keys, the same as every part's) for
        ``participants``, through ``engine``'s ring (only the asking engine's ring carries its data)."""
        op = P.Op(msg.op)
        region_by = None
        if target is not None:
            region_by = msg.write_by if isinstance(msg, P.Get) else msg.read_by
            self.counters[op.lower() + "_region_requests"] += 1
        self.counters[op.lower() + "_requests"] += 1
        self.transfers.start(DataJob(op, msg.keys, msg.marks, msg.obj, object_stride(msg.obj), participants,
                                     self.transfers.engine_ring(engine), engine.namespace,
                                     unlock=isinstance(msg, P.Get) and msg.unlock, target=target,
                                     region_by=region_by))

    def rank_left(self, identity: bytes, rank: int) -> None:
        """A rank detached: a collective needs every rank, none that is still waiting can complete now."""
        for tag, parts in list(self.collectives.items()):
            del self.collectives[tag]
            self._fail_collective({r: v for r, v in parts.items() if v[0] != identity},
                                  f"rank {rank} left before the collective {tag!r} was complete")
