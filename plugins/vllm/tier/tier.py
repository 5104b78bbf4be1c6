"""``AdpSecondaryTier``: adpkv as a secondary tier behind vLLM's own CPU tier
(``TieringOffloadingSpec``, vLLM 0.32's ``vllm.v1.kv_offload.tiering``).

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":N,
        "secondary_tiers":[{"type":"AdpSecondaryTier","module_path":"adpkv_vllm","port":5557}]}}'

vLLM keeps its CPU tier (pinned GPU<->CPU DMA, its eviction policy) and asks
this tier, in the scheduler process, to move whole CPU-tier chunks (rows of the
shared region ``/dev/shm/vllm_offload_<engine_id>.mmap``) to and from storage.

- **No copy in the engine.** The tier registers the CPU tier's shared file with
  the gateway (``GatewayClient.register_region``); a store is one ``put_from``
  (the gateway preads the rows from the file), a load one ``get_into`` (the
  gateway pwrites the objects into the rows vLLM allocated for them): card ->
  CPU tier in one step, then vLLM's own DMA to the GPU. Where the region cannot
  be registered (the file is gone, the gateway refuses it) the tier falls back
  to ring copies (one ``memmove`` per row, logged once).
- **Keys**: one object per (chunk, row): ``KeyBuilder(namespace).key(chunk_digest
  (offload_key), 0, KIND_TIER_ROW)``. The offload key is vLLM's block hash of the
  chunk's last block + the KV cache group; the namespace is
  ``adpkv_core.keys.key_namespace`` over the deployment namespace (setting
  ``namespace``) and the model identity the spec knows (model, KV dtype, groups
  with their block size and layers, bytes per block and per row, chunk, TP/PP,
  layout, the row format): another model, block size, group or TP layout never
  matches, the same engine after a restart (or a second engine of the same
  identity on the same cards) does.
- **Lookups never block the scheduler**: vLLM's own ``AsyncLookupManager`` (as
  the ``fs`` tier uses it) runs one EXIST per request and step on its thread;
  with the gateway off a lookup is a MISS at once.
- **Failures**: a load that misses (evicted since the lookup, corrupt object,
  gateway gone) reports the rows that did arrive (``successful_keys``) and marks
  the rest as misses; vLLM recomputes them. A store while the gateway is off is
  dropped (a failed cascade job, a future miss). The tier re-attaches by itself
  (``adpkv_core.attachment``; first try ``reconnect_s`` after the loss, between
  scheduler steps) and registers the region again.
- **KV events** (with ``--kv-events-config`` on): stored events for rows the
  gateway holds after a store (also when it held them already), removed events
  for rows this tier announced and later found missing while the gateway
  answered (an eviction by the gateway, an ``adpkv clean``): by a lookup or a
  load that missed, and by the sweep, which checks every announced row with the
  gateway once every ``events_sweep_s`` (EXISTs of ``events.SWEEP_KEYS`` keys, one at a
  time, spread over the interval, answered on the client's thread), so an
  eviction reaches the engine's KV-event publisher also when nobody asks for the
  row. Medium ``STORAGE``;
  ``locality`` as configured.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np

from ..common.vllm_api import (job_result, offloading_kv_cache_layout, required_vllm_api,
                               secondary_tier_init_args, tier_job_rows, tier_row_bytes, tiering_api_missing,
                               tiering_rows_file)

with required_vllm_api(
        "adpkv_vllm.AdpSecondaryTier",
        needs="vLLM's tiered offloading in the shape of vLLM 0.32 and later (vllm.v1.kv_offload.tiering: "
              "SecondaryTierManager, TransferJob, AsyncLookupManager; vllm.v1.kv_offload.base: Medium); "
              "vLLM 0.26's tiering has another (JobMetadata, no Medium)",
        instead="Use AdpOffloadingSpec or AdpKVConnector instead"):
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingMetricMetadata,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

    if tiering_api_missing() is not None:
        raise ImportError(f"its tiering lacks {tiering_api_missing()}")

from adpkv_core.attachment import Attachment, Session, reconnect_setting
from adpkv_core.jobs import JobBook
from adpkv_core.keys import KIND_TIER_ROW, KeyBuilder, key_namespace
from adpkv_core.memory.regions import shared_file_of
from adpkv_core.settings import ClientConfig, refuse_unknown

from ..common.settings import ConfigInfoLabels, ensure_logging
from .events import TierEvents

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("adpkv.vllm")

ROW_FORMAT = "vllm-tiering-row/1"


class TierMetrics:
    """Prometheus names of this tier's own metrics (vLLM's tiering manager already
    counts bytes, times and failed jobs per tier)."""

    ATTACHED = "vllm:kv_offload_adpkv_gateway_attached"
    STORES_DROPPED = "vllm:kv_offload_adpkv_blocks_not_stored"
    LOAD_MISSES = "vllm:kv_offload_adpkv_blocks_not_loaded"
    REMOVED = "vllm:kv_offload_adpkv_blocks_removed"
    REATTACHES = "vllm:kv_offload_adpkv_reattaches"


@dataclass(frozen=True)
class TierInfo(ConfigInfoLabels):
    """What ``vllm:kv_offload_config_info`` says of this tier (vLLM >= 0.33; vLLM adds ``tier``)."""

    adpkv_gateway: str          # host:port of the engine's gateway
    adpkv_namespace: str        # the key namespace this engine derived (row format included)
    adpkv_row_bytes: int        # bytes of one CPU-tier row (one object)


def tier_identity(spec: "OffloadingSpec", row_bytes: int) -> dict:
    """What the spec knows of the model and of the row format, for ``key_namespace``."""
    cfg = spec.config
    p = cfg.parallel
    return dict(model=cfg.model.name, kv_dtype=cfg.model.dtype,
                geometry={"groups": [[g.tokens_per_block, list(g.layer_names)] for g in cfg.groups],
                          "tokens_per_hash": cfg.cache.tokens_per_hash,
                          "kv_bytes_per_block": cfg.worker_kv_bytes_per_block, "row_bytes": row_bytes},
                chunk_size=cfg.cache.blocks_per_chunk, tp_size=p.tp_size,
                parallel=[p.world_size, p.pp_size, p.pcp_size, p.dcp_size],
                layout=offloading_kv_cache_layout(cfg),
                replicated=bool(getattr(cfg, "replicated_layout", False)),
                canonical=bool(getattr(cfg, "canonical_layout", False)),
                format=ROW_FORMAT)


def _known_settings() -> set[str]:
    names = set(ClientConfig.setting_names())
    return names | {"adpkv." + n for n in names} | {"locality", "enable_kv_events", "events_sweep_s"}


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup state machine; ``batch_lookup`` is one EXIST (own thread)."""

    def __init__(self, tier: "AdpSecondaryTier", tier_type: str):
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._exist(keys)


@dataclass(frozen=True)
class _Rows:
    """What a job of the tier's book carries: vLLM's offload keys (one CPU-tier row each), store
    or load, and the session its request went out on (None: none went out)."""

    keys: list[OffloadKey]
    store: bool
    session: Optional[Session]


class AdpSecondaryTier(SecondaryTierManager):
    """adpkv gateway as a secondary tier of vLLM's ``TieringOffloadingSpec``.

    Tier settings (the tier's JSON object, besides ``type``/``module_path``): ``port``,
    ``host``, ``namespace``, ``key_namespace_from_model``, ``timeout_s``, ``reconnect_s``
    (also spelt ``adpkv.<name>``), ``locality`` (``LOCAL``/``REMOTE``, for KV events),
    ``enable_kv_events`` (default true; effective with vLLM's KV events on),
    ``events_sweep_s`` (default 60; how often every announced row is checked for removed
    events; 0: only lookups and loads find them).
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    # vLLM >= 0.33: serviced only from on_schedule_end (the scheduler's thread), not from the
    # tiering manager's tier-poll thread: this tier has no counterpart that asks between
    # steps, and its lookups already run on their own thread (AsyncLookupManager). Its
    # methods keep no per-thread state, so a call reaching it from another tier's poll round
    # (ParentManager fan-out, under the manager's lock) is served the same way.
    tolerates_off_thread_polling: ClassVar[bool] = False

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            TierMetrics.ATTACHED: OffloadingGaugeMetadata(
                documentation="1 while the adpkv tier is attached to its gateway, 0 while it is off."),
            TierMetrics.STORES_DROPPED: OffloadingCounterMetadata(
                documentation="Blocks the adpkv tier did not store (gateway off or refused)."),
            TierMetrics.LOAD_MISSES: OffloadingCounterMetadata(
                documentation="Blocks found by an adpkv lookup that their load did not read "
                              "(evicted meanwhile, corrupt, gateway gone); vLLM recomputes them."),
            TierMetrics.REMOVED: OffloadingCounterMetadata(
                documentation="Blocks announced as stored in the adpkv tier and later found gone."),
            TierMetrics.REATTACHES: OffloadingCounterMetadata(
                documentation="Times the adpkv tier re-attached to a gateway that came back."),
        }

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return TierInfo.label_names()

    def config_info(self) -> dict:
        return self.info.labels()

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: "Optional[BackpressureDetector]" = None,
                 locality: Optional[str] = None, enable_kv_events: bool = True, events_sweep_s: float = 60.0,
                 **settings: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         *secondary_tier_init_args(SecondaryTierManager, backpressure_detector))
        ensure_logging()
        refuse_unknown(settings, _known_settings(), "setting of the AdpSecondaryTier")
        self.locality = Locality(str(locality).upper()) if locality else None
        self.client_config = ClientConfig.from_settings(settings, prefix="adpkv.")
        self.reconnect_s = reconnect_setting(settings)
        cfg = offloading_spec.config
        self.row_bytes = tier_row_bytes(self, primary_kv_view)
        self.num_rows = len(primary_kv_view)
        self.namespace = key_namespace(self.client_config.namespace,
                                       tier_identity(offloading_spec, self.row_bytes),
                                       from_model=self.client_config.key_namespace_from_model,
                                       private_to=f"vllm-tier-{cfg.engine_id}")
        self.keys = KeyBuilder(self.namespace)
        self.engine_id = f"vllm-tier-{cfg.engine_id}"
        self.info = TierInfo(adpkv_gateway=f"{self.client_config.host}:{self.client_config.port}",
                             adpkv_namespace=self.namespace, adpkv_row_bytes=self.row_bytes)
        # where the primary tier's rows are: their address (ring fallback) and the shared file
        arr = np.asarray(primary_kv_view)
        self._base = int(arr.ctypes.data)
        self._region_file = self._find_region_file(offloading_spec)
        self._warned_ring = False
        events = bool(enable_kv_events) and bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._kv_events = TierEvents(events, self.medium, self.locality, events_sweep_s, self.storage_key,
                                     count_removed=lambda n: self._counters.update({TierMetrics.REMOVED: n}))
        self._jobs: JobBook[_Rows] = JobBook()       # under vLLM's job ids; one request per job
        self._counters: collections.Counter[str] = collections.Counter()
        self._lookups = _Lookups(self, tier_type)
        self.attachment = Attachment(self.client_config, self.engine_id, 0, 1,
                                     {"engine": "vllm-tiering", "row_bytes": self.row_bytes,
                                      "rows": self.num_rows},
                                     reconnect_s=self.reconnect_s, install="on_refresh",
                                     on_attach=self._on_attach, name="adpkv-vllm-tier")
        self._session: Optional[Session] = self.attachment.session
        logger.info("adpkv tier %s: %d CPU-tier rows of %d bytes, namespace %s, region %s", tier_type,
                    self.num_rows, self.row_bytes, self.namespace,
                    f"{self._region_file[0]}+{self._region_file[1]}" if self._region_file else "none (ring copies)")

    # ------------------------------------------------------------------ gateway
    def _find_region_file(self, spec) -> Optional[tuple[str, int]]:
        size = self.num_rows * self.row_bytes
        found = shared_file_of(self._base, size)
        if found is not None:
            return found.path, found.offset
        path = tiering_rows_file(spec)       # TieringOffloadingSpec's own file (a private vLLM attribute)
        return (path, 0) if path is not None else None

    def _on_attach(self, s: Session) -> None:
        rid = None
        if self._region_file is not None:
            path, offset = self._region_file
            try:
                rid = s.client.register_region(path, offset, self.num_rows * self.row_bytes).result(
                    self.client_config.connect_timeout_s + 1)
            except Exception:
                logger.exception("adpkv tier: registering the CPU tier region failed")
        s.state["region"] = rid
        if rid is None and not self._warned_ring:
            self._warned_ring = True
            logger.warning("adpkv tier: the CPU tier's rows are not a registered region; moving them "
                           "through the ring (one copy per row in this process)")

    @property
    def enabled(self) -> bool:
        s = self._session
        return s is not None and s.enabled

    def storage_key(self, key: OffloadKey) -> bytes:
        """The gateway key of one CPU-tier row (block hash + group of its offload key)."""
        return self.keys.key(bytes(key), 0, KIND_TIER_ROW)

    def _exist(self, keys: list[OffloadKey]) -> list[bool]:
        """One EXIST (the lookup thread). A key this tier announced and the gateway no
        longer holds is an eviction: a removed event."""
        s = self._session
        if s is None or not s.enabled:
            return [False] * len(keys)
        flags = s.client.exist([self.storage_key(k) for k in keys]).result(
            self.client_config.timeout_s + 5)
        if s.client.enabled:
            self._kv_events.forget([k for k, f in zip(keys, flags) if not f])
        return flags

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._kv_events.take()

    # ------------------------------------------------------------------ lookups
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.enabled:
            return LookupResult.MISS            # gateway off: not found, at once
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        s = self.attachment.refresh()           # between steps: a fresh attachment goes to use
        if s is not self._session and s is not None:
            self._counters[TierMetrics.REATTACHES] += 1
        self._session = s
        self._lookups.flush()
        self._kv_events.sweep(s)

    # ------------------------------------------------------------------ transfers
    def _submit(self, job: TransferJob, store: bool) -> None:
        s = self._session
        rows = _Rows(list(job.keys), store, s)
        request = self._request(job, rows) if s is not None and s.enabled and rows.keys else None
        self._jobs.submit([request] if request is not None else [], rows, job_id=job.job_id,
                          failed=request is None)

    def _request(self, job: TransferJob, rows: _Rows) -> Optional[Future]:
        """The one PUT or GET of a job's rows: ``put_from``/``get_into`` on the registered CPU-tier
        region, else through the ring; None when the session has neither."""
        s = rows.session
        assert s is not None
        at = [int(c) * self.row_bytes for c in tier_job_rows(job)]
        skeys = [self.storage_key(k) for k in rows.keys]
        rid = s.state.get("region")
        client, ring = s.client, s.ring
        if rid is not None:
            if rows.store:
                return client.put_from(rid, at, skeys, self.row_bytes)
            return client.get_into(rid, at, skeys, self.row_bytes)
        if ring is None:           # neither a region nor a ring: nothing moves
            return None
        addrs = [self._base + a for a in at]
        if rows.store:
            return client.put(skeys, self.row_bytes, functools.partial(ring.fill, addrs=addrs))
        return client.get(skeys, self.row_bytes, functools.partial(ring.drain, addrs=addrs))

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        for job in self._jobs.pop_finished():
            rows = job.meta
            n = len(rows.keys)
            flags = [False] * n if job.failed else job.flags(0, n)    # per row: stored / found
            ok = [k for k, f in zip(rows.keys, flags) if f]
            bad = [k for k, f in zip(rows.keys, flags) if not f]
            answered = rows.session is not None and rows.session.client.enabled
            if rows.store:
                self._kv_events.announce(ok)
                if bad:
                    self._counters[TierMetrics.STORES_DROPPED] += len(bad)
            elif bad:
                self._counters[TierMetrics.LOAD_MISSES] += len(bad)
                self._lookups.mark_miss(bad)          # vLLM stops asking; recomputes them
                if answered:
                    self._kv_events.forget(bad)
            success = not bad
            out.append(job_result(JobResult, len(ok) * self.row_bytes, job_id=job.id, success=success,
                                  successful_keys=tuple(ok) if (not success and ok and not rows.store) else None,
                                  transfer_time=job.seconds))
        return out

    def has_pending_work(self) -> bool:
        return self._jobs.pending() > 0

    def drain_jobs(self) -> None:
        """Every submitted job has ended (the client resolves each request, at worst as a
        miss after ``timeout_s`` without progress); results wait in get_finished_jobs."""
        self._jobs.wait()

    # ------------------------------------------------------------------ metrics, shutdown
    def get_stats(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
        stats = OffloadingConnectorStats()
        for name, n in self._counters.items():
            if n:
                stats.increase_counter(name, n)
        self._counters.clear()
        stats.set_gauge(TierMetrics.ATTACHED, 1 if self.enabled else 0)
        return stats

    def shutdown(self) -> None:
        try:
            self._lookups.shutdown()
        finally:
            self.drain_jobs()
            self.attachment.close()
            self._session = None
