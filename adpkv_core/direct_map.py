"""Restores without the host copy: objects' files mapped read-only, the GPU copies from there.

The gateway hands a rank, through its door session, a read-only descriptor of each object's
file it checked in place (MAP: ``gateway/datapath/direct_reads.py``). ``DirectMaps`` (one per rank):

- ``fetch(client, keys, obj, marks)``: MAP the keys (``protocol.MAX_MAP_KEYS`` a request) and
  map each descriptor ``PROT_READ``, ``MAP_SHARED`` (the descriptor is closed once mapped, the
  mapping holds the inode). The objects of one ``fetch`` are one ``Span``: each object's payload
  mapped from its own file, back to back in one reserved range of address space, so that the
  span is registered with CUDA once (read-only pinned memory, ``cuda_registrar``; a refused
  range is registered object by object) and objects that follow each other in it are one DMA
  (``runs``: a layer's objects fetched together copy as one transfer instead of one per object).
  Spans are kept in an LRU bounded by ``limit_bytes`` (the setting ``direct_map_bytes``:
  page-cache memory this rank pins or maps); a span leaves it whole. ``prefetch`` does the same
  on the maps' own thread (off the critical path: a first restore goes by the ring, the next
  ones find the mappings).
- ``acquire(keys)``: the held mapping of each key (None: not held), counted as in use until
  ``release``: the LRU never unmaps a span a copy is reading (a GPU copy is asynchronous:
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
import ctypes
import logging
import mmap
import os
import queue
import threading
import time
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from adpkv_core import threads
from adpkv_core.wire import protocol as P

logger = logging.getLogger("adpkv.direct_map")

CUDA_HOST_REGISTER_READ_ONLY = 0x08      # cudaHostRegisterReadOnly
QUIET_WAIT_S = 5.0       # a prefetch waits at most this long for the client's restores to end
QUIET_POLL_S = 0.005

Registrar = Callable[[int, int], bool]       # (address, bytes) -> registered
Unregistrar = Callable[[int], None]


PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PROT_NONE = 0


def _mmap(addr: Optional[int], length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _libc.mmap(addr, length, prot, flags, fd, offset)
    if got in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)


class _Memory:
    """Mapped memory as numpy sees it (``__array_interface__``): read-only bytes at an address."""

    def __init__(self, address: int, shape: tuple[int, int]):
        self.__array_interface__ = {"data": (address, True), "shape": shape, "typestr": "|u1", "version": 3}


class Span:
    """The mappings of one ``fetch``: ``capacity`` slots of ``slot_bytes`` reserved together
    (``PROT_NONE``), slot i at ``base + i * slot_bytes`` holding one object's file mapped
    ``PROT_READ``, ``MAP_SHARED`` from ``page_offset`` (its payload ``lead`` bytes into the slot).
    Objects in consecutive slots are one contiguous host range. Not thread-safe: ``DirectMaps``
    fills a span on one thread, then only reads its fields under its lock."""

    def __init__(self, capacity: int, offset: int, nbytes: int):
        self.page_offset = offset - offset % PAGE
        self.lead = offset - self.page_offset
        self.nbytes = nbytes
        self.slot_bytes = -(-(self.lead + nbytes) // PAGE) * PAGE
        self.base = _mmap(None, capacity * self.slot_bytes, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        self.capacity = capacity
        self.count = 0                     # slots filled, from the first
        self.registered: list[int] = []    # addresses registered with CUDA (the span's, or its slots')
        self.live = 0                      # keys whose held mapping is in this span
        self.users = 0                     # acquired mappings in it not yet released
        self.mappings: list["Mapping"] = []    # handed out for it (their arrays go when it closes)
        self._closed = False

    def place(self, fd: int) -> int:
        """Map the next slot from descriptor ``fd``; its index. ``ValueError`` when the file is
        shorter than its object (nothing mapped), ``OSError`` from the kernel."""
        if os.fstat(fd).st_size < self.page_offset + self.lead + self.nbytes:
            raise ValueError("the object's file is shorter than its object")
        i = self.count
        _mmap(self.base + i * self.slot_bytes, self.slot_bytes, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED,
              fd, self.page_offset)
        self.count += 1
        return i

    def seal(self) -> None:
        """Give back the reserved slots left unfilled (the span's extent is ``count`` slots)."""
        if self.count < self.capacity:
            _libc.munmap(self.base + self.count * self.slot_bytes, (self.capacity - self.count) * self.slot_bytes)
            self.capacity = self.count

    @property
    def bytes(self) -> int:
        """What the span maps (and, registered, pins): its filled slots."""
        return self.count * self.slot_bytes

    def slot_address(self, i: int) -> int:
        return self.base + i * self.slot_bytes

    def rows(self, first: int, count: int) -> np.ndarray:
        """Slots ``first .. first+count-1`` as a read-only ``(count, slot_bytes)`` uint8 array
        over the mapping itself (valid while the span is mapped: ``DirectMaps`` unmaps it only
        once no acquired mapping of it is left)."""
        assert not self._closed and first + count <= self.count, "rows of a closed or unfilled span"
        return np.asarray(_Memory(self.slot_address(first), (count, self.slot_bytes)))

    def close(self) -> None:
        """Unmap it all (the caller unregistered it and no copy reads it any more)."""
        if not self._closed:
            self._closed = True
            for m in self.mappings:
                m.array = None
            _libc.munmap(self.base, self.capacity * self.slot_bytes)


class Mapping:
    """One object's payload, mapped read-only: slot ``index`` of ``span``; ``array`` (uint8,
    ``nbytes`` long) while the span is mapped, None once it is not."""

    __slots__ = ("key", "span", "index", "array")

    def __init__(self, key: bytes, span: Span, index: int):
        self.key = key
        self.span = span
        self.index = index
        self.array: Optional[np.ndarray] = span.rows(index, 1)[0, span.lead:span.lead + span.nbytes]

    @property
    def nbytes(self) -> int:
        return self.span.nbytes


class Run(NamedTuple):
    """Objects ``first .. first+objects-1`` of a list of mappings, in consecutive slots of one
    span: ``rows`` (``(objects, slot_bytes)`` uint8, read-only) holds them, each payload ``lead`` bytes
    into its row; contiguous payloads when ``lead`` is 0 and a payload fills its row."""

    first: int
    objects: int
    rows: np.ndarray
    lead: int


def runs(mappings: Sequence[Mapping]) -> Iterator[Run]:
    """``mappings`` (all held: acquired, not released) cut into ``Run``s, in order: a copy of the
    objects is one transfer per run instead of one per object."""
    j = 0
    n = len(mappings)
    while j < n:
        span, at = mappings[j].span, mappings[j].index
        k = j + 1
        while k < n and mappings[k].span is span and mappings[k].index == at + (k - j):
            k += 1
        yield Run(j, k - j, span.rows(at, k - j), span.lead)
        j = k


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
                 require_registration: bool = False, busy: Optional[Callable[[], bool]] = None):
        """``limit_bytes`` > 0 bounds the bytes mapped. ``registrar``: register each span
        (CUDA); with ``require_registration`` an object the registrar refuses is not kept (a
        pageable mapping would make the GPU copy synchronous and slow: the ring is better).
        ``busy``: whether the engine is computing now; a ``prefetch`` ``after_passes`` (what a
        pass stored, or what a restore through the ring brought) waits for it to pause as for
        the restores in flight (registering pins memory under CUDA's own locks, and the
        gateway checks each object it hands: neither may slow the engine's passes)."""
        if limit_bytes <= 0:
            raise ValueError(f"direct_map_bytes must be > 0, got {limit_bytes!r}")
        self.limit_bytes = int(limit_bytes)
        self._registrar = registrar
        self._require = require_registration
        self._busy = busy
        self._lock = threading.Lock()
        self._maps: dict[bytes, Mapping] = {}
        self._spans: "collections.OrderedDict[int, Span]" = collections.OrderedDict()    # LRU, by id()
        self._retired: list[Span] = []             # out of the LRU, still in use: closed on release
        self.mapped_bytes = 0
        self.registrations = 0                      # registrations made (a span, or an object of one)
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
                    self._spans.move_to_end(id(m.span))
                    m.span.users += 1
                    self.hits += 1
                else:
                    self.misses += 1
                out.append(m)
        return out

    def release(self, mappings: Sequence[Optional[Mapping]]) -> None:
        with self._lock:
            for m in mappings:
                if m is not None:
                    m.span.users -= 1
            done = [s for s in self._retired if s.users <= 0]
            self._retired = [s for s in self._retired if s.users > 0]
        for s in done:
            self._dispose(s)

    # ------------------------------------------------------------------ filling
    def fetch(self, client, keys: Sequence[bytes], object_bytes: int,
              marks: Optional[Sequence[int]] = None) -> int:
        """MAP the keys not held yet and keep what the gateway hands as one span (see the
        module; a batch larger than ``limit_bytes`` keeps its last keys); how many of ``keys``
        are held now. Never raises for the gateway's or CUDA's refusals (logged once)."""
        first_of: dict[bytes, int] = {}            # each key once, at its first position
        for i, k in enumerate(keys):
            first_of.setdefault(k, i)
        with self._lock:
            todo = [(i, k) for k, i in first_of.items() if k not in self._maps]
        room = max(1, self.limit_bytes // (-(-object_bytes // PAGE) * PAGE))     # objects the bound holds
        todo = todo[max(0, len(todo) - room):]
        span: Optional[Span] = None
        placed: list[tuple[bytes, int]] = []           # key, slot
        try:
            for at in range(0, len(todo), P.MAX_MAP_KEYS):
                part = todo[at:at + P.MAX_MAP_KEYS]
                pkeys = [k for _, k in part]
                pmarks = [marks[i] for i, _ in part] if marks is not None else None
                try:
                    reply, fds = client.map_objects(pkeys, object_bytes, pmarks)
                except (OSError, EOFError, ValueError, P.ProtocolError, ConnectionError) as exc:
                    self._once("door", "adpkv: direct restores off for now (MAP failed: %s); restores go "
                               "through the ring", exc)
                    break
                if not isinstance(reply, P.MapOk):
                    self._once(f"refused:{getattr(reply, 'code', '')}", "adpkv: the gateway refused MAP (%s %s); "
                               "restores go through the ring", getattr(reply, "code", ""), getattr(reply, "msg", ""))
                    break
                try:
                    if span is None and fds:
                        span = Span(len(todo), reply.offset, object_bytes)
                    if span is not None and not self._place(span, [k for k, h in zip(pkeys, reply.hits) if h], fds,
                                                            reply.offset, placed):
                        break
                finally:
                    for fd in fds:
                        os.close(fd)
        except BaseException:
            if span is not None:
                span.seal()
                span.close()
            raise
        if span is not None:
            span.seal()
            self._keep(span, placed)
        with self._lock:
            return sum(1 for k in keys if k in self._maps)

    def _place(self, span: Span, keys: list[bytes], fds: list[int], offset: int,
               placed: list[tuple[bytes, int]]) -> bool:
        """Map each descriptor into the span's next slot; False when the span can take no more
        (the kernel refused a mapping: the rest of the batch is not kept)."""
        if offset != span.page_offset + span.lead:
            self._once("offset", "adpkv: MAP handed objects at differing offsets; those go through the ring")
            return False
        for key, fd in zip(keys, fds):
            self.handed += 1
            try:
                placed.append((key, span.place(fd)))
            except (ValueError, OSError) as exc:
                self._once("mmap", "adpkv: cannot map an object's file (%s); those objects go through the ring", exc)
                if isinstance(exc, OSError):       # the kernel refused: the span takes no more
                    return False
        return True

    def _keep(self, span: Span, placed: list[tuple[bytes, int]]) -> None:
        """Register the filled span (whole, else slot by slot) and put it in the LRU."""
        if not span.count:
            span.close()
            return
        kept = placed
        if self._registrar is not None:
            register = self._registrar[0]
            if register(span.base, span.bytes):
                span.registered.append(span.base)
                self.registrations += 1
            else:
                ok = []
                for key, i in placed:
                    if register(span.slot_address(i), span.slot_bytes):
                        span.registered.append(span.slot_address(i))
                        self.registrations += 1
                        ok.append((key, i))
                if len(ok) < len(placed):
                    self._once("register", "adpkv: CUDA refused to register an object's mapping read-only "
                               "(cudaHostRegister): %s", "those restores go through the ring" if self._require
                               else "copies from it stay pageable")
                    if self._require:
                        kept = ok
        if not kept:
            self._dispose(span)
            return
        self._insert(span, kept)

    def _insert(self, span: Span, placed: list[tuple[bytes, int]]) -> None:
        out: list[Span] = []
        with self._lock:
            for key, i in placed:
                old = self._maps.get(key)
                if old is not None:
                    old.span.live -= 1
                    if old.span.live <= 0 and self._spans.pop(id(old.span), None) is not None:
                        self.mapped_bytes -= old.span.bytes
                        out.append(old.span)
                m = self._maps[key] = Mapping(key, span, i)
                span.mappings.append(m)
                span.live += 1
            self._spans[id(span)] = span
            self.mapped_bytes += span.bytes
            while self.mapped_bytes > self.limit_bytes and len(self._spans) > 1:
                _, victim = self._spans.popitem(last=False)
                self.mapped_bytes -= victim.bytes
                for m in victim.mappings:
                    if self._maps.get(m.key) is m:
                        del self._maps[m.key]
                victim.live = 0
                out.append(victim)
            self._retired.extend(v for v in out if v.users > 0)
        for v in out:
            if v.users <= 0:
                self._dispose(v)

    def _dispose(self, span: Span) -> None:
        """Unregister and unmap a span no copy reads; its mappings' arrays go first."""
        if self._registrar is not None:
            for ptr in span.registered:
                self._registrar[1](ptr)
        span.registered = []
        span.close()

    def prefetch(self, client, keys: Sequence[bytes], object_bytes: int,
                 marks: Optional[Sequence[int]] = None, after_passes: bool = False) -> None:
        """``fetch`` on the maps' own thread (queued; returns at once), once ``client`` has no
        GET in flight (and, ``after_passes``, the engine is not ``busy``), or ``QUIET_WAIT_S``
        after this call, whichever comes first: the gateway checks every object it hands, and
        that work must not slow the restores it follows (a cold restore's layers each queue
        their prefetch as they land) nor, ``after_passes``, the engine's passes (the prefill
        that stores, or the pass that computes the rest of a restored prompt)."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="adpkv-direct-map", daemon=True)
            self._thread.start()
        self._work.put((time.monotonic() + QUIET_WAIT_S, after_passes, client, list(keys), object_bytes,
                        list(marks) if marks is not None else None))

    def _serve(self) -> None:
        threads.set_up()
        while True:
            item = self._work.get()
            if item is None:
                return
            if isinstance(item, threading.Event):      # drain()
                item.set()
                continue
            until, after_passes, client, *request = item
            busy = self._busy if after_passes else None
            while ((client.restores_in_flight() or (busy is not None and busy()))
                   and time.monotonic() < until and not self._closed):
                time.sleep(QUIET_POLL_S)
            try:
                self.fetch(client, *request)
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
            return {"mapped_bytes": self.mapped_bytes, "mappings": len(self._maps), "spans": len(self._spans),
                    "registrations": self.registrations, "hits": self.hits, "misses": self.misses,
                    "handed": self.handed}

    def close(self) -> None:
        """Unregister and unmap everything (spans in use are closed when released)."""
        self._closed = True
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(10)
        with self._lock:
            spans, self._spans = list(self._spans.values()), collections.OrderedDict()
            self._maps = {}
            self.mapped_bytes = 0
            self._retired.extend(s for s in spans if s.users > 0)
        for span in spans:
            if span.users <= 0:
                self._dispose(span)
