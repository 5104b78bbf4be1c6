"""The scheduler half of ``AdpOffloadingSpec``: which offloaded chunks the
gateway holds, pinned until they are loaded.

A lookup of a key not yet asked returns RETRY and joins the step's batch;
``on_schedule_end`` sends the whole batch as one EXIST (one round trip per
step), with ``lock`` so that hits stay pinned against eviction until they are
loaded (``complete_load``) or the request ends. A chunk is a hit only when the
objects of every layer of every TP rank are stored (a failed load cannot be
recomputed under vLLM 0.32). Results are per request.

The manager is not a rank: it attaches as a lookup-only peer of the engine and
re-attaches after a gateway restart at ``on_schedule_end`` (between steps), when
no EXIST is in flight. Pins live in the gateway with the attachment that took
them: a re-attach forgets them (the old peer's pins were dropped with it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Collection, Iterable, Optional, Sequence

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)

from adpkv_core.attachment import Attachment, Session

from .backend import AdpLoadStoreSpec, OffloadBackend, object_digest

logger = logging.getLogger("adpkv.vllm")


class AdpOffloadingManager(OffloadingManager):
    """Contract of vLLM >= 0.33: every caller holds ``lock`` around a call (``shutdown``
    excepted); no method here takes it. It is a real lock: vLLM's scheduler holds it for a
    whole step (a lookup's HIT and the ``prepare_load`` that uses it) and enters the manager
    outside the step too (a new or finished request, stats, events, a cache reset), so two
    callers on two threads are kept apart whoever they are. vLLM 0.32 never reads it."""

    def __init__(self, backend: OffloadBackend):
        self.backend = backend
        self._lock = threading.Lock()
        self.lookup_peer = Attachment(backend.client_config, backend.engine_id, None, backend.world,
                                      {"role": "vllm-offload-manager"}, reconnect_s=backend.reconnect_s,
                                      install="on_refresh", name="adpkv-vllm-offload-manager")
        self._session: Optional[Session] = self.lookup_peer.session   # the one pins were taken on
        self._results: dict[str, dict[bytes, bool]] = {}       # req -> key -> stored
        self._pending: dict[str, set[bytes]] = {}              # req -> keys to ask
        self._inflight: Optional[tuple[Any, list[tuple[str, bytes]]]] = None
        self._asked: set[tuple[str, bytes]] = set()
        self._pinned: dict[str, dict[bytes, int]] = {}         # req -> key -> pins taken
        # keys checked per chunk: every layer of every rank (a failed load cannot be recomputed)
        self._layers = [list(range(len(g.layer_names))) for g in backend.config.groups]
        self._builders = [backend.keys_for_rank(r) for r in range(backend.world)]

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def _storage_keys(self, offload_key: bytes) -> list[bytes]:
        d = object_digest(offload_key)
        layers = self._layers[min(get_offload_group_idx(offload_key), len(self._layers) - 1)]
        return [b.key(d, layer) for b in self._builders for layer in layers]

    def _live(self) -> Optional[Session]:
        """The session pins are taken on, when it is attached; else None."""
        s = self._session
        return s if s is not None and s.enabled else None

    # ---------------------------------------------------------------- lookups
    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        req = req_context.req_id
        key = bytes(key)
        self._collect()
        res = self._results.get(req, {}).get(key)
        if res is not None:
            return LookupResult.HIT if res else LookupResult.MISS
        if (req, key) in self._asked:
            return LookupResult.RETRY          # its EXIST is on the way
        if self._live() is None:
            return LookupResult.MISS
        self._pending.setdefault(req, set()).add(key)
        return LookupResult.RETRY

    def on_schedule_end(self, context) -> None:
        self._collect()
        if self._inflight is None:
            self._refresh()
        if self._inflight is not None or not self._pending:
            return
        items = [(req, k) for req, keys in self._pending.items() for k in keys]
        self._pending = {}
        s = self._live()
        if s is None:
            for req, k in items:
                self._results.setdefault(req, {})[k] = False
            return
        keys: list[bytes] = []
        for _, k in items:
            keys += self._storage_keys(k)
        self._inflight = (s.client.exist(keys, lock=True), items)
        self._asked = set(items)

    def _refresh(self) -> None:
        """Between steps, with no EXIST in flight: put a fresh attachment to use."""
        s = self.lookup_peer.refresh()
        if s is not self._session:
            self._session = s
            self._pinned.clear()     # those pins went with the old attachment

    def _collect(self) -> None:
        if self._inflight is None:
            return
        fut, items = self._inflight
        if not fut.done():
            return
        self._inflight = None
        self._asked = set()
        try:
            flags = fut.result()
        except Exception:
            flags = []
        i = 0
        for req, k in items:
            n = len(self._storage_keys(k))
            part = flags[i:i + n] if len(flags) >= i + n else [False] * n
            i += n
            hit = bool(part) and all(part)
            self._results.setdefault(req, {})[k] = hit
            if hit:   # every storage key of this chunk got one pin of ours
                pins = self._pinned.setdefault(req, {})
                pins[k] = pins.get(k, 0) + 1
            elif any(part):   # partial: release what was pinned
                sk = self._storage_keys(k)
                self._unlock([s for s, f in zip(sk, part) if f])

    def has_pending_work(self) -> bool:
        self._collect()
        return bool(self._pending) or self._inflight is not None

    def _unlock(self, storage_keys: list[bytes]) -> None:
        s = self._live()
        if storage_keys and s is not None:
            s.client.unlock(storage_keys)

    def _release(self, req: str, keys: Optional[Iterable[bytes]] = None) -> None:
        pins = self._pinned.get(req)
        if not pins:
            return
        keys = list(pins) if keys is None else [bytes(k) for k in keys]
        out: list[bytes] = []
        for k in keys:
            n = pins.pop(k, 0)
            for _ in range(n):
                out += self._storage_keys(k)
        self._unlock(out)
        if not pins:
            self._pinned.pop(req, None)

    # ---------------------------------------------------------------- loads and stores
    def prepare_load(self, keys: Collection, req_context: ReqContext) -> LoadStoreSpec:
        return AdpLoadStoreSpec(list(keys))

    def complete_load(self, keys: Collection, req_context: ReqContext):
        self._release(req_context.req_id, keys)

    def prepare_store(self, keys: Collection, req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        known = self._results.get(req_context.req_id, {})
        todo = [bytes(k) for k in keys if not known.get(bytes(k))]
        return PrepareStoreOutput(keys_to_store=todo, store_spec=AdpLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Collection, req_context: ReqContext, success: bool = True):
        return

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = req_context.req_id
        self._release(req)
        self._results.pop(req, None)
        self._pending.pop(req, None)

    def reset_cache(self) -> None:
        for req in list(self._pinned):
            self._release(req)
        self._results.clear()

    def config_info(self) -> Sequence[dict]:
        """One series of ``vllm:kv_offload_config_info`` (vLLM >= 0.33): the backend's facts."""
        return [self.backend.info.labels()]

    def shutdown(self) -> None:
        self.lookup_peer.close()
