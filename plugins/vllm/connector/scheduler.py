"""The scheduler role of ``AdpKVConnector``: which chunks of a prompt are stored,
and each step's load and save plans.

``get_num_new_matched_tokens`` asks the gateway once per prompt (one EXIST over
the chunk keys of the first and the last layer, or of every layer) which chunks
are stored, from the start up to the first missing one (``hit_chunks``: every one of a prompt
of whole chunks but its last token, which vLLM computes itself); vLLM
counts them as computed and reserves blocks, unless loading them would be slower than computing
them (``load_choice.LoadChoice``, measured per engine: the hit is then declined, the chunks stay
stored). ``build_connector_meta`` hands the
workers a load plan (chunks to restore into which blocks) and a save plan
(chunks that became full this step, less those known stored: the leading ones the EXIST
found, or all of vLLM's own hit when that hit covers the prompt and nothing is asked, and a
chunk this scheduler planned to save before: a prompt served again from vLLM's prefix cache
copies nothing to the gateway);
``update_connector_output`` plans a chunk whose load failed for saving again once vLLM
recomputed it.

The scheduler is not a rank: it attaches as a lookup-only peer of the engine
(``Attachment(rank=None)``), re-attached between steps only (after
``build_connector_meta``), never while a lookup is in flight.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from adpkv_core.affinity import dialog_marks
from adpkv_core.attachment import Attachment

from ..common.settings import chunk_hashes
from .drafter import clip_hit, draft_digests, draft_key_count, save_range
from .load_choice import LoadChoice
from .metadata import AdpConnectorMetadata, CacheGroup, ChunkPlan, ConnectorConfig
from .recurrent import plan_state_saves

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("adpkv.vllm")

# vLLM's BlockPool hands out block 0 as the null block: the block-table entry of a block that
# was never allocated or was freed (sliding window: blocks that left the window)
NULL_BLOCK_ID = 0


# =============================================================================== hit rule
def skipped_blocks(group: CacheGroup, block_size: int, num_computed_tokens: int) -> int:
    """Blocks at the start of a request that vLLM may have freed (null blocks) in this
    group once ``num_computed_tokens`` are computed: those wholly before the sliding
    window. vLLM's SlidingWindowManager frees ``(n - window + 1) // block_size`` blocks or
    fewer (it may retain extra tokens), so this is an upper bound; 0 for full attention."""
    if group.sliding_window is None:
        return 0
    return max(0, num_computed_tokens - group.sliding_window + 1) // block_size


def hit_chunks(cfg: ConnectorConfig, present: list[list[bool]], local: int) -> int:
    """The longest run of chunks every KV cache group can restore.

    ``present[g][c]``: chunk c of group ``cfg.groups[g]`` is stored. A hit of h chunks
    needs, in every group, the chunks that group reads at the boundary h past vLLM's
    own hit ``local``: a full-attention (or MLA) group every one of them, a sliding-
    window group only those inside the window that ends at h (vLLM gives the blocks
    before it null blocks, so they need not be stored), a recurrent-state group the state
    at exactly boundary h (``present[g][h-1]``: the state after chunk h-1)."""
    n = min((len(p) for p in present), default=0)
    first_local = local // cfg.chunk_size
    bpc = cfg.blocks_per_chunk
    for h in range(n, first_local, -1):
        if all(p[h - 1] if g.recurrent else
               all(p[max(skipped_blocks(g, cfg.block_size, h * cfg.chunk_size) // bpc, first_local):h])
               for g, p in zip(cfg.groups, present)):
            return h
    return 0


def stored_chunks(flags: list[bool], at: int, exist_layers: list[list[int]],
                  n: int) -> tuple[list[list[bool]], int]:
    """Per group (``exist_layers``: the layers asked for it), whether each of ``n`` chunks is
    stored in all those layers, read from an EXIST's ``flags`` from ``at`` on (per group, layer
    by layer, ``n`` flags each); and where the flags after these groups start."""
    present = []
    for layers in exist_layers:
        present.append([all(flags[at + li * n + c] for li in range(len(layers))) for c in range(n)])
        at += n * len(layers)
    return present, at


def stored_run(cfg: ConnectorConfig, present: list[list[bool]]) -> int:
    """The leading chunks an EXIST found stored in every attention group (``present`` as
    ``stored_chunks`` reads it): a save of them would write them again."""
    runs = [next((c for c, ok in enumerate(p) if not ok), len(p))
            for g, p in zip(cfg.groups, present) if not g.recurrent]
    return min(runs, default=0)


SAVED_KEPT = 1 << 16     # the chunks whose saves this scheduler planned last, remembered (_Hit.stored)


class _Hit(NamedTuple):
    """What a request's lookup found: ``chunks`` to restore past vLLM's own hit (0: none),
    that hit (``local``, tokens), and ``stored``: the leading chunks known to be stored
    already, which the request's saves skip (those the EXIST found, or, when nothing was
    asked because vLLM's own hit covers the prompt, that hit's chunks: vLLM's offloading
    skips its prefix-hit blocks the same way; and the chunk vLLM completes again past its hit,
    when this scheduler planned its save before)."""

    chunks: int
    local: int
    stored: int


@dataclass
class _ReqState:
    block_ids: dict[int, list[int]] = field(default_factory=dict)   # group index -> its block table
    saved_chunks: int = 0          # chunks stored or planned for saving
    draft_saved: int = 0           # drafter chunks stored, planned or passed over (drafter.py)
    had_saves: bool = False
    restored_chunks: int = 0       # the external hit loaded into its blocks (states stored already)
    load: Optional[tuple[int, int, int]] = None   # (first chunk, end chunk, blocks to skip in first)

    def set_blocks(self, groups: list[CacheGroup], ids, extend: bool = False) -> None:
        """``ids``: vLLM's block ids per KV cache group (a tuple indexed by group id)."""
        if not ids:
            return
        for g in groups:
            new = list(ids[g.index]) if g.index < len(ids) else []
            if extend:
                self.block_ids.setdefault(g.index, []).extend(new)
            else:
                self.block_ids[g.index] = new

    def blocks(self, g: CacheGroup) -> list[int]:
        return self.block_ids.get(g.index, [])

    def first_chunk_of(self, blocks: Iterable[int], bpc: int) -> int:
        """The first chunk that holds one of ``blocks`` in any group (0 for a block it does not
        hold): where the saves of a request whose load failed there must start again."""
        return min(next((ids.index(b) // bpc for ids in self.block_ids.values() if b in ids), 0)
                   for b in blocks)


def _scheduled(scheduler_output: "SchedulerOutput", req_id: str) -> tuple[int, int]:
    """(tokens scheduled for the request this step, of them its speculative draft tokens)."""
    return (scheduler_output.num_scheduled_tokens.get(req_id, 0),
            len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())))


# =============================================================================== role
class AdpConnectorScheduler:
    """The scheduler-side half of ``AdpKVConnector`` (one per engine, in the EngineCore process)."""

    def __init__(self, cfg: ConnectorConfig, kv_transfer_config):
        self.cfg = cfg
        if (getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") == "fail"
                and not cfg.settings.respect_fail_policy):
            # A best-effort cache must never fail a request: a chunk that cannot be
            # read is recomputed. (adpkv.respect_fail_policy=true keeps "fail".)
            try:
                kv_transfer_config.kv_load_failure_policy = "recompute"
                logger.info("adpkv: kv_load_failure_policy set to 'recompute' (a load that fails "
                            "is recomputed, never an error)")
            except Exception:  # pragma: no cover - frozen config
                logger.warning("adpkv: set kv_load_failure_policy=recompute so that a failed load "
                               "is recomputed rather than failing the request")
        # a lookup-only peer of the engine (the scheduler is not a rank); re-attached between
        # steps. None where the cache is off for this model: nothing to look up
        self.lookup: Optional[Attachment] = (
            Attachment(cfg.settings.client, cfg.engine_id, None, cfg.tp_size, {"role": "vllm-scheduler"},
                       reconnect_s=cfg.reconnect_s, install="on_refresh", name="adpkv-vllm-scheduler")
            if cfg.supported else None)
        # req -> (num_tokens, future, digests, drafter digests)
        self._lookups: dict[str, tuple[int, Any, list[bytes], list[bytes]]] = {}
        self._hits: dict[str, _Hit] = {}
        # digests of the chunks this scheduler planned saves for (the last SAVED_KEPT): a prompt
        # of whole chunks served again from vLLM's cache need not store its last chunk again
        self._saved: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()
        self.choice = LoadChoice(cfg.settings.load_choice)
        self._chosen: dict[str, bool] = {}       # req -> its hit loaded (asked once per request)
        self._reqs: dict[str, _ReqState] = {}
        self._requests: dict[str, "Request"] = {}
        self._step = 0
        self._last_step_loads: dict[str, list[int]] = {}
        self._load_failed: set[str] = set()     # asynchronous loads that failed: no second try
        # the blocks of each asynchronous load in flight (a vLLM without failed_recving, 0.26 to 0.29,
        # reports its failure by block)
        self._async_loading: dict[str, set[int]] = {}
        # per group, the layers whose keys an EXIST asks for: its first and last (or all); an
        # EAGLE/MTP drafter's layers are asked apart, under their own keys (drafter.py)
        index = cfg.layer_index
        drafter = cfg.drafter.layers if cfg.drafter is not None else frozenset()
        self._exist_layers: list[list[int]] = []
        self._draft_exist: list[list[int]] = []    # per group with drafter layers
        self._draft_groups: list[CacheGroup] = []
        # a prompt of whole chunks, all stored, hits all but its last token (see
        # get_num_new_matched_tokens): where every group reads each token's own page only.
        # Not a recurrent state (the state after the last chunk has that token in it already),
        # a sliding window (its window at N-1 may start a block earlier than the hit's) or a
        # drafter (its objects are named by the next chunk's first token)
        self._whole_hits = all(g.kind in ("full", "mla") for g in cfg.groups) and cfg.drafter is None
        ends = cfg.settings.exist_layers == "ends"

        def asked(layers: list[int]) -> list[int]:
            return sorted({layers[0], layers[-1]} if layers and ends else layers)

        for g in cfg.groups:
            self._exist_layers.append(asked([index[n] for n in g.layer_names if n not in drafter]))
            draft = [index[n] for n in g.layer_names if n in drafter]
            if draft:
                self._draft_exist.append(asked(draft))
                self._draft_groups.append(g)

    def _digests(self, request: "Request", limit_chunks: int, first: int = 0) -> list[bytes]:
        return chunk_hashes(request.block_hashes, self.cfg.hashes_per_chunk, limit_chunks, first)

    def _draft_digests(self, request: "Request", limit_chunks: int) -> list[bytes]:
        if not self._draft_groups:
            return []
        return draft_digests(request.block_hashes, self.cfg.hashes_per_chunk, limit_chunks)

    def _marks(self, digests: list[bytes]) -> list[int]:
        return dialog_marks(digests, self.cfg.settings.client.affinity_chunks)

    # ------------------------------------------------------------------ lookups
    def may_load_async(self, request: "Request") -> bool:
        """Whether ``get_num_new_matched_tokens`` may answer ``load_kv_async=True`` for this
        request (vLLM >= 0.34, ``--max-num-inflight-kv-loads``: such a request may start its load
        while the running batch is full). Our loads are asynchronous exactly where
        ``cfg.loads_async`` (vLLM's asynchronous scheduling, or several KV cache groups); then any
        request that can hit may: one with a whole chunk before its last token, on a rank
        attached to its gateway, whose load has not failed before (that one is recomputed) and
        whose lookup, if it answered already, found something. Cheap: no request to the gateway."""
        cfg = self.cfg
        if not (cfg.supported and cfg.layer_names and cfg.loads_async):
            return False
        if request.request_id in self._load_failed or self._hit_limit(request.num_tokens, 0) < 1:
            return False
        s = self.lookup.session if self.lookup is not None else None
        if s is None or not s.enabled:
            return False
        known = self._hits.get(request.request_id)
        return known is None or known.chunks * cfg.chunk_size > known.local

    def _hit_limit(self, num_tokens: int, num_computed_tokens: int) -> int:
        """The chunks a prompt of ``num_tokens`` may hit, vLLM holding ``num_computed_tokens``:
        every chunk below its last token; with whole hits, a prompt of whole chunks its last
        chunk too, where none of that chunk is in vLLM's hit (where some is, loading the rest
        of it would spare vLLM fewer tokens than the chunk: the decode runs' prompts, served
        again from vLLM's cache, are not asked about)."""
        chunk = self.cfg.chunk_size
        limit = (num_tokens - 1) // chunk
        if self._whole_hits and num_tokens % chunk == 0 and num_computed_tokens <= limit * chunk:
            return limit + 1
        return limit

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens past vLLM's own hit that the gateway holds; None: ask again next step
        (the EXIST has not answered within ``lookup_wait_s``)."""
        cfg = self.cfg
        if not cfg.supported or not cfg.layer_names:
            return 0, False
        req_id = request.request_id
        if req_id in self._load_failed:      # vLLM recomputes it whole (a retry could fail again)
            return 0, False
        # vLLM computes at least the prompt's last token itself. The EXIST asks every full
        # chunk, floor(N/C). A hit of h chunks is h*C tokens, or N-1 when h*C = N (a prompt of
        # whole chunks, every one stored: ``whole_hits``; the last chunk is loaded whole and
        # vLLM computes its last token again, writing the same token's KV over the loaded
        # one); without whole hits the last chunk of such a prompt is not a hit (it is
        # computed), but need not be saved again when stored. A prompt that can hit nothing
        # past vLLM's own hit (``_hit_limit``) asks nothing: waiting for an EXIST there (to
        # spare that one save) cost the H100's decode runs 0.52 ms a step.
        limit = (request.num_tokens - 1) // cfg.chunk_size
        full = request.num_tokens // cfg.chunk_size
        if self._hit_limit(request.num_tokens, num_computed_tokens) * cfg.chunk_size <= num_computed_tokens:
            stored = num_computed_tokens // cfg.chunk_size
            if full > stored and all(d in self._saved for d in self._digests(request, full, stored)):
                stored = full        # the chunk vLLM completes again was saved from this engine
            self._hits[req_id] = _Hit(0, num_computed_tokens, stored)
            return 0, False
        entry = self._lookups.get(req_id)
        if entry is None or entry[0] != request.num_tokens:
            digests = self._digests(request, full)
            # no lookup attachment (the cache is off for this model): no session, no hit
            s = self.lookup.session if self.lookup is not None else None
            if not digests or s is None or not s.enabled:
                self._hits[req_id] = _Hit(0, num_computed_tokens, 0)
                return 0, False
            marks = self._marks(digests)
            keys, all_marks = [], []
            for g, layers in zip(cfg.groups, self._exist_layers):
                keys += cfg.keys.keys(digests, layers, kind=g.index)
                all_marks += marks * len(layers)
            ddig = self._draft_digests(request, limit)
            for g, layers in zip(self._draft_groups, self._draft_exist):
                keys += cfg.keys.keys(ddig, layers, kind=g.index)
                all_marks += marks[:len(ddig)] * len(layers)
            fut = s.client.exist(keys, marks=all_marks)
            entry = (request.num_tokens, fut, digests, ddig)
            self._lookups[req_id] = entry
        _, fut, digests, ddig = entry
        n, nd = len(digests), len(ddig)
        n_keys = n * sum(len(layers) for layers in self._exist_layers) + nd * sum(map(len, self._draft_exist))
        try:
            flags = fut.result(timeout=cfg.settings.lookup_wait_s)
        except Exception:  # not answered yet: ask again at the next step
            if fut.done():
                flags = [False] * n_keys
            else:
                return None, False
        present, at = stored_chunks(flags, 0, self._exist_layers, n)
        # ``present`` covers every full chunk; without whole hits the last one of a prompt of
        # whole chunks is no hit
        hit = hit_chunks(cfg, present if self._whole_hits else [p[:limit] for p in present], num_computed_tokens)
        if self._draft_groups:    # the drafter's layers restore the same hit, or a shorter one
            draft_present, _ = stored_chunks(flags, at, self._draft_exist, nd)
            hit = clip_hit(hit, draft_present, num_computed_tokens // cfg.chunk_size)
        self._hits[req_id] = _Hit(hit, num_computed_tokens, stored_run(cfg, present))
        ext = min(hit * cfg.chunk_size, request.num_tokens - 1) - num_computed_tokens
        if ext <= 0:
            return 0, False
        if req_id not in self._chosen:
            self._chosen[req_id] = self.choice.choose(request.num_prompt_tokens - num_computed_tokens)
        if not self._chosen[req_id]:       # slower to load than to compute here: vLLM computes it
            return 0, False
        return ext, cfg.loads_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        cfg = self.cfg
        req_id = request.request_id
        st = self._reqs.setdefault(req_id, _ReqState())
        self._requests[req_id] = request
        st.set_blocks(cfg.groups, blocks.get_block_ids())
        hit, local, stored = self._hits.pop(req_id, _Hit(0, 0, 0))
        self._lookups.pop(req_id, None)
        st.saved_chunks = max(st.saved_chunks, hit, stored)
        st.restored_chunks = max(st.restored_chunks, hit)
        st.draft_saved = max(st.draft_saved, hit)
        # timed as the prompt's tokens past vLLM's own hit: restored (a load, then the rest) or computed
        self.choice.started(req_id, request.num_prompt_tokens - local, restored=num_external_tokens > 0)
        if num_external_tokens > 0 and cfg.supported:
            # a whole hit ends one token short of its last chunk, which is loaded all the same
            end_chunk = -(-(local + num_external_tokens) // cfg.chunk_size)
            first_chunk = local // cfg.chunk_size
            skip = (local % cfg.chunk_size) // cfg.block_size
            st.load = (first_chunk, end_chunk, skip)

    # ------------------------------------------------------------------ step plans
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> AdpConnectorMetadata:
        self._step += 1
        meta = AdpConnectorMetadata(step=self._step, idle=not scheduler_output.total_num_scheduled_tokens)
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:
            self.choice.forget(req_id)
        self._note_first_tokens()
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.setdefault(new.req_id, _ReqState())
            st.set_blocks(self.cfg.groups, new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.setdefault(req_id, _ReqState())
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = {}
                st.set_blocks(self.cfg.groups, new_ids)
            else:
                st.set_blocks(self.cfg.groups, new_ids, extend=True)
            computed[req_id] = cached.num_computed_tokens[i]

        self._last_step_loads = {}
        if self.cfg.loads_async:
            # asynchronous loads: the request waits for its KV, unscheduled, with its blocks
            for req_id, st in self._reqs.items():
                if st.load is not None and req_id not in computed and req_id in self._requests:
                    self._plan_load(meta, req_id, self._requests[req_id], st, st.load[1] * self.cfg.chunk_size)
        for req_id, before in computed.items():
            st = self._reqs[req_id]
            request = self._requests.get(req_id)
            if request is None or not self.cfg.supported:
                continue
            if st.load is not None:
                self._plan_load(meta, req_id, request, st, before)
                if req_id in self._last_step_loads and self._may_run_as_full_graph(scheduler_output, req_id):
                    meta.loads_before_pass = True
            self._plan_save(meta, scheduler_output, req_id, request, st, before)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None)
        if offloads and self.cfg.supported:
            meta.state_saves = plan_state_saves(self.cfg, offloads, self._followed, self._digests, self._marks)
        if self.lookup is not None:
            self.lookup.refresh()   # between steps: a fresh attachment, when one is ready, from now on
        return meta

    def _note_first_tokens(self) -> None:
        """The requests timed by the load choice whose first token is out (vLLM appended it in
        the output handling before this step's scheduling)."""
        for req_id in self.choice.timing():
            request = self._requests.get(req_id)
            if request is not None and request.num_output_tokens > 0:
                self.choice.first_token(req_id)

    def _may_run_as_full_graph(self, scheduler_output: "SchedulerOutput", req_id: str) -> bool:
        """Whether vLLM may replay the step that loads ``req_id`` as a FULL CUDA graph: under
        FULL graphs for every batch, always; under FULL graphs for uniform decode batches
        (vLLM's default FULL_AND_PIECEWISE), when the request computes one token (and its
        speculative ones) after its restore: then every request of the batch may do so."""
        if self.cfg.full_graphs == "all":
            return True
        if self.cfg.full_graphs != "uniform_decode":
            return False
        n_sched, n_spec = _scheduled(scheduler_output, req_id)
        return n_sched <= 1 + n_spec

    def _followed(self, req_id: str) -> Optional[tuple["Request", int]]:
        request, st = self._requests.get(req_id), self._reqs.get(req_id)
        return None if request is None or st is None else (request, st.restored_chunks)

    def _plan_load(self, meta: AdpConnectorMetadata, req_id: str, request: "Request",
                   st: _ReqState, before: int) -> None:
        cfg = self.cfg
        bpc = cfg.blocks_per_chunk
        # both callers plan only a request whose st.load is set
        assert st.load is not None
        c0, c1, skip = st.load
        st.load = None
        digests = self._digests(request, c1)
        ddig = self._draft_digests(request, c1)
        if (len(digests) != c1 or (self._draft_groups and len(ddig) != c1)
                or any(len(st.blocks(g)) < c1 * bpc for g in cfg.groups)
                or any(st.blocks(g)[c1 * bpc - 1] == NULL_BLOCK_ID for g in cfg.groups if g.recurrent)):
            # vLLM counts the hit as computed: a load that cannot be planned is a failed one
            meta.failed_loads[req_id] = [b for g in cfg.groups for b in st.blocks(g)[c0 * bpc:c1 * bpc]
                                         if b != NULL_BLOCK_ID]
            if cfg.loads_async:
                self._async_loading[req_id] = set(meta.failed_loads[req_id])
            return
        marks = self._marks(digests)
        loads: list[int] = []
        for g in cfg.groups:
            ids = st.blocks(g)
            if g.recurrent:
                # the state at the hit boundary, into the block vLLM reserved for it (the last
                # one of the hit, as for its own prefix-cache hit); nothing else of the group
                b = ids[c1 * bpc - 1]
                meta.loads.append(ChunkPlan(req_id, [digests[c1 - 1]], [marks[c1 - 1]], [b], group=g.index))
                loads.append(b)
                continue
            # blocks to write: past vLLM's own hit and inside the group's sliding window
            # (the blocks before it are null blocks: vLLM never allocates them)
            first_block = max(c0 * bpc + skip, skipped_blocks(g, cfg.block_size, before))
            dst: list[int] = []
            pos: list[int] = []
            objs: list[int] = []
            for c in range(c0, c1):
                blocks = [b for b in range(max(first_block - c * bpc, 0), bpc)
                          if ids[c * bpc + b] != NULL_BLOCK_ID]
                if not blocks:
                    continue
                for b in blocks:
                    dst.append(ids[c * bpc + b])
                    pos.append(len(objs) * bpc + b)
                objs.append(c)
            if objs:
                whole = len(dst) == len(objs) * bpc
                meta.loads.append(ChunkPlan(req_id, [digests[c] for c in objs], [marks[c] for c in objs],
                                            dst, None if whole else pos, group=g.index))
                if g in self._draft_groups:    # the drafter's pages of the same blocks, under its keys
                    meta.loads.append(ChunkPlan(req_id, [ddig[c] for c in objs], [marks[c] for c in objs],
                                                dst, None if whole else pos, group=g.index, drafter=True))
                loads += dst
        if loads:
            self._last_step_loads[req_id] = loads
            if cfg.loads_async:
                self._async_loading[req_id] = set(loads)
        elif cfg.loads_async:
            meta.failed_loads[req_id] = []

    def _plan_save(self, meta: AdpConnectorMetadata, scheduler_output: "SchedulerOutput", req_id: str,
                   request: "Request", st: _ReqState, before: int) -> None:
        """Chunks that are full once this step has run, per KV cache group."""
        cfg = self.cfg
        bpc = cfg.blocks_per_chunk
        n_sched, n_spec = _scheduled(scheduler_output, req_id)
        after = before + n_sched - n_spec
        if self._draft_groups:
            self._plan_draft_save(meta, req_id, request, st, before, after)
        reached = after // cfg.chunk_size
        if reached <= st.saved_chunks:
            return          # no chunk fills this step (most decode steps)
        full = min([reached, len(request.block_hashes) // cfg.hashes_per_chunk]
                   + [len(st.blocks(g)) // bpc for g in cfg.groups if not g.recurrent])
        if full <= st.saved_chunks:
            return
        digests = self._digests(request, full)
        marks = self._marks(digests)
        decode = before >= request.num_prompt_tokens
        for g in cfg.groups:
            if g.recurrent:
                continue      # states are saved as vLLM hands them off (``state_saves``)
            # sliding window: a chunk with a block vLLM may already have freed (before the
            # window at the start of this step) cannot be read any more: it is not saved
            c0 = max(st.saved_chunks, -(-skipped_blocks(g, cfg.block_size, before) // bpc))
            if full > c0:
                ids = st.blocks(g)[c0 * bpc: full * bpc]
                plan = ChunkPlan(req_id, digests[c0:full], marks[c0:full], ids, group=g.index)
                (meta.deferred_saves if decode else meta.saves).append(plan)
                st.had_saves = True
        for d in digests[st.saved_chunks:full]:
            self._saved[d] = None
            self._saved.move_to_end(d)
        while len(self._saved) > SAVED_KEPT:
            self._saved.popitem(last=False)
        st.saved_chunks = full

    def _plan_draft_save(self, meta: AdpConnectorMetadata, req_id: str, request: "Request", st: _ReqState,
                         before: int, after: int) -> None:
        """The drafter chunks whose last position this step's drafter pass computes and whose
        key exists now; saved from the drafter layers' own hook (``drafter.save_range``)."""
        cfg = self.cfg
        bpc = cfg.blocks_per_chunk
        n_keys = min([draft_key_count(len(request.block_hashes), cfg.hashes_per_chunk)]
                     + [len(st.blocks(g)) // bpc for g in self._draft_groups])
        c0, c1 = save_range(st.draft_saved, before, after, cfg.chunk_size, n_keys)
        st.draft_saved = max(st.draft_saved, after // cfg.chunk_size)
        if c1 <= c0:
            return
        ddig = self._draft_digests(request, c1)
        marks = self._marks(self._digests(request, c1))
        for g in self._draft_groups:
            meta.saves.append(ChunkPlan(req_id, ddig[c0:c1], marks[c0:c1], st.blocks(g)[c0 * bpc:c1 * bpc],
                                        group=g.index, drafter=True))
        st.had_saves = True

    def update_connector_output(self, connector_output) -> None:
        """Chunks whose load failed are saved again once vLLM has recomputed them."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            # an asynchronous load failed: vLLM recomputes the request from its start
            self._load_failed.add(req_id)
            self.choice.forget(req_id)
            st = self._reqs.get(req_id)
            if st is not None:
                st.saved_chunks = st.restored_chunks = st.draft_saved = 0
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        bpc = self.cfg.blocks_per_chunk
        for req_id in list(self._async_loading):
            if self._async_loading[req_id] & invalid:
                # an asynchronous load failed by block (0.26 to 0.29): vLLM recomputes the request from
                # its first failed block, and no second load is tried for it
                self._load_failed.add(req_id)
                self.choice.forget(req_id)
                st = self._reqs.get(req_id)
                if st is not None:
                    c = st.first_chunk_of(self._async_loading[req_id] & invalid, bpc)
                    st.saved_chunks = min(st.saved_chunks, c)
                    st.restored_chunks = min(st.restored_chunks, c)
                    st.draft_saved = min(st.draft_saved, c)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._async_loading.pop(req_id, None)
        if not invalid:
            return
        for req_id, dst in self._last_step_loads.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            bad = [b for b in dst if b in invalid]
            if bad:
                # the first chunk holding a failed block (and the ones after) must be saved again
                c = st.first_chunk_of(bad, bpc)
                st.saved_chunks = min(st.saved_chunks, c)
                st.draft_saved = min(st.draft_saved, c)

    # ------------------------------------------------------------------ end of a request
    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict]]:
        """True: vLLM keeps the request's blocks until the workers report it in
        ``get_finished`` (its pages are then in the ring)."""
        req_id = request.request_id
        if request.num_output_tokens > 0:
            self.choice.first_token(req_id)     # its first token came with its last output
        self.choice.forget(req_id)
        self._chosen.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._load_failed.discard(req_id)
        self._async_loading.pop(req_id, None)
        st = self._reqs.pop(req_id, None)
        return (st is not None and st.had_saves), None

    def shutdown(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
