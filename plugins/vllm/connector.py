"""``AdpKVConnector``: vLLM KV connector (V1) that keeps KV chunks on adpkv cards.

Scheduler side
    ``get_num_new_matched_tokens`` asks the gateway once per prompt (one EXIST
    over the chunk keys of the first and the last layer, or of every layer) which
    chunks are stored, from the start up to the first missing one; vLLM counts
    them as computed and reserves blocks. ``build_connector_meta`` hands the
    workers a load plan (chunks to restore into which blocks) and a save plan
    (chunks that became full this step).

Worker side
    ``start_load_kv`` sends one GET per layer (collective over the TP ranks);
    ``wait_for_layer_load`` fences that layer only, so later layers load while
    earlier ones compute. ``save_kv_layer`` PUTs the new full chunks of a layer
    (the copy into the ring runs in the client's I/O thread, from the blocks);
    decode-step chunks go out in one request per step from ``wait_for_save``.
    Nothing waits for storage; a finished request keeps its blocks until their
    pages are in the ring (``request_finished`` -> ``get_finished``).

Failures: a chunk that cannot be read is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it; a gateway that stops
answering turns the external cache off on that rank (the client logs
"External KV cache turned off on this rank" once) and the engine goes on.
Both roles hold the gateway through ``adpkv_core.attachment.Attachment``: when
the gateway answers again a fresh attachment is made in the background and put
to use between engine steps (scheduler: after ``build_connector_meta``; worker:
at ``bind_connector_metadata``), never inside one; a transfer that started on
the old attachment ends on it as misses (its blocks are recomputed).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM >= 0.10
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - old vLLM
    class SupportsHMA:  # type: ignore[no-redef]
        pass

from adpkv_core.affinity import dialog_marks
from adpkv_core.attachment import Attachment, Session, reconnect_setting
from adpkv_core.keys import KeyBuilder

from .common import (
    AdapterSettings,
    check_hash_stability,
    chunk_hashes,
    ensure_logging,
    ordered_layer_names,
    resolve_namespace,
)
from .copy import PagedLayer, as_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("adpkv.vllm")

# vLLM's BlockPool hands out block 0 as the null block: the block-table entry of a block that
# was never allocated or was freed (sliding window: blocks that left the window)
_NULL_BLOCK_ID = 0


# =============================================================================== metadata
@dataclass
class ChunkPlan:
    """Chunks of one request to load or save: digests, marks and their blocks."""

    req_id: str
    digests: list[bytes]              # 16-byte chunk digests, one per chunk
    marks: list[int]                  # dialog mark per chunk
    block_ids: list[int]              # blocks_per_chunk ids per chunk (loads: only those written)
    positions: Optional[list[int]] = None   # loads: block positions in the objects (None = all)


@dataclass
class AdpConnectorMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[ChunkPlan] = field(default_factory=list)
    saves: list[ChunkPlan] = field(default_factory=list)           # per layer from save_kv_layer
    deferred_saves: list[ChunkPlan] = field(default_factory=list)  # one request per step (decode)
    preempted: list[str] = field(default_factory=list)


@dataclass
class _ReqState:
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0          # chunks stored or planned for saving
    had_saves: bool = False
    load: Optional[tuple[int, int, int]] = None   # (first chunk, end chunk, blocks to skip in first)


# =============================================================================== connector
class AdpKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by an adpkv gateway (``kv_connector_module_path: adpkv_vllm``)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ensure_logging()
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        self.hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        self.settings = AdapterSettings.from_extra_config(extra, self.block_size)
        self.reconnect_s = reconnect_setting(extra)
        self.chunk_size = self.settings.chunk_size
        if self.chunk_size % self.hash_block_size:
            raise ValueError(f"adpkv: chunk_size {self.chunk_size} must be a multiple of the hash "
                             f"block size {self.hash_block_size}")
        self.blocks_per_chunk = self.chunk_size // self.block_size
        self.hashes_per_chunk = self.chunk_size // self.hash_block_size
        self.engine_id = f"vllm-{ktc.engine_id}"
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.supported, why = self._supported(vllm_config, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        # sliding window (tokens) of the one KV cache group, None for full attention
        self.sliding_window: Optional[int] = None
        if self.supported and type(groups[0].kv_cache_spec).__name__ == "SlidingWindowSpec":
            self.sliding_window = int(groups[0].kv_cache_spec.sliding_window)
        self.layer_names = ordered_layer_names(groups[0].layer_names) if groups else []
        self.layer_index = {n: i for i, n in enumerate(self.layer_names)}
        self.layout = f"{vllm_config.device_config.device_type}:{_kv_layout(vllm_config)}"
        self.namespace = resolve_namespace(vllm_config, self.settings, self.layout, ktc.engine_id)
        self.keys = KeyBuilder(self.namespace)
        if not self.supported:
            logger.warning("adpkv: external KV cache disabled for this model: %s", why)
        if role == KVConnectorRole.SCHEDULER:
            check_hash_stability(vllm_config)
            self._init_scheduler(vllm_config, ktc)
        else:
            self._init_worker(vllm_config)
        logger.info("adpkv connector (%s): namespace %r, chunk %d tokens (%d blocks), %d layers%s",
                    role.name, self.namespace, self.chunk_size, self.blocks_per_chunk,
                    len(self.layer_names),
                    f", sliding window {self.sliding_window} tokens" if self.sliding_window else "")

    @staticmethod
    def _supported(vllm_config, kv_cache_config) -> tuple[bool, str]:
        if kv_cache_config is None:
            return False, "no KV cache config"
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            return False, (f"{len(groups)} KV cache groups: the connector restores models whose "
                           "attention layers share one KV cache group")
        spec_name = type(groups[0].kv_cache_spec).__name__
        if spec_name not in ("FullAttentionSpec", "SlidingWindowSpec"):
            # (subclasses such as R-SWA or chunked local attention free other blocks)
            return False, (f"KV cache spec {spec_name} is not supported (full attention or "
                           "sliding window only)")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            return False, "pipeline parallelism > 1 is not supported"
        return True, ""

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss, never lost output."""
        return False

    # ========================================================================== scheduler
    def _init_scheduler(self, vllm_config, ktc) -> None:
        if (getattr(ktc, "kv_load_failure_policy", "recompute") == "fail"
                and not self.settings.respect_fail_policy):
            # A best-effort cache must never fail a request: a chunk that cannot be
            # read is recomputed. (adpkv.respect_fail_policy=true keeps "fail".)
            try:
                ktc.kv_load_failure_policy = "recompute"
                logger.info("adpkv: kv_load_failure_policy set to 'recompute' (a load that fails "
                            "is recomputed, never an error)")
            except Exception:  # pragma: no cover - frozen config
                logger.warning("adpkv: set kv_load_failure_policy=recompute so that a failed load "
                               "is recomputed rather than failing the request")
        # a lookup-only peer of the engine (the scheduler is not a rank); re-attached between steps
        self._lookup = Attachment(self.settings.client, self.engine_id, None, self.tp_size,
                                  {"role": "vllm-scheduler"}, reconnect_s=self.reconnect_s,
                                  install="on_refresh", name="adpkv-vllm-scheduler")
        self._lookups: dict[str, tuple[int, Any, list[bytes]]] = {}  # req -> (num_tokens, future, digests)
        self._hits: dict[str, tuple[int, int]] = {}     # req -> (hit chunks, local computed tokens)
        self._reqs: dict[str, _ReqState] = {}
        self._requests: dict[str, "Request"] = {}
        self._step = 0
        self._last_step_loads: dict[str, list[int]] = {}
        self._exist_layers = ([0, len(self.layer_names) - 1] if self.settings.exist_layers == "ends"
                              else list(range(len(self.layer_names))))
        self._exist_layers = sorted(set(self._exist_layers))

    def _skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks at the start of a request that vLLM may have freed (null blocks) once
        ``num_computed_tokens`` are computed: those wholly before the sliding window.
        vLLM's SlidingWindowManager frees ``(n - window + 1) // block_size`` blocks or fewer
        (it may retain extra tokens), so this is an upper bound; 0 for full attention."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _hit_chunks(self, present: list[bool], local: int) -> int:
        """The longest restorable run of chunks given which chunks are stored.

        Full attention: chunks from the start up to the first missing one. Sliding window:
        the largest hit whose chunks inside the window at the hit boundary (and past vLLM's
        own hit ``local``) are all stored; the chunks before the window are never read
        (vLLM gives them null blocks), so they need not be stored."""
        n = len(present)
        if self.sliding_window is None:
            hit = 0
            while hit < n and present[hit]:
                hit += 1
            return hit
        first_local = local // self.chunk_size
        for h in range(n, first_local, -1):
            first = max(self._skipped_blocks(h * self.chunk_size) // self.blocks_per_chunk,
                        first_local)
            if all(present[first:h]):
                return h
        return 0

    def _digests(self, request: "Request", limit_chunks: int) -> list[bytes]:
        return chunk_hashes(request.block_hashes, self.hashes_per_chunk, limit_chunks)

    def _marks(self, digests: list[bytes]) -> list[int]:
        return dialog_marks(digests, self.settings.client.affinity_chunks)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not self.supported or not self.layer_names:
            return 0, False
        req_id = request.request_id
        # A prompt of N tokens hits at most floor((N-1)/C)*C tokens: vLLM must compute
        # at least one token itself.
        limit = (request.num_tokens - 1) // self.chunk_size
        if limit * self.chunk_size <= num_computed_tokens:
            self._hits[req_id] = (0, num_computed_tokens)
            return 0, False
        entry = self._lookups.get(req_id)
        if entry is None or entry[0] != request.num_tokens:
            digests = self._digests(request, limit)
            s = self._lookup.session
            if not digests or s is None or not s.enabled:
                self._hits[req_id] = (0, num_computed_tokens)
                return 0, False
            marks = self._marks(digests)
            keys = self.keys.keys(digests, self._exist_layers)
            fut = s.client.exist(keys, marks=marks * len(self._exist_layers))
            entry = (request.num_tokens, fut, digests)
            self._lookups[req_id] = entry
        _, fut, digests = entry
        try:
            flags = fut.result(timeout=self.settings.lookup_wait_s)
        except Exception:  # not answered yet: ask again at the next step
            if fut.done():
                flags = [False] * (len(digests) * len(self._exist_layers))
            else:
                return None, False
        n = len(digests)
        present = [all(flags[li * n + c] for li in range(len(self._exist_layers))) for c in range(n)]
        hit = self._hit_chunks(present, num_computed_tokens)
        self._hits[req_id] = (hit, num_computed_tokens)
        ext = hit * self.chunk_size - num_computed_tokens
        return (ext if ext > 0 else 0), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        st = self._reqs.setdefault(req_id, _ReqState())
        self._requests[req_id] = request
        ids = blocks.get_block_ids()
        if ids:
            st.block_ids = list(ids[0])
        hit, local = self._hits.pop(req_id, (0, 0))
        self._lookups.pop(req_id, None)
        st.saved_chunks = max(st.saved_chunks, hit)
        if num_external_tokens > 0 and self.supported:
            end_chunk = (local + num_external_tokens) // self.chunk_size
            first_chunk = local // self.chunk_size
            skip = (local % self.chunk_size) // self.block_size
            st.load = (first_chunk, end_chunk, skip)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._step += 1
        meta = AdpConnectorMetadata(step=self._step)
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        bpc = self.blocks_per_chunk
        computed: dict[str, int] = {}

        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.setdefault(new.req_id, _ReqState())
            if new.block_ids:
                st.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.setdefault(req_id, _ReqState())
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]

        self._last_step_loads = {}
        for req_id, before in computed.items():
            st = self._reqs[req_id]
            request = self._requests.get(req_id)
            if request is None or not self.supported:
                continue
            # ---- load plan
            if st.load is not None:
                c0, c1, skip = st.load
                st.load = None
                digests = self._digests(request, c1)
                if len(digests) == c1 and len(st.block_ids) >= c1 * bpc:
                    marks = self._marks(digests)
                    # blocks to write: past vLLM's own hit and inside the sliding window (the
                    # blocks before it are null blocks: vLLM never allocates them)
                    first_block = max(c0 * bpc + skip, self._skipped_blocks(before))
                    dst, pos, objs = [], [], []
                    for c in range(c0, c1):
                        blocks = [b for b in range(max(first_block - c * bpc, 0), bpc)
                                  if st.block_ids[c * bpc + b] != _NULL_BLOCK_ID]
                        if not blocks:
                            continue
                        for b in blocks:
                            dst.append(st.block_ids[c * bpc + b])
                            pos.append(len(objs) * bpc + b)
                        objs.append(c)
                    if objs:
                        whole = len(dst) == len(objs) * bpc
                        meta.loads.append(ChunkPlan(req_id, [digests[c] for c in objs],
                                                    [marks[c] for c in objs], dst,
                                                    None if whole else pos))
                        self._last_step_loads[req_id] = dst
            # ---- save plan: chunks that are full once this step has run
            n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            n_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            after = before + n_sched - n_spec
            full = min(after // self.chunk_size, len(request.block_hashes) // self.hashes_per_chunk,
                       len(st.block_ids) // bpc)
            if full > st.saved_chunks:
                digests = self._digests(request, full)
                marks = self._marks(digests)
                # sliding window: a chunk with a block vLLM may already have freed (before the
                # window at the start of this step) cannot be read any more: it is not saved
                c0 = max(st.saved_chunks, -(-self._skipped_blocks(before) // bpc))
                if full > c0:
                    ids = st.block_ids[c0 * bpc: full * bpc]
                    plan = ChunkPlan(req_id, digests[c0:full], marks[c0:full], ids)
                    decode = before >= request.num_prompt_tokens
                    (meta.deferred_saves if decode else meta.saves).append(plan)
                    st.had_saves = True
                st.saved_chunks = full
        self._lookup.refresh()   # between steps: a fresh attachment, when one is ready, from now on
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Chunks whose load failed are saved again once vLLM has recomputed them."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for req_id, dst in self._last_step_loads.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for i, b in enumerate(dst):
                if b in invalid:
                    # the chunk holding this block (and the ones after) must be saved again
                    try:
                        c = st.block_ids.index(b) // self.blocks_per_chunk
                    except ValueError:
                        c = 0
                    st.saved_chunks = min(st.saved_chunks, c)
                    break

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        return self._finished(request)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict]]:
        return self._finished(request)

    def _finished(self, request: "Request") -> tuple[bool, Optional[dict]]:
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._requests.pop(req_id, None)
        st = self._reqs.pop(req_id, None)
        # Keep the blocks until the workers have copied the pages out (get_finished).
        return (st is not None and st.had_saves), None

    # ========================================================================== worker
    def _init_worker(self, vllm_config) -> None:
        self._attachment: Optional[Attachment] = None
        self._session: Optional[Session] = None
        self.client = None                              # this step's client and ring (see _use)
        self.ring: Optional[torch.Tensor] = None
        self.layers: dict[str, PagedLayer] = {}
        self.rank = 0
        self._num_blocks = getattr(self._kv_cache_config, "num_blocks", 0)
        self._load_futs: dict[str, tuple[Any, ChunkPlanIndex]] = {}
        self._load_errors: set[int] = set()
        self._saved_layers: set[str] = set()
        self._jobs_by_req: dict[str, list[_PutJob]] = {}
        self._finished_waiting: set[str] = set()
        self._had_saves: set[str] = set()    # requests the scheduler keeps blocks for
        self._step_jobs: list[_PutJob] = []  # sliding window: PUTs of this step (see wait_for_save)
        self._lock = threading.Lock()
        self._stream = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.supported:
            return
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.rank = get_tensor_model_parallel_rank()
        except Exception:
            self.rank = 0
        num_blocks = self._num_blocks
        for name in self.layer_names:
            kv = kv_caches.get(name)
            if kv is None or not isinstance(kv, torch.Tensor):
                logger.warning("adpkv: layer %s has no KV tensor; external cache disabled", name)
                self.supported = False
                return
            self.layers[name] = PagedLayer(name, kv, num_blocks or kv.shape[0])
        first = self.layers[self.layer_names[0]]
        if first.on_gpu:
            self._stream = torch.cuda.Stream(device=first.device)
        layout = {"engine": "vllm", "layers": len(self.layers), "chunk_tokens": self.chunk_size,
                  "page_bytes": first.page_bytes, "page_shape": list(first.page_shape),
                  "dtype": str(first.dtype), "layout": self.layout}
        self._attachment = Attachment(self.settings.client, self.engine_id, self.rank, self.tp_size, layout,
                                      reconnect_s=self.reconnect_s, install="on_refresh",
                                      on_attach=self._on_attach, on_detach=self._on_detach,
                                      name="adpkv-vllm")
        self._use(self._attachment.session)
        logger.info("adpkv: rank %d registered %d layers, page %s %s (%d bytes), object %d bytes",
                    self.rank, len(self.layers), first.page_shape, first.dtype, first.page_bytes,
                    first.page_bytes * self.blocks_per_chunk * self.tp_size)

    def _on_attach(self, s: Session) -> None:
        s.state["ring"] = s.ring.tensor() if s.ring is not None else None
        if s.state["ring"] is not None and self.layers and next(iter(self.layers.values())).on_gpu:
            from .cuda_ring import pin_ring
            pin_ring(s.state["ring"])     # DMA copies ring <-> GPU on our stream

    def _on_detach(self, s: Session) -> None:
        ring = s.state.get("ring")
        if ring is not None and self._stream is not None:
            self._stream.synchronize()    # no copy from the old ring is still queued
            from .cuda_ring import unpin_ring
            unpin_ring(ring)

    def _use(self, s: Optional[Session]) -> None:
        self._session = s
        self.client = s.client if s is not None else None
        self.ring = s.state.get("ring") if s is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        a = getattr(self, "_attachment", None)
        if a is not None:   # a step begins: the one point where a fresh attachment is put to use
            s = a.refresh()
            if s is not self._session:
                self._use(s)

    def _active(self) -> bool:
        return self.supported and self.client is not None and self.ring is not None and self.client.enabled

    def _part(self, layer: PagedLayer) -> tuple[int, tuple[int, int]]:
        part = layer.page_bytes * self.blocks_per_chunk
        return part * self.tp_size, (self.rank * part, part)

    def _tag(self, kind: str, step: int, layer: str) -> Optional[str]:
        return f"{kind}{step}:{self.layer_index[layer]}" if self.tp_size > 1 else None

    # ---------------------------------------------------------------- loads
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, AdpConnectorMetadata) or not meta.loads:
            return
        index = ChunkPlanIndex(meta.loads, self.blocks_per_chunk)
        if not self._active():
            self._load_errors.update(index.all_blocks)
            return
        client, ring = self.client, self.ring   # the whole load runs on this step's attachment
        for name in self.layer_names:     # layer 0 first: it is needed first
            layer = self.layers[name]
            obj, sl = self._part(layer)
            keys = self.keys.keys(index.digests, (self.layer_index[name],))

            def on_batch(b, layer=layer, sl=sl):
                dst, pos = index.batch_blocks(b.first, b.count, b.hits)
                if dst is None:
                    return True
                layer.scatter(ring, b.offset, b.stride, b.count, sl[0], sl[1], dst, pos,
                              self.blocks_per_chunk, self._stream)
                return True

            fut = client.get(keys, obj, on_batch, marks=index.marks,
                                  tag=self._tag("L", meta.step, name), slice=sl)
            self._load_futs[name] = (fut, index)

    def wait_for_layer_load(self, layer_name: str) -> None:
        entry = self._load_futs.pop(layer_name, None)
        if entry is not None:
            self._settle_load(*entry)

    def _settle_load(self, fut, index: "ChunkPlanIndex") -> None:
        try:
            hits = fut.result()
        except Exception:
            hits = [False] * len(index.digests)
        for i, h in enumerate(hits):
            if not h:
                self._load_errors.update(index.object_blocks(i))

    # ---------------------------------------------------------------- saves
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, AdpConnectorMetadata) or not meta.saves:
            return
        if layer_name not in self.layers or layer_name in self._saved_layers:
            return
        self._saved_layers.add(layer_name)
        if self._active():
            self._put(meta.saves, [layer_name], meta.step, "S")

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        # every GET of this step is settled before the step ends (errors are reported now)
        for name in list(self._load_futs):
            self._settle_load(*self._load_futs.pop(name))
        if isinstance(meta, AdpConnectorMetadata):
            with self._lock:
                self._had_saves.update(p.req_id for p in meta.saves)
                self._had_saves.update(p.req_id for p in meta.deferred_saves)
            if meta.saves and self._active():
                missing = [n for n in self.layer_names if n not in self._saved_layers]
                if missing:   # layers whose save hook did not run (e.g. no attention metadata)
                    self._put(meta.saves, missing, meta.step, "S")
            if meta.deferred_saves and self._active():
                self._put(meta.deferred_saves, self.layer_names, meta.step, "D")
        self._saved_layers.clear()
        if self._step_jobs:
            # Sliding window: vLLM frees the blocks that leave the window when it schedules the
            # next step (or finishes the request), whatever request_finished returns, and may
            # hand them to another request at once. So this step's pages must be in the ring
            # before the step ends. This waits for ring slots and one copy, never for storage.
            jobs, self._step_jobs = self._step_jobs, []
            for job in jobs:
                job.wait(self.settings.client.timeout_s * 2)

    def _put(self, plans: list[ChunkPlan], layer_names: list[str], step: int, kind: str) -> None:
        bpc = self.blocks_per_chunk
        digests = [d for p in plans for d in p.digests]
        marks = [m for p in plans for m in p.marks]
        blocks = as_index([b for p in plans for b in p.block_ids])
        n = len(digests)
        if n == 0:
            return
        req_ids = {p.req_id for p in plans}
        layers = [self.layers[name] for name in layer_names]
        obj, sl = self._part(layers[0])
        ready = None
        if layers[0].on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        if len(layers) == 1:
            tag = self._tag(kind, step, layer_names[0])
        else:
            tag = f"{kind}{step}:all" if self.tp_size > 1 else None
        keys = self.keys.keys(digests, [self.layer_index[name] for name in layer_names])
        job = _PutJob(len(keys))
        client, ring = self.client, self.ring

        def on_batch(b):
            # objects are layer-major: object i is chunk i % n of layer i // n
            i, end = b.first, b.first + b.count
            while i < end:
                li, ci = divmod(i, n)
                run = min(end, (li + 1) * n) - i
                slot = b.offset + (i - b.first) * b.stride
                layers[li].gather(ring, slot, b.stride, run, sl[0], sl[1],
                                  blocks[ci * bpc:(ci + run) * bpc], bpc, self._stream, ready)
                i += run
            job.copied(b.count)
            return True

        fut = client.put(keys, obj, on_batch, marks=marks * len(layer_names), tag=tag, slice=sl)
        fut.add_done_callback(lambda f: job.done())
        with self._lock:
            for r in req_ids:
                self._jobs_by_req.setdefault(r, []).append(job)
        if self.sliding_window is not None:
            self._step_jobs.append(job)

    # ---------------------------------------------------------------- completion
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted request's blocks are reused now: its pages must be in the ring first."""
        preempted = getattr(kv_connector_metadata, "preempted", None) or ()
        for req_id in preempted:
            with self._lock:
                jobs = self._jobs_by_req.pop(req_id, [])
            for job in jobs:
                job.wait(self.settings.client.timeout_s * 2)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Finished requests whose blocks the scheduler kept for our saves, once their
        pages are in the ring (the storage write itself is not awaited)."""
        if self._role != KVConnectorRole.WORKER:
            return None, None
        done: set[str] = set()
        with self._lock:
            self._finished_waiting.update(r for r in finished_req_ids if r in self._had_saves)
            for req_id in list(self._finished_waiting):
                jobs = self._jobs_by_req.get(req_id, [])
                if all(j.is_copied() for j in jobs):
                    self._jobs_by_req.pop(req_id, None)
                    self._finished_waiting.discard(req_id)
                    self._had_saves.discard(req_id)
                    done.add(req_id)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if getattr(self, "_role", None) == KVConnectorRole.WORKER:
            for job_list in list(self._jobs_by_req.values()):
                for job in job_list:
                    job.wait(2.0)
            if self._attachment is not None:
                self._attachment.close()      # BYE; on_detach unpins the ring
            self._use(None)
        elif getattr(self, "_lookup", None) is not None:
            self._lookup.close()


# =============================================================================== helpers
class ChunkPlanIndex:
    """The objects of one step's loads, in request order, and where their blocks go."""

    def __init__(self, plans: list[ChunkPlan], blocks_per_chunk: int):
        self.bpc = blocks_per_chunk
        self.digests: list[bytes] = []
        self.marks: list[int] = []
        dst: list[int] = []
        pos: list[int] = []       # global block position: object*bpc + block in object
        self._obj_blocks: list[list[int]] = []
        obj = 0
        for p in plans:
            positions = p.positions if p.positions is not None else list(range(len(p.digests) * self.bpc))
            per_obj: list[list[int]] = [[] for _ in p.digests]
            for b, q in zip(p.block_ids, positions):
                dst.append(b)
                pos.append(obj * self.bpc + q)
                per_obj[q // self.bpc].append(b)
            self._obj_blocks.extend(per_obj)
            self.digests.extend(p.digests)
            self.marks.extend(p.marks)
            obj += len(p.digests)
        self.dst = torch.as_tensor(dst, dtype=torch.long)
        self.pos = torch.as_tensor(pos, dtype=torch.long)
        self.all_blocks = dst
        self.full = len(dst) == obj * self.bpc   # every block of every object is written

    def object_blocks(self, i: int) -> list[int]:
        return self._obj_blocks[i]

    def batch_blocks(self, first: int, count: int, hits) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(destination block ids, positions within the batch or None) for a ring batch."""
        lo, hi = first * self.bpc, (first + count) * self.bpc
        if self.full and (hits is None or all(hits)):
            return self.dst[lo:hi], None
        sel = (self.pos >= lo) & (self.pos < hi)
        if hits is not None and not all(hits):
            hit_obj = torch.as_tensor([bool(h) for h in hits], dtype=torch.bool)
            sel &= hit_obj[((self.pos - lo) // self.bpc).clamp(0, count - 1)]
        if not bool(sel.any()):
            return None, None
        return self.dst[sel], self.pos[sel] - lo


class _PutJob:
    """One PUT: when all its pages are in the ring, the blocks may be reused."""

    __slots__ = ("n", "_copied", "_event")

    def __init__(self, n: int):
        self.n = n
        self._copied = 0
        self._event = threading.Event()

    def copied(self, count: int) -> None:
        self._copied += count
        if self._copied >= self.n:
            self._event.set()

    def done(self) -> None:
        self._event.set()

    def is_copied(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


def _kv_layout(vllm_config) -> str:
    layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if layout:
        return str(getattr(layout, "name", layout))
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
        return str(get_kv_connector_cache_layout())
    except Exception:
        return "default"
