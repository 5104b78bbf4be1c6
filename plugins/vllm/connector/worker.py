"""The worker role of ``AdpKVConnector``: moves one step's chunks between the
KV blocks of this rank and the gateway.

``start_load_kv`` sends one GET per layer (collective over the TP ranks: each
rank reads its heads' slice of every object); ``wait_for_layer_load`` fences
that layer only, so later layers load while earlier ones compute. A step vLLM may
replay as a FULL CUDA graph (``AdpConnectorMetadata.loads_before_pass``) has its
loads settled in ``start_load_kv``. Where loads are asynchronous (``cfg.loads_async``:
several KV cache groups, or vLLM's asynchronous scheduling) the GETs run for requests
that wait unscheduled, and their end is reported by ``transfer_results`` (or, on a
vLLM without it, ``get_finished`` with a failure's blocks).
``save_kv_layer`` PUTs the new full chunks of a layer (the copy into the ring
runs in the client's I/O thread, from the blocks); decode-step chunks go out
in one request per step from ``wait_for_save``. Nothing waits for storage; a
finished request keeps its blocks until their pages are in the ring
(``get_finished``). A chunk that cannot be read is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it.

Sleep mode (vLLM >= 0.33): ``unregister_kv_caches`` closes the gate every copy to or from
the KV tensors passes (``kv_gate.KVGate``: copies running now end first, later ones are
refused, their objects misses / not stored); ``restore_kv_caches`` maps the layers again
from the tensors vLLM registered (views taken anew, so memory put back at other addresses
is followed) and opens it.

Direct restores (``adpkv.direct_map_bytes`` > 0, ``adpkv_core.direct_map``): a layer's GET whose
objects this rank holds mapped (read-only descriptors the gateway handed and checked) is no GET:
its blocks are copied straight from the mappings (``PagedLayer.load_objects``: on CUDA one DMA
per run of objects mapped together, from their span's read-only registration); a layer that does not hold them all goes through the
ring as before and its objects are mapped in the background for the next restore. Only a
rank's own GETs (no TP collective, no fan-out, no canonical head shares); the rest go by the ring.

The rank holds the gateway through ``adpkv_core.attachment.Attachment``; a
fresh attachment is put to use only at ``bind`` (a step begins), and a step
runs wholly on the attachment it began with: a transfer started on the old one
ends on it as misses.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import torch

from adpkv_core.attachment import Attachment, Session
from adpkv_core.client import GatewayClient, LoadResult
from adpkv_core.direct_map import DirectMaps, Mapping, cuda_registrar
from adpkv_core.jobs import JobBook

from ..common.copy import PagedLayer, as_index
from ..common.vllm_api import reports_failed_requests
from .fanout import Fanout, LayerLoad, for_vllm
from .heads import HeadShare
from .kv_gate import KVGate
from .metadata import AdpConnectorMetadata, CacheGroup, ChunkPlan, ConnectorConfig
from .recurrent import state_pages
from .transfers import AsyncLoad, ChunkPlanIndex, PutJob, received

logger = logging.getLogger("adpkv.vllm")

# the engine counts as computing until this long after its last pass: objects stored are mapped
# (adpkv.direct_map_bytes) in its pauses, not under its passes
ENGINE_QUIET_S = 0.1

# the longest an idle step (no token scheduled) waits in get_finished for an asynchronous load to end
IDLE_WAIT_S = 0.002


class AdpConnectorWorker:
    """The worker-side half of ``AdpKVConnector`` (one per rank)."""

    def __init__(self, cfg: ConnectorConfig, num_blocks: int):
        self.cfg = cfg
        self.supported = cfg.supported         # False also when a layer has no KV tensor
        self.attachment: Optional[Attachment] = None
        self.session: Optional[Session] = None
        self.client: Optional[GatewayClient] = None   # this step's client and ring (see _use)
        self.ring: Optional[torch.Tensor] = None
        self.layers: dict[str, PagedLayer] = {}
        self.shares: dict[str, HeadShare] = {}   # canonical objects, several ranks: each layer's heads
        self.rank = 0
        self._layer_index = cfg.layer_index
        self._group_of = cfg.group_of_layer
        self._before_pass = [n for g in cfg.groups for n in g.before_pass]
        # an EAGLE/MTP drafter's layers: their own plans (keys), saved only from their own hook
        self._drafter = cfg.drafter.layers if cfg.drafter is not None else frozenset()
        # per group, the target's layers (wait_for_save: a drafter layer is saved only from its hook)
        self._target_layers = {g.index: [n for n in g.layer_names if n not in self._drafter] for g in cfg.groups}
        self._async_loads: JobBook[AsyncLoad] = JobBook()   # cfg.loads_async: loads outside the pass
        # how vLLM takes an asynchronous load's end: per request (get_transfer_results) or, without
        # it (0.26 to 0.29), from get_finished, a failure by its blocks
        self._loads_by_request = reports_failed_requests()
        self._num_blocks = num_blocks
        self._load_futs: dict[str, tuple[Any, ChunkPlanIndex, Optional[LayerLoad]]] = {}
        self.fanout: Optional[Fanout] = None   # MLA with adpkv.nvlink_fanout (fanout.py)
        self._load_errors: set[int] = set()
        self._saved_layers: set[str] = set()
        self._jobs_by_req: dict[str, list[PutJob]] = {}
        self._finished_waiting: set[str] = set()
        self._had_saves: set[str] = set()    # requests the scheduler keeps blocks for
        self._step_jobs: list[PutJob] = []  # sliding window: PUTs of this step (see wait_for_save)
        self._lock = threading.Lock()
        self._stream = None
        self._kv_caches: dict[str, torch.Tensor] = {}   # as vLLM registered them (restore maps them again)
        self._gate = KVGate()                          # closed while vLLM sleeps
        self.direct: Optional[DirectMaps] = None       # adpkv.direct_map_bytes: mapped objects (see the module)
        self.direct_layers = 0                         # layer loads served from mappings
        self._in_pass = False                          # between start_load_kv and wait_for_save
        self._idle = False                             # this step computes no token (meta.idle)
        self._last_pass = 0.0                          # when the last pass was queued (_computing)
        self._pass_done: Optional[torch.cuda.Event] = None   # on CUDA: the end of the last pass queued
        self._passes = 0                               # passes begun (start_load_kv of a step that computes)
        self._passes_ended = 0                         # passes ended (wait_for_save)
        self._pass_due = 0        # the pass that computes the rest of the restores reported last (_computing)

    # ------------------------------------------------------------------ attachment
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the layers' KV tensors and attach this rank to the gateway."""
        cfg = self.cfg
        if not self.supported:
            return
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.rank = get_tensor_model_parallel_rank()
        except Exception:
            self.rank = 0
        self._kv_caches = dict(kv_caches)
        if not self._map_layers():
            return
        first = self.layers[cfg.layer_names[0]]
        if first.on_gpu:
            self._stream = torch.cuda.Stream(device=first.device)
        layout = {"engine": "vllm", "layers": len(self.layers), "chunk_tokens": cfg.chunk_size,
                  "page_bytes": first.page_bytes, "page_shape": list(first.page_shape),
                  "dtype": str(first.dtype), "layout": cfg.layout,
                  "groups": [g.describe() for g in cfg.groups]}
        self.attachment = Attachment(cfg.settings.client, cfg.engine_id, self.rank, cfg.tp_size, layout,
                                     reconnect_s=cfg.reconnect_s, install="on_refresh",
                                     on_attach=self._on_attach, on_detach=self._on_detach,
                                     name="adpkv-vllm")
        self._use(self.attachment.session)
        self.fanout = for_vllm(cfg.settings.nvlink_fanout, any(g.tp_shared for g in cfg.groups), cfg.tp_size,
                               first.device)
        self.direct = self._direct_maps(first.on_gpu)
        logger.info("adpkv: rank %d registered %d layers, page %s %s (%d bytes), object %d bytes",
                    self.rank, len(self.layers), first.page_shape, first.dtype, first.page_bytes,
                    first.page_bytes * cfg.blocks_per_chunk * cfg.tp_size)

    def _direct_maps(self, on_gpu: bool) -> Optional[DirectMaps]:
        """The rank's ``DirectMaps`` when ``adpkv.direct_map_bytes`` > 0: on CUDA every mapping
        registered read-only (a refused one is not kept: its restores go by the ring)."""
        limit = self.cfg.settings.direct_map_bytes
        if limit <= 0:
            return None
        registrar = cuda_registrar() if on_gpu else None
        if on_gpu and registrar is None:
            logger.warning("adpkv: direct_map_bytes is set but CUDA cannot register host memory here; "
                           "restores go through the ring")
            return None
        logger.info("adpkv: rank %d restores from mapped object files (direct_map_bytes=%d)", self.rank, limit)
        return DirectMaps(limit, registrar, require_registration=on_gpu, busy=self._computing)

    def _computing(self) -> bool:
        """Whether the engine runs passes now: one is being queued, the GPU has not finished the
        last one queued, or the last one ended within ``ENGINE_QUIET_S`` (the next may follow);
        or one is due: an asynchronous load runs or ended (its request computes the rest of
        its prompt in the pass after the load is reported, which must have ended). Mapping
        waits for a pause (``DirectMaps``): an asynchronous load ends while the engine idles,
        and pinning its pages then delayed that pass (the V1 runner on an H100, 8k: the load in
        at 124 ms, the first token at 655). Any thread may ask."""
        if self._in_pass or self._async_loads.pending() or self._passes_ended < self._pass_due:
            return True
        done = self._pass_done
        if done is not None and not done.query():
            return True
        return time.monotonic() - self._last_pass < ENGINE_QUIET_S

    def _map_layers(self) -> bool:
        """``self.layers`` (and, for canonical objects at TP > 1, ``self.shares``: each layer's
        heads of this rank) from the registered tensors; False (the cache off) where a layer has
        none or a page that cannot be cut by heads."""
        layers: dict[str, PagedLayer] = {}
        shares: dict[str, HeadShare] = {}
        for name in self.cfg.layer_names:
            kv = self._kv_caches.get(name)
            if self._group_of[name].recurrent and kv is not None:
                try:       # a Mamba layer's state tensors: one row of state bytes per block
                    kv = state_pages(kv, self._num_blocks or kv[0].shape[0])
                except (ValueError, TypeError, IndexError) as exc:
                    logger.warning("adpkv: layer %s: %s; external cache disabled", name, exc)
                    self.supported = False
                    return False
            if kv is None or not isinstance(kv, torch.Tensor):
                logger.warning("adpkv: layer %s has no KV tensor; external cache disabled", name)
                self.supported = False
                return False
            layers[name] = PagedLayer(name, kv, self._num_blocks or kv.shape[0], self._kernel_split(name, kv))
            if self.cfg.head_sharded and name in self.cfg.layer_heads:
                layer = layers[name]
                share = HeadShare.of(layer.page_shape, layer.dtype, *self.cfg.layer_heads[name],
                                     self.cfg.tp_size, self.rank)
                if share is None:    # the objects are canonical: a page we cannot cut by heads
                    logger.warning("adpkv: layer %s: page %s is not vLLM's standardized [heads, tokens, 2 x "
                                   "head size] of %s heads; external cache disabled", name, layer.page_shape,
                                   self.cfg.layer_heads[name])
                    self.supported = False
                    return False
                shares[name] = share
        self.layers = layers
        self.shares = shares
        return True

    def _kernel_split(self, name: str, kv: torch.Tensor) -> Optional[int]:
        """Kernel blocks per block of an attention layer's standardized ``[B, heads, tokens,
        head size or 2 x head size]`` view (vLLM >= 0.32), from its page's token count: what lets
        ``block_major_view`` tell a kernel split from the reservation of vLLM 0.34's extensible
        KV cache (a view with more rows than committed blocks). None where the page is not that
        view (MLA, recurrent states, 0.26's layouts): those go by the row count as before."""
        heads = self.cfg.layer_heads.get(name)
        if heads is None or kv.dim() != 4 or self._group_of[name].recurrent:
            return None
        head_size, tokens = heads[1], int(kv.shape[2])
        if int(kv.shape[3]) not in (head_size, 2 * head_size) or tokens <= 0:
            return None
        block = self.cfg.block_size
        return block // tokens if block % tokens == 0 else None

    # ------------------------------------------------------------------ sleep mode
    def unregister_kv_caches(self) -> None:
        """vLLM is about to release the KV cache's memory: no copy touches it after this
        returns (the ones running have ended; later batches are refused). Idempotent."""
        self._gate.close()

    def restore_kv_caches(self) -> None:
        """The KV cache's memory is back: map the layers again from the registered tensors
        (their storage may have moved) and let copies in. Idempotent."""
        if not self._gate.closed:
            return
        if self.supported and self._kv_caches:
            self._map_layers()
        self._gate.open()

    def _on_attach(self, s: Session) -> None:
        s.state["ring"] = s.ring.tensor() if s.ring is not None else None
        if s.state["ring"] is not None and self.layers and next(iter(self.layers.values())).on_gpu:
            from ..common.cuda_ring import pin_ring
            pin_ring(s.state["ring"])     # DMA copies ring <-> GPU on our stream

    def _on_detach(self, s: Session) -> None:
        ring = s.state.get("ring")
        if ring is not None and self._stream is not None:
            self._stream.synchronize()    # no copy from the old ring is still queued
            from ..common.cuda_ring import unpin_ring
            unpin_ring(ring)

    def _use(self, s: Optional[Session]) -> None:
        self.session = s
        self.client = s.client if s is not None else None
        self.ring = s.state.get("ring") if s is not None else None

    def bind(self) -> None:
        """A step begins: the one point where a fresh attachment is put to use."""
        if self.attachment is not None:
            s = self.attachment.refresh()
            if s is not self.session:
                self._use(s)

    def _active(self) -> bool:
        return (self.supported and self.client is not None and self.ring is not None and self.client.enabled
                and not self._gate.closed)

    def _part(self, layer: PagedLayer, group: CacheGroup) -> tuple[int, tuple[int, int]]:
        """(object bytes, this rank's (offset, bytes) of it): an MLA object (latent pages every
        rank holds) is one page per block; a canonical object (every KV head, ``heads.py``) is
        TP pages per block, of which the rank copies its heads' rows (the whole object is its
        request's slice); in a per-TP layout a rank owns the slice at ``rank * part``."""
        part = layer.page_bytes * self.cfg.object_blocks(group)
        if group.tp_shared:
            return part, (0, part)
        if layer.name in self.shares:
            return part * self.cfg.tp_size, (0, part * self.cfg.tp_size)
        return part * self.cfg.tp_size, (self.rank * part, part)

    def _collective(self, group: CacheGroup) -> bool:
        """Whether the TP ranks send one collective request (each its slice of every object)."""
        return self.cfg.tp_size > 1 and not group.tp_shared

    def _tag(self, kind: str, step: int, layer: str) -> Optional[str]:
        group = self._group_of[layer]
        # fan-out: an MLA layer's GET is collective, so the group reads each object into the ring once
        fanned = kind == "L" and group.tp_shared and self.fanout is not None
        if not (self._collective(group) or fanned):
            return None
        return f"{kind}{step}:{self._layer_index[layer]}"

    def _key(self, name: str) -> tuple[int, bool]:
        """Which plans a layer's objects follow: its group's, the drafter's or the target's."""
        return self._group_of[name].index, name in self._drafter

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, meta: Any) -> None:
        # vLLM calls it at the start of every step; an idle one (no token scheduled) queues no
        # pass, and vLLM calls no wait_for_save after it
        self._idle = isinstance(meta, AdpConnectorMetadata) and meta.idle
        self._in_pass = not self._idle
        if self._in_pass:
            self._passes += 1
        if isinstance(meta, AdpConnectorMetadata) and meta.failed_loads:   # hits with no load planned
            if self.cfg.loads_async:   # no GET: failed
                self._async_loads.submit([], AsyncLoad({r: {} for r in meta.failed_loads}, dict(meta.failed_loads), []),
                                         failed=True)
            else:
                self._load_errors.update(b for blocks in meta.failed_loads.values() for b in blocks)
        if not isinstance(meta, AdpConnectorMetadata) or not meta.loads:
            return
        cfg = self.cfg
        indexes = {(g.index, d): ChunkPlanIndex([p for p in meta.loads if (p.group, p.drafter) == (g.index, d)],
                                                cfg.object_blocks(g))
                   for g in cfg.groups for d in (False, True)}
        if cfg.loads_async:
            self._start_async_load(meta, indexes)
            return
        if not self._active():
            for index in indexes.values():
                self._load_errors.update(index.all_blocks)
            if self.fanout is not None:    # the exchange is collective: take part, sourcing nothing
                for name in cfg.layer_names:
                    if indexes[self._key(name)].digests:
                        self._load_futs[name] = (None, indexes[self._key(name)], None)
                self._settle_before_pass()   # in the same order as the other ranks
            return
        client, ring = self.client, self.ring   # the whole load runs on this step's attachment
        for name in cfg.layer_names:     # layer 0 first: it is needed first
            index = indexes[self._key(name)]
            if not index.digests:
                continue
            load = self.fanout.begin(len(index.digests)) if self.fanout is not None else None
            fut = self._get_layer(client, ring, name, index, self._tag("L", meta.step, name), load)
            self._load_futs[name] = (fut, index, load)
        self._settle_before_pass()
        if meta.loads_before_pass:     # a FULL CUDA graph calls no wait_for_layer_load
            self._settle_all_loads()

    def _get_layer(self, client, ring, name: str, index: ChunkPlanIndex, tag: Optional[str],
                   share: Optional[LayerLoad] = None):
        """One layer's GET of the objects ``index`` plans; each ring batch is scattered into
        the layer's KV blocks (with fan-out, ``share``: only this rank's share of it, the rest
        comes over NVLink). The GET's future."""
        cfg = self.cfg
        group = self._group_of[name]
        layer = self.layers[name]
        obj, sl = self._part(layer, group)
        heads = self.shares.get(name)
        keys = cfg.keys.keys(index.digests, (self._layer_index[name],), kind=group.index)
        ticket = self._gate.ticket()
        direct = self.direct if (share is None and heads is None and tag is None) else None
        if direct is not None:
            held = direct.acquire(keys)
            mapped = [m for m in held if m is not None]
            if len(mapped) == len(held):
                return self._load_mapped(direct, mapped, layer, index, sl, ticket)
            direct.release(held)

        def copy(b):
            if share is not None:
                self.fanout.scatter_share(share, layer, ring, b, sl, index, cfg.blocks_per_chunk, self._stream)
                return
            dst, pos = index.batch_blocks(b.first, b.count, b.hits)
            if dst is None:
                return True
            if heads is not None:
                layer.scatter_share(heads.view(ring, b.offset, b.stride, b.count, index.bpc), dst, pos, self._stream)
            else:
                layer.scatter(ring, b.offset, b.stride, b.count, sl[0], sl[1], dst, pos,
                              index.bpc, self._stream)

        def on_batch(b):
            return self._gate.run(ticket, lambda: copy(b))

        fut = client.get(keys, obj, on_batch, marks=index.marks, tag=tag, slice=sl)
        if direct is not None:
            # mapped in the background once the ring restore is done and the engine pauses: on the
            # H200 an 8k ring restore's mappings (0.2-0.5 s of page pinning) ran under the pass that
            # computed the rest of the prompt, its first token 0.32 s after arrival, the load in at 0.15
            fut.add_done_callback(lambda _: direct.prefetch(client, keys, obj, index.marks, after_passes=True))
        return fut

    def _load_mapped(self, direct: DirectMaps, held: list[Mapping], layer: PagedLayer, index: ChunkPlanIndex,
                     sl: tuple[int, int], ticket: int) -> "Future[LoadResult]":
        """A layer's objects copied from their mappings into its blocks (queued on the
        connector's stream on CUDA, and waited for here: the mappings are released only once
        the DMA has passed them). A future of the hits: all, or none when the KV gate refused."""
        dst, pos = index.batch_blocks(0, len(held), None)

        def copy():
            done = layer.load_objects(held, dst, index.bpc, pos, sl[0], sl[1], self._stream)
            if done is not None:
                done.synchronize()
        try:
            ok = dst is None or self._gate.run(ticket, copy)
        finally:
            direct.release(held)
        if ok:
            self.direct_layers += 1
        fut: "Future[LoadResult]" = Future()
        fut.set_result(LoadResult([bool(ok)] * len(held)))
        return fut

    def _settle_before_pass(self) -> None:
        """Caches the model reads before any layer hook (the sparse-attention indexer's keys)
        are complete before the pass begins."""
        for name in self._before_pass:
            if name in self._load_futs:
                self._settle_load(name, *self._load_futs.pop(name))

    def _start_async_load(self, meta: AdpConnectorMetadata,
                          indexes: dict[tuple[int, bool], ChunkPlanIndex]) -> None:
        """One GET per layer for requests that wait, unscheduled, for their KV (several KV
        cache groups, ``cfg.loads_async``); ``transfer_results`` reports each request once
        every layer's GET has ended: received, or failed if any of its objects missed."""
        cfg = self.cfg
        spans: dict[str, dict[tuple[int, bool], tuple[int, int]]] = {}   # req -> plans -> its object range
        for key in indexes:
            at = 0
            for p in meta.loads:
                if (p.group, p.drafter) == key:
                    spans.setdefault(p.req_id, {})[key] = (at, at + len(p.digests))
                    at += len(p.digests)
        blocks: dict[str, list[int]] = {}
        for p in meta.loads:
            blocks.setdefault(p.req_id, []).extend(p.block_ids)
        if not self._active():      # no GET: every request of it fails (recomputed by vLLM)
            self._async_loads.submit([], AsyncLoad(spans, blocks, []), failed=True)
            return
        client, ring = self.client, self.ring
        futures: list[Future] = []
        gets: list[tuple[tuple[int, bool], int]] = []
        for name in cfg.layer_names:
            group = self._group_of[name]
            index = indexes[self._key(name)]
            if not index.digests:
                continue
            tag = f"A{meta.step}:{self._layer_index[name]}" if self._collective(group) else None
            futures.append(self._get_layer(client, ring, name, index, tag))
            gets.append((self._key(name), len(index.digests)))
        self._async_loads.submit(futures, AsyncLoad(spans, blocks, gets))

    def wait_for_layer_load(self, layer_name: str) -> None:
        entry = self._load_futs.pop(layer_name, None)
        if entry is not None:
            self._settle_load(layer_name, *entry)

    def _settle_all_loads(self) -> None:
        """Every layer GET of this step not waited for yet, waited for (in layer order)."""
        for name in list(self._load_futs):
            self._settle_load(name, *self._load_futs.pop(name))

    def _settle_load(self, name: str, fut, index: ChunkPlanIndex, load: Optional[LayerLoad]) -> None:
        try:
            hits = fut.result().hits if fut is not None else [False] * len(index.digests)
        except Exception:
            hits = [False] * len(index.digests)
        if self.fanout is not None:   # every rank, every loaded layer, in layer order (collective)
            hits = self.fanout.exchange(load, self.layers[name], index).tolist()
        for i, h in enumerate(hits):
            if not h:
                self._load_errors.update(index.object_blocks(i))

    # ------------------------------------------------------------------ saves
    def save_kv_layer(self, meta: Any, layer_name: str) -> None:
        if not isinstance(meta, AdpConnectorMetadata) or not meta.saves:
            return
        if layer_name not in self.layers or layer_name in self._saved_layers:
            return
        self._saved_layers.add(layer_name)
        if self._active():
            group = self._group_of[layer_name]
            self._put([p for p in meta.saves if (p.group, p.drafter) == self._key(layer_name)], group,
                      [layer_name], meta.step, "S")

    def wait_for_save(self, meta: Any) -> None:
        if self._stream is not None:          # on CUDA: where the pass ends on the GPU (_computing)
            done = torch.cuda.Event()
            done.record()
            self._pass_done = done
        self._in_pass = False
        self._passes_ended = self._passes
        self._last_pass = time.monotonic()
        # every GET of this step is settled before the step ends (errors are reported now)
        self._settle_all_loads()
        if isinstance(meta, AdpConnectorMetadata):
            with self._lock:
                self._had_saves.update(p.req_id for p in meta.saves)
                self._had_saves.update(p.req_id for p in meta.deferred_saves)
            for group in self.cfg.groups:
                # the target's layers (a drafter layer is saved only from its own hook: a hook
                # that did not run is a drafter that did not compute this step's pages)
                target = self._target_layers[group.index]
                if meta.saves and self._active():
                    # layers whose save hook did not run (e.g. no attention metadata)
                    missing = [n for n in target if n not in self._saved_layers]
                    if missing:
                        self._put([p for p in meta.saves if (p.group, p.drafter) == (group.index, False)], group,
                                  missing, meta.step, "S")
                if meta.deferred_saves and self._active() and target:
                    self._put([p for p in meta.deferred_saves if (p.group, p.drafter) == (group.index, False)],
                              group, target, meta.step, "D")
                if group.recurrent and meta.state_saves and self._active():
                    # states this step's pass committed (vLLM's hand-offs): after the pass
                    self._put([p for p in meta.state_saves if p.group == group.index], group,
                              list(group.layer_names), meta.step, "M")
        self._saved_layers.clear()
        if self._step_jobs:
            # Sliding window (and recurrent states, whose hand-off holds only until the end
            # of the pass): vLLM frees the blocks that leave the window when it schedules the
            # next step (or finishes the request), whatever request_finished returns, and may
            # hand them to another request at once. So this step's pages must be in the ring
            # before the step ends. This waits for ring slots and one copy, never for storage.
            jobs, self._step_jobs = self._step_jobs, []
            for job in jobs:
                job.wait(self.cfg.settings.client.timeout_s * 2)

    def _put(self, plans: list[ChunkPlan], group: CacheGroup, layer_names: list[str], step: int,
             kind: str) -> None:
        """PUT the chunks of ``plans`` (all of ``group``) for these layers of the group."""
        cfg = self.cfg
        bpc = cfg.object_blocks(group)
        if group.tp_shared and self.rank != 0:
            return      # MLA: rank 0 writes the object every rank holds
        digests = [d for p in plans for d in p.digests]
        marks = [m for p in plans for m in p.marks]
        blocks = as_index([b for p in plans for b in p.block_ids])
        n = len(digests)
        if n == 0:
            return
        req_ids = {p.req_id for p in plans}
        layers = [self.layers[name] for name in layer_names]
        heads = [self.shares.get(name) for name in layer_names]
        obj, sl = self._part(layers[0], group)
        ready = None
        if layers[0].on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        if len(layers) == 1:
            tag = self._tag(kind, step, layer_names[0])
        else:
            tag = f"{kind}{step}:g{group.index}" if self._collective(group) else None
        keys = cfg.keys.keys(digests, [self._layer_index[name] for name in layer_names], kind=group.index)
        job = PutJob(len(keys))
        client, ring = self.client, self.ring
        # every caller checks _active() first, which holds only with a client
        assert client is not None
        ticket = self._gate.ticket()

        def copy(b):
            # objects are layer-major: object i is chunk i % n of layer i // n
            i, end = b.first, b.first + b.count
            while i < end:
                li, ci = divmod(i, n)
                run = min(end, (li + 1) * n) - i
                slot = b.offset + (i - b.first) * b.stride
                ids = blocks[ci * bpc:(ci + run) * bpc]
                if heads[li] is not None:
                    layers[li].gather_share(heads[li].view(ring, slot, b.stride, run, bpc), ids, self._stream, ready)
                else:
                    layers[li].gather(ring, slot, b.stride, run, sl[0], sl[1], ids, bpc, self._stream, ready)
                i += run
            job.copied(b.count)

        def on_batch(b):
            return self._gate.run(ticket, lambda: copy(b))

        fut = client.put(keys, obj, on_batch, marks=marks * len(layer_names), tag=tag, slice=sl)
        fut.add_done_callback(lambda f: job.done())
        direct = self.direct
        if direct is not None and tag is None and all(h is None for h in heads) and not group.recurrent:
            # what this rank stored is mapped in the background (within direct_map_bytes), so a
            # prompt that returns to this engine restores by the copy-free path the first time
            all_marks = marks * len(layer_names)
            fut.add_done_callback(lambda f: _map_stored(direct, client, keys, obj, all_marks, f))
        if group.sliding_window is not None or group.recurrent:
            self._step_jobs.append(job)      # in the ring before the step ends (wait_for_save)
        if not group.recurrent:
            with self._lock:
                for r in req_ids:
                    self._jobs_by_req.setdefault(r, []).append(job)

    # ------------------------------------------------------------------ completion
    def handle_preemptions(self, meta: Any) -> None:
        """A preempted request's blocks are reused now: its pages must be in the ring first."""
        for req_id in getattr(meta, "preempted", None) or ():
            with self._lock:
                jobs = self._jobs_by_req.pop(req_id, [])
            for job in jobs:
                job.wait(self.cfg.settings.client.timeout_s * 2)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving): ``get_finished`` plus the
        asynchronous loads that ended (a failed one is in both of the last two sets)."""
        sending = self._finished_saves(finished_req_ids)
        self._idle_wait()
        recving, failed, _ = self._ended_async_loads()
        return sending, recving, failed

    def _idle_wait(self) -> None:
        """An idle step (no token scheduled: its requests wait, e.g. for their asynchronous
        loads) waits up to ``IDLE_WAIT_S`` for a load to end, off the GIL. Otherwise an engine
        stepping in this process (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) loops
        through idle steps holding the GIL, and the client's threads that copy the load into
        the KV blocks wait for it at every call that releases it (vLLM's engine-core process
        sleeps 1 ms after such a step for the same reason)."""
        if self._idle and self._async_loads.running():
            self._async_loads.wait_any(IDLE_WAIT_S)

    def _ended_async_loads(self) -> tuple[set[str], set[str], set[int]]:
        """(requests whose asynchronous load ended, those of them that failed, the blocks of
        the failed ones): each request once."""
        recving: set[str] = set()
        failed: set[str] = set()
        blocks: set[int] = set()
        for job in self._async_loads.pop_finished():
            load, ok = job.meta, received(job)
            recving |= set(load.spans)
            for req in set(load.spans) - ok:
                failed.add(req)
                blocks.update(load.blocks.get(req, ()))
        if recving:
            self._pass_due = self._passes + 1     # the next pass computes the rest of these prompts
        if failed:
            logger.warning("adpkv: %d restore(s) failed (an object missed): vLLM recomputes each "
                           "from its first failed block: %s", len(failed), sorted(failed))
        return recving, failed, blocks

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(finished requests whose blocks the scheduler kept for our saves, once their pages
        are in the ring (the storage write itself is not awaited); on a vLLM without
        ``get_transfer_results`` (0.26 to 0.29), the requests whose asynchronous load ended, a failed
        one's blocks reported by ``get_block_ids_with_load_errors`` in this same pass)."""
        done = self._finished_saves(finished_req_ids)
        if self._loads_by_request:
            return (done or None), None
        self._idle_wait()
        recving, _, failed_blocks = self._ended_async_loads()
        self._load_errors.update(failed_blocks)
        return (done or None), (recving or None)

    def _finished_saves(self, finished_req_ids: set[str]) -> set[str]:
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
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        # every GET of the step is settled now: with speculative decoding vLLM asks for the
        # errors after the target's pass but before the drafter's (whose layers are still
        # pending here) and before wait_for_save
        self._settle_all_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for job_list in list(self._jobs_by_req.values()):
            for job in job_list:
                job.wait(2.0)
        if self.attachment is not None:
            self.attachment.close()      # BYE; on_detach unpins the ring
        if self.direct is not None:
            logger.info("adpkv: rank %d direct restores: %d layer loads from mappings, %s", self.rank,
                        self.direct_layers, self.direct.stats())
            self.direct.close()
        self._use(None)


def _map_stored(direct: DirectMaps, client: GatewayClient, keys: list[bytes], obj: int, marks: list[int],
                fut: "Future[Any]") -> None:
    """A PUT's done callback: the objects the card now holds (stored, or held already) queued
    for mapping (``DirectMaps.prefetch``: after the restores in flight)."""
    try:
        res = fut.result()
    except Exception:
        return
    held = [i for i, (s, e) in enumerate(zip(res.stored, res.existed)) if s or e]
    if held:
        direct.prefetch(client, [keys[i] for i in held], obj, [marks[i] for i in held], after_passes=True)
