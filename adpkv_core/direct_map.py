"""Restores without the host copy: objects' files mapped read-only, the GPU copies from there.

The gateway hands a rank, through its door session, a read-only descriptor of each object's
file it checked in place (MAP: ``gateway/direct_reads.py``). ``DirectMaps`` (one per rank):

- ``fetch(client, keys, obj, marks)``: MAP the keys (``protocol.MAX_MAP_KEYS`` a request),
  map each descriptor ``PROT_READ``, ``MAP_SHARED`` (``mmap.ACCESS_READ``; the descriptor is
  closed once mapped, the mapping holds the inode), register it with CUDA as read-only pinned
  memory where a ``register`` function is given (``cuda_registrar``), and keep it: an LRU of
  mappings bounded by ``limit_bytes`` (the setting ``direct_map_bytes``: page-cache memory this
  rank pins or maps). ``prefetch`` does the same on the maps' own thread (off the critical
  path: a first restore goes by the ring, the next ones find the mappings).
- ``acquire(keys)``: the held mapping of each key (None: not held), counted as in use until
  ``release``: the LRU never unmaps a mapping a copy is reading (a GPU copy is asynchronous:
  release after its stream has passed it).
- a refusal (the gateway's error, CUDA refusing a registration) makes that request's keys
  misses here (the adapter restores them through the ring); each kind of refusal is logged once.

What a mapping holds is one write of the key's object, whole, checked by the gateway just
before it was handed, in a file that is never written again: an eviction, a delete or a new
write of the key at the gateway unlinks or replaces the name, not these bytes. A held mapping
is used for its key until it leaves the LRU (it is a correct value of the key: keys name their
content). Metrics: ``stats()``.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import queue
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from . import protocol as P

logger = logging.getLogger("adpkv.direct_map")

CUDA_HOST_REGISTER_READ_ONLY = 0x08      # cudaHostRegisterReadOnly

Registrar = Callable[[int, int], bool]       # (address, bytes) -> registered
Unregistrar = Callable[[int], None]


class Mapping:
    """One object's payload, mapped read-only (``array``: uint8, ``nbytes`` long)."""

    __slots__ = ("key", "nbytes", "array", "registered", "users", "_mm", "_at")

    def __init__(self, key: bytes, mm: mmap.mmap, offset: int, nbytes: int):
        self.key = key
        self.nbytes = nbytes
        self._mm = mm
        self._at = offset
        self.array: Optional[np.ndarray] = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset)
        self.registered = False
        self.users = 0

    @property
    def address(self) -> int:
        assert self.array is not None, "a closed mapping has no address"
        return int(self.array.ctypes.data)

    def region(self) -> tuple[int, int]:
        """The mapping's whole extent (page-aligned start, bytes): what is registered."""
        start = self.address - self._at
        return start, self._at + self.nbytes

    def close(self) -> None:
        self.array = None       # the buffer export must go before the mapping can close
        self._mm.close()


def map_descriptor(fd: int, key: bytes, offset: int, nbytes: int) -> Mapping:
    """Map ``nbytes`` at ``offset`` of the read-only descriptor ``fd`` (from 0: mappings start on
    a page) ``PROT_READ``, ``MAP_SHARED``. ``ValueError`` when the file is shorter."""
    if os.fstat(fd).st_size < offset + nbytes:
        raise ValueError("the object's file is shorter than its object")
    return Mapping(key, mmap.mmap(fd, offset + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), offset, nbytes)


def cuda_registrar() -> Optional[tuple[Registrar, Unregistrar]]:
    """``cudaHostRegister(ptr, n, cudaHostRegisterReadOnly)`` / ``cudaHostUnregister`` through
    torch's CUDA runtime; None without CUDA (mappings stay pageable: plain copies)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    rt = torch.cuda.cudart()

    def register(ptr: int, n: int) -> bool:
        rc = int(rt.cudaHostRegister(ptr, n, CUDA_HOST_REGISTER_READ_ONLY))
        if rc != 0:
            rt.cudaGetLastError()          # clear it, or the next launch reports it
            logger.debug("cudaHostRegister of %d bytes: error %d", n, rc)
        return rc == 0

    def unregister(ptr: int) -> None:
        rt.cudaHostUnregister(ptr)
    return register, unregister


class DirectMaps:
    """A rank's read-only mappings of objects (see the module). Thread-safe."""

    def __init__(self, limit_bytes: int, registrar: Optional[tuple[Registrar, Unregistrar]] = None,
                 require_registration: bool = False):
        """``limit_bytes`` > 0 bounds the bytes mapped. ``registrar``: register each mapping
        (CUDA); with ``require_registration`` a mapping the registrar refuses is not kept (a
        pageable mapping would make the GPU copy synchronous and slow: the ring is better)."""
        if limit_bytes <= 0:
            raise ValueError(f"direct_map_bytes must be > 0, got {limit_bytes!r}")
        self.limit_bytes = int(limit_bytes)
        self._registrar = registrar
        self._require = require_registration
        self._lock = threading.Lock()
        self._maps: "collections.OrderedDict[bytes, Mapping]" = collections.OrderedDict()
        self._retired: list[Mapping] = []          # out of the LRU, still in use: closed on release
        self.mapped_bytes = 0
        self.registrations = 0                      # registrations made
        self.hits = 0                               # acquire() found a mapping
        self.misses = 0
        self.handed = 0                             # descriptors received
        self._logged: set[str] = set()
        self._work: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------------ use
    def acquire(self, keys: Sequence[bytes]) -> list[Optional[Mapping]]:
        """The held mapping of each key (None where none), each marked in use until ``release``."""
        out: list[Optional[Mapping]] = []
        with self._lock:
            for key in keys:
                m = self._maps.get(key)
                if m is not None:
                    self._maps.move_to_end(key)
                    m.users += 1
                    self.hits += 1
                else:
                    self.misses += 1
                out.append(m)
        return out

    def release(self, mappings: Sequence[Optional[Mapping]]) -> None:
        with self._lock:
            for m in mappings:
                if m is not None:
                    m.users -= 1
            done = [m for m in self._retired if m.users <= 0]
            self._retired = [m for m in self._retired if m.users > 0]
        for m in done:
            self._dispose(m)

    # ------------------------------------------------------------------ filling
    def fetch(self, client, keys: Sequence[bytes], object_bytes: int,
              marks: Optional[Sequence[int]] = None) -> int:
        """MAP the keys not held yet and keep what the gateway hands (see the module); how many
        of ``keys`` are held now. Never raises for the gateway's or CUDA's refusals (logged once)."""
        with self._lock:
            todo = [(i, k) for i, k in enumerate(keys) if k not in self._maps]
        for at in range(0, len(todo), P.MAX_MAP_KEYS):
            part = todo[at:at + P.MAX_MAP_KEYS]
            pkeys = [k for _, k in part]
            pmarks = [marks[i] for i, _ in part] if marks is not None else None
            try:
                reply, fds = client.map_objects(pkeys, object_bytes, pmarks)
            except (OSError, EOFError, ValueError, P.ProtocolError, ConnectionError) as exc:
                self._once("door", "adpkv: direct restores off for now (MAP failed: %s); restores go through "
                           "the ring", exc)
                break
            if not isinstance(reply, P.MapOk):
                self._once(f"refused:{getattr(reply, 'code', '')}", "adpkv: the gateway refused MAP (%s %s); "
                           "restores go through the ring", getattr(reply, "code", ""), getattr(reply, "msg", ""))
                break
            self._keep([k for k, h in zip(pkeys, reply.hits) if h], fds, reply.offset, object_bytes)
        with self._lock:
            return sum(1 for k in keys if k in self._maps)

    def _keep(self, keys: list[bytes], fds: list[int], offset: int, nbytes: int) -> None:
        for key, fd in zip(keys, fds):
            try:
                m = map_descriptor(fd, key, offset, nbytes)
            except (OSError, ValueError) as exc:
                self._once("mmap", "adpkv: cannot map an object's file (%s); those objects go through the ring", exc)
                continue
            finally:
                os.close(fd)
            self.handed += 1
            if self._registrar is not None:
                if self._registrar[0](*m.region()):
                    m.registered = True
                    self.registrations += 1
                else:
                    self._once("register", "adpkv: CUDA refused to register an object's mapping read-only "
                               "(cudaHostRegister): %s", "those restores go through the ring" if self._require
                               else "copies from it stay pageable")
                    if self._require:
                        m.close()
                        continue
            self._insert(m)

    def _insert(self, m: Mapping) -> None:
        out: list[Mapping] = []
        with self._lock:
            old = self._maps.pop(m.key, None)
            if old is not None:
                self.mapped_bytes -= old.nbytes
                out.append(old)
            self._maps[m.key] = m
            self.mapped_bytes += m.nbytes
            while self.mapped_bytes > self.limit_bytes and len(self._maps) > 1:
                _, victim = self._maps.popitem(last=False)
                self.mapped_bytes -= victim.nbytes
                out.append(victim)
            keep = [v for v in out if v.users > 0]
            self._retired.extend(keep)
        for v in out:
            if v.users <= 0:
                self._dispose(v)

    def _dispose(self, m: Mapping) -> None:
        if m.registered and self._registrar is not None:
            self._registrar[1](m.region()[0])
            m.registered = False
        m.close()

    def prefetch(self, client, keys: Sequence[bytes], object_bytes: int,
                 marks: Optional[Sequence[int]] = None) -> None:
        """``fetch`` on the maps' own thread (queued; returns at once)."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="adpkv-direct-map", daemon=True)
            self._thread.start()
        self._work.put((client, list(keys), object_bytes, list(marks) if marks is not None else None))

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            if isinstance(item, threading.Event):      # drain()
                item.set()
                continue
            try:
                self.fetch(*item)
            except Exception:
                logger.exception("adpkv: mapping objects failed")

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued ``prefetch`` has run (tests, benchmarks)."""
        if self._thread is None:
            return True
        ev = threading.Event()
        self._work.put(ev)
        return ev.wait(timeout_s)

    def _once(self, kind: str, fmt: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning(fmt, *args)

    # ------------------------------------------------------------------ state
    def held(self, key: bytes) -> bool:
        with self._lock:
            return key in self._maps

    def stats(self) -> dict:
        with self._lock:
            return {"mapped_bytes": self.mapped_bytes, "mappings": len(self._maps),
                    "registrations": self.registrations, "hits": self.hits, "misses": self.misses,
                    "handed": self.handed}

    def close(self) -> None:
        """Unregister and unmap everything (mappings in use are closed when released)."""
        self._closed = True
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(10)
        with self._lock:
            maps, self._maps = list(self._maps.values()), collections.OrderedDict()
            self.mapped_bytes = 0
            busy = [m for m in maps if m.users > 0]
            self._retired.extend(busy)
        for m in maps:
            if m.users <= 0:
                self._dispose(m)

