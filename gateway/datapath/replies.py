"""Replies to the engines' connections: the gateway's one sender on its control socket.

Contract (``Replies``, one per gateway, on the loop's thread only: the socket's one user):

- ``send(identity, message)``: encodes ``message`` and sends it to the connection
  ``identity`` at once, never blocking; a connection gone meanwhile loses it (logged at
  debug level): a reply is owed only to a connection that is still there.
- ``batch(batch)``: BATCH of ``batch`` (its objects, ring extent, stride, object size; a
  GET's hits so far) to each participant of its job that is attached now; the identities it
  went to, which are the ranks the batch then waits for (RELEASE or FILLED).
- ``done(job)``: DONE of ``job`` (GET: its hits; PUT: stored and existed) to each participant
  that is attached now; the identities it went to.

The data path (``transfers.Transfers``, ``data_requests.DataRequests``) is given it when it is
made and sends its messages through it itself; the loop (``loop.server.Gateway``) makes it
over its socket and sends its own replies through it too.
"""

from __future__ import annotations

import logging

import zmq

from adpkv_core.wire import protocol as P

from adpkv_gateway.datapath.jobs import Batch, DataJob
from adpkv_gateway.door.engines import EngineRegistry

logger = logging.getLogger("adpkv.gateway")


class Replies:
    """Messages to the attached connections over the control socket ``sock`` (a ROUTER); who
    is attached: ``engines`` (see the module's contract)."""

    def __init__(self, sock: zmq.Socket, engines: EngineRegistry):
        self._sock = sock
        self._engines = engines

    def send(self, identity: bytes, msg: P.Message) -> None:
        try:
            self._sock.send_multipart([identity, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("reply to a gone peer dropped: %s", exc)

    def batch(self, batch: Batch) -> set[bytes]:
        job = batch.job
        hits = bytes(batch.flags) if job.op is P.Op.GET else None
        sent = set()
        for p in job.participants:
            if p.identity in self._engines.peers:
                self.send(p.identity, P.Batch(id=p.req_id, batch=batch.id, first=batch.first, count=batch.count,
                                              offset=batch.offset, stride=job.stride, obj=job.object_bytes,
                                              hits=hits))
                sent.add(p.identity)
        return sent

    def done(self, job: DataJob) -> list[bytes]:
        results = bytes(job.results)
        sent = []
        for p in job.participants:
            if p.identity in self._engines.peers:
                if job.op is P.Op.GET:
                    self.send(p.identity, P.Done(id=p.req_id, hits=results))
                else:
                    self.send(p.identity, P.Done(id=p.req_id, stored=results, existed=bytes(job.existed)))
                sent.append(p.identity)
        return sent
