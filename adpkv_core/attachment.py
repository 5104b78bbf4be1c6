"""One attachment of an engine rank (or lookup peer) to its gateway, for every adapter.

The vLLM connector and OffloadingSpec, the LMCache L2 adapter and the SGLang
HiCache backend all hold their gateway through an ``Attachment``:

- it creates the rank's ``GatewayClient`` and, when that client has turned
  itself off (the gateway died or restarted), builds a new one once a gateway
  answers again. One back-off policy for everybody (``Backoff``): the first
  attempt ``reconnect_s`` after the loss, then doubling up to ``max_backoff_s``
  (60 s). Each attempt first asks ``gateway_answers`` (is the door served by
  a user we trust; one PING, no attachment) and builds a client only when it answers.
- attempts run on the attachment's own watcher thread (or inline, when the
  adapter asks for it with ``watch_s=0``), never inside a request: an adapter
  takes ``session()`` once at the start of a request and uses that session to
  the end, so a request that started on the old client finishes on it (as
  misses). With ``install="on_refresh"`` a fresh session waits until the
  adapter calls ``refresh()`` at a point between requests (vLLM: a step).
- the loss is logged once, by the client ("External KV cache turned off on
  this rank"); the return once, here ("External KV cache back on this rank").
- ``on_attach(session)`` runs for every new session before any request can see
  it (the LMCache adapter registers its L1 region there); ``on_detach(session)``
  after a session was replaced or at close (vLLM unpins its CUDA ring there).
- a session carries its ring as a ``RingView`` (``adpkv_core.ringview``: bounds-checked
  copies between ring slots and host buffers, shared by the adapters).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional

from adpkv_core import threads
from adpkv_core.client import LOOKUPS_OFF_MESSAGE, TURNED_OFF_MESSAGE, GatewayClient, gateway_answers
from adpkv_core.ringview import RingView
from adpkv_core.settings import ClientConfig, parse_number

logger = logging.getLogger("adpkv.attachment")

BACK_ON_MESSAGE = "External KV cache back on this rank"
LOOKUPS_BACK_MESSAGE = "External KV cache lookups back on for this engine"   # a lookup-only peer
DEFAULT_RECONNECT_S = 5.0
MAX_BACKOFF_S = 60.0

__all__ = ["Attachment", "Backoff", "Session", "reconnect_setting",
           "BACK_ON_MESSAGE", "LOOKUPS_BACK_MESSAGE", "TURNED_OFF_MESSAGE", "LOOKUPS_OFF_MESSAGE",
           "DEFAULT_RECONNECT_S", "MAX_BACKOFF_S"]


class Session:
    """One client of an attachment, its ring view, and the adapter's state for it
    (``state``: e.g. the region id the LMCache adapter registered on this attachment)."""

    __slots__ = ("client", "ring", "number", "state", "__weakref__")

    def __init__(self, client: GatewayClient, number: int):
        self.client = client
        self.number = number
        self.state: dict[str, Any] = {}
        ring = client.ring if client.enabled else None
        self.ring: Optional[RingView] = RingView(ring) if ring is not None else None

    @property
    def enabled(self) -> bool:
        if not self.client.enabled:
            return False
        return self.client.rank is None or self.ring is not None

    def __repr__(self) -> str:
        return f"Session(#{self.number}, {'on' if self.enabled else 'off'})"


class Backoff:
    """When to try again: ``first_s`` after the loss, then doubling up to ``cap_s``.

    ``lost(now)`` arms it, ``due(now)`` says whether an attempt may run, ``failed(now)``
    doubles the wait after a failed attempt, ``reset()`` disarms it (attached again).
    """

    def __init__(self, first_s: float, cap_s: float = MAX_BACKOFF_S):
        self.first_s = float(first_s)
        self.cap_s = max(float(cap_s), self.first_s)
        self.delay = self.first_s
        self.next_at: Optional[float] = None

    @property
    def armed(self) -> bool:
        return self.next_at is not None

    def lost(self, now: float) -> None:
        self.delay = self.first_s
        self.next_at = now + self.delay

    def due(self, now: float) -> bool:
        return self.next_at is not None and now >= self.next_at

    def failed(self, now: float) -> None:
        self.delay = min(self.cap_s, self.delay * 2)
        self.next_at = now + self.delay

    def reset(self) -> None:
        self.delay = self.first_s
        self.next_at = None


def reconnect_setting(settings: Any, default: float = DEFAULT_RECONNECT_S, prefix: str = "adpkv.") -> float:
    """``reconnect_s`` from an adapter's settings mapping (``<prefix>reconnect_s`` or
    ``reconnect_s``): seconds before the first re-attach attempt; 0 = never. Raises
    ``ValueError`` on a value that is not a number >= 0."""
    raw = default
    for k in (prefix + "reconnect_s", "reconnect_s"):
        if settings and k in settings and settings[k] is not None:
            raw = settings[k]
            break
    return parse_number(raw, "reconnect_s", "seconds")


# ---------------------------------------------------------------------------- attachment
_live: "weakref.WeakSet[Attachment]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:       # BYE at exit: the gateway frees the engine at once
    for a in list(_live):
        try:
            a.close()
        except Exception:
            pass


class Attachment:
    """The gateway attachment of one rank (``rank=None``: a lookup-only peer); see the module doc.

    ``layout`` is the dict (or a callable returning it) sent with every HELLO.
    ``install``: ``"at_once"`` (a fresh session replaces the dead one as soon as it is
    built: for adapters that take ``session()`` per request) or ``"on_refresh"`` (only
    when the adapter calls ``refresh()`` between requests). ``watch_s``: how often the
    watcher thread looks at the client (0: no thread; ``refresh()`` then makes the
    attempts itself, blocking that call for one probe and one HELLO).
    ``reconnect_s`` 0: never re-attach. ``attach_now=False`` leaves the first attach to
    ``attach()``. ``clock``, ``client_factory`` and ``probe`` are for tests.
    """

    def __init__(self, config: ClientConfig, engine_id: str, rank: Optional[int], world_size: int,
                 layout: Any = None, *, reconnect_s: float = DEFAULT_RECONNECT_S,
                 max_backoff_s: float = MAX_BACKOFF_S,
                 on_attach: Optional[Callable[[Session], None]] = None,
                 on_detach: Optional[Callable[[Session], None]] = None,
                 install: str = "at_once", watch_s: float = 0.25, probe_timeout_s: float = 0.3,
                 attach_now: bool = True, name: str = "adpkv",
                 clock: Callable[[], float] = time.monotonic,
                 client_factory: Callable[..., GatewayClient] = GatewayClient,
                 probe: Callable[[ClientConfig, float], bool] = gateway_answers):
        if install not in ("at_once", "on_refresh"):
            raise ValueError(f"install must be 'at_once' or 'on_refresh', not {install!r}")
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.reconnect_s = float(reconnect_s)
        self.backoff = Backoff(self.reconnect_s or 1.0, max_backoff_s)
        self.reattaches = 0           # fresh sessions installed after a loss
        self.attempts = 0             # re-attach attempts made (probes included)
        self.name = name
        self._layout = layout
        self._on_attach = on_attach
        self._on_detach = on_detach
        self._install_at_once = install == "at_once"
        self._probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._factory = client_factory
        self._probe = probe
        self._lock = threading.Lock()
        self._session: Optional[Session] = None
        self._staged: Optional[Session] = None
        self._attempting = False
        self._numbers = 0
        self._closed = False
        self._stop = threading.Event()
        self._watch_s = float(watch_s)
        self._watcher: Optional[threading.Thread] = None
        _live.add(self)
        if attach_now:
            self.attach()

    # ------------------------------------------------------------------ state
    @property
    def session(self) -> Optional[Session]:
        """The installed session (None before the first attach and after close); no side effects."""
        return self._session

    @property
    def client(self) -> Optional[GatewayClient]:
        s = self._session
        return s.client if s is not None else None

    @property
    def enabled(self) -> bool:
        s = self._session
        return s is not None and s.enabled

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ attach
    def attach(self) -> Optional[Session]:
        """The first attach, now (blocks up to ``connect_timeout_s`` when nobody answers).
        Starts the watcher. Later calls just return the installed session."""
        with self._lock:
            if self._closed or self._session is not None:
                return self._session
        s = self._new_session()
        with self._lock:
            if self._closed:
                self._dispose(s)
                return None
            self._session = s
        if self._watch_s > 0 and self.reconnect_s > 0 and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name=f"{self.name}-attach-{self.rank}")
            self._watcher.start()
        return s

    def refresh(self) -> Optional[Session]:
        """Call between requests: installs a fresh session when one is ready (and, without
        a watcher thread, makes a due attempt now). Returns the session to use."""
        if self._watcher is None:
            self.tick()
        self._install()
        return self._session

    def tick(self) -> None:
        """One step of the policy (the watcher calls it every ``watch_s``)."""
        now = self._clock()
        with self._lock:
            if self._closed or self._attempting or self._staged is not None:
                return
            s = self._session
            if s is None:
                return
            if s.enabled:
                if self.backoff.armed:
                    self.backoff.reset()
                return
            if self.reconnect_s <= 0:
                return
            if not self.backoff.armed:            # the loss is seen now: first attempt later
                self.backoff.lost(now)
                logger.debug("%s: rank %s lost its gateway; first re-attach attempt in %.1f s",
                             self.name, self.rank, self.backoff.delay)
                return
            if not self.backoff.due(now):
                return
            self._attempting = True
            self.attempts += 1
        fresh: Optional[Session] = None
        try:
            fresh = self._attempt()
        except Exception:   # never let a bug stop the policy
            logger.exception("%s: re-attach attempt failed", self.name)
        with self._lock:
            self._attempting = False
            if fresh is not None and not self._closed:
                self._staged = fresh
            else:
                self.backoff.failed(self._clock())
                logger.debug("%s: no gateway yet on %s:%d; next attempt in %.1f s", self.name,
                             self.config.host, self.config.port, self.backoff.delay)
            if fresh is not None and self._closed:
                stale, fresh = fresh, None
            else:
                stale = None
        if stale is not None:
            self._dispose(stale)
        if fresh is not None and self._install_at_once:
            self._install()

    def _attempt(self) -> Optional[Session]:
        if not self._probe(self.config, self._probe_timeout_s):
            return None
        s = self._new_session()
        if not s.enabled:
            self._dispose(s)
            return None
        return s

    def _new_session(self) -> Session:
        layout = self._layout() if callable(self._layout) else self._layout
        client = self._factory(self.config, self.engine_id, self.rank, self.world_size, dict(layout or {}))
        with self._lock:
            self._numbers += 1
            number = self._numbers
        s = Session(client, number)
        if s.enabled and self._on_attach is not None:
            try:
                self._on_attach(s)
            except Exception:
                logger.exception("%s: setting up a new gateway attachment failed", self.name)
        return s

    def _install(self) -> None:
        with self._lock:
            fresh, self._staged = self._staged, None
            if fresh is None or self._closed:
                old = None
            elif not fresh.enabled:               # lost again before it was used
                old, fresh = fresh, None
                self.backoff.lost(self._clock())
            else:
                old, self._session = self._session, fresh
                self.reattaches += 1
                self.backoff.reset()
        if fresh is not None:
            message = LOOKUPS_BACK_MESSAGE if self.rank is None else BACK_ON_MESSAGE
            logger.warning("%s (gateway %s:%d answers again; re-attached as %s)", message,
                           self.config.host, self.config.port,
                           "a lookup peer" if self.rank is None else f"rank {self.rank}/{self.world_size}")
        if old is not None:
            self._dispose(old)

    def _dispose(self, s: Session) -> None:
        # the client first: close() joins its I/O thread, so no copy of this session runs
        # any more when on_detach releases what the copies used (e.g. a CUDA-pinned ring)
        try:
            s.client.close()
        except Exception:
            logger.debug("closing an adpkv client failed", exc_info=True)
        if self._on_detach is not None:
            try:
                self._on_detach(s)
            except Exception:
                logger.exception("%s: releasing an old gateway attachment failed", self.name)

    def _watch(self) -> None:
        threads.set_up()
        while not self._stop.wait(self._watch_s):
            try:
                self.tick()
            except Exception:
                logger.exception("%s: attachment watcher", self.name)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Detach (BYE) and stop the watcher; later ``session`` is None."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            s, self._session = self._session, None
            staged, self._staged = self._staged, None
        self._stop.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join(timeout=self.config.connect_timeout_s + 2.0)
        for x in (staged, s):
            if x is not None:
                self._dispose(x)
        _live.discard(self)
