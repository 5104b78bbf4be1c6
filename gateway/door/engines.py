"""Which engine is attached: one engine (a set of ranks) per gateway."""

from __future__ import annotations

import collections
import logging
import time
from typing import Optional

from adpkv_core.wire import protocol as P

logger = logging.getLogger("adpkv.gateway")


class Peer:
    """One attached connection: a rank (``rank`` >= 0) or a lookup-only peer (``rank`` None),
    such as vLLM's scheduler process, which asks EXIST but moves no data."""

    __slots__ = ("identity", "rank", "last_seen", "pins")

    def __init__(self, identity: bytes, rank: Optional[int]):
        self.identity = identity
        self.rank = rank
        self.last_seen = time.monotonic()
        self.pins: collections.Counter = collections.Counter()


class EngineSession:
    """The engine attached to the gateway: identity, world size, namespace, layout, ranks."""

    def __init__(self, engine_id: str, world: int, namespace: str, layout: dict, uid: int):
        self.engine_id = engine_id
        self.uid = uid          # the user it belongs to: only its sessions attach to it
        self.world = world
        self.namespace = namespace
        self.layout = layout
        self.ranks: dict[int, Peer] = {}
        self.lookups: set[bytes] = set()
        self.ring = None        # ring_alloc.EngineRing, its own (``Transfers.engine_ring``)


class EngineRegistry:
    """Attaches and detaches ranks; refuses a second engine while one is attached."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.engine: Optional[EngineSession] = None
        self.peers: dict[bytes, Peer] = {}

    def attach(self, identity: bytes, msg: P.Hello, uid: int) -> Peer:
        """Attach a connection of the session of user ``uid`` (a HELLO, its fields already
        checked by the protocol); FORBIDDEN for another user's engine."""
        engine_id, rank, world, namespace, layout = msg.engine, msg.rank, msg.world, msg.namespace, msg.layout
        if identity in self.peers:
            raise P.ProtocolError(P.RANK_TAKEN, "this connection is attached already")
        engine = self.engine
        if engine is not None and engine.engine_id == engine_id and engine.uid != uid:
            raise P.ProtocolError(P.FORBIDDEN, f"engine {engine_id} belongs to another user")
        if engine is not None and engine.engine_id != engine_id:
            raise P.ProtocolError(P.ENGINE_BUSY, f"this gateway serves engine {engine.engine_id} "
                                  f"({len(engine.ranks)} of {engine.world} ranks attached); one engine per "
                                  "gateway: give the second engine a gateway of its own")
        if engine is not None and engine.world != world:
            raise P.ProtocolError(P.BAD_MESSAGE, f"engine {engine_id} attached with world {engine.world}, not {world}")
        if engine is not None and rank is not None and rank in engine.ranks:
            raise P.ProtocolError(P.RANK_TAKEN, f"rank {rank} of engine {engine_id} is attached already")
        if engine is None:
            engine = self.engine = EngineSession(engine_id, world, namespace, layout, uid)
            logger.info("Engine %s of uid %d attached (world %d, namespace %r)", engine_id, uid, world, namespace)
        peer = Peer(identity, rank)
        if rank is None:
            engine.lookups.add(identity)
        else:
            engine.ranks[rank] = peer
        self.peers[identity] = peer
        logger.info("%s of engine %s attached", _who(peer), engine_id)
        return peer

    def seen(self, identity: bytes) -> Optional[Peer]:
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()
        return peer

    def detach(self, identity: bytes, why: str) -> Optional[Peer]:
        peer = self.peers.pop(identity, None)
        if peer is None or self.engine is None:
            return peer
        if peer.rank is None:
            self.engine.lookups.discard(identity)
        else:
            self.engine.ranks.pop(peer.rank, None)
        logger.info("%s of engine %s detached (%s)", _who(peer), self.engine.engine_id, why)
        if not self.engine.ranks and not self.engine.lookups:
            logger.info("Engine %s detached; the gateway is free", self.engine.engine_id)
            self.engine = None
        return peer

    def expired(self) -> list[bytes]:
        """Identities silent for longer than the timeout."""
        limit = time.monotonic() - self.timeout_s
        return [ident for ident, peer in self.peers.items() if peer.last_seen < limit]


def _who(peer: Peer) -> str:
    return "Lookup peer" if peer.rank is None else f"Rank {peer.rank}"
