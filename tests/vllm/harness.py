"""Drive vLLM's real ``Scheduler`` with ``AdpKVConnector`` on both sides, in one process.

The scheduler (and its scheduler-side connector) are vLLM's own classes; the
worker side is our connector's worker role with real CPU KV tensors of the
standardized ``[blocks, kv_heads, block_size, 2*head_dim]`` shape. There is no
model: ``Harness.step`` plays the model runner's part of the connector protocol
(bind, handle_preemptions, start_load_kv, per layer wait_for_layer_load / write
KV / save_kv_layer, wait_for_save, get_transfer_results (get_finished on vLLM 0.26, which has
no get_transfer_results), get_block_ids_with_load_errors) and writes into every computed slot a value that
depends on the whole token prefix, so a restore that puts wrong bytes (or the
right bytes in the wrong block) is caught by ``check_kv``.

``offloading=True``: the same with vLLM's own ``OffloadingConnector`` on both roles and
``AdpOffloadingSpec`` as its spec (``extra`` is then added to its extra config; a chunk is
``chunk_size`` tokens, vLLM's ``block_size`` key).
"""

from __future__ import annotations

import itertools
import time
import uuid

import torch

from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from adpkv_vllm.common.vllm_api import transfer_results_type
from adpkv_vllm.connector.connector import AdpKVConnector

init_none_hash(sha256)
_ids = itertools.count(1)
# vLLM 0.34's ModelRunnerOutput has no req_id_to_index (the index is the position in req_ids)
_HAS_REQ_INDEX = "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {})
HEADS, HEAD_DIM = 2, 64


def prefix_values(tokens: list[int]) -> list[float]:
    """A value per position that depends on every token up to it."""
    h, out = 7, []
    for t in tokens:
        h = (h * 1000003 + t + 1) % 2147483647
        out.append(h / 2147483647.0)
    return out


class Harness:
    """``groups``: the KV cache groups as ``[(layer names, vLLM spec), ...]`` (vLLM's own spec
    classes: ``SlidingWindowSpec``, ``MLAAttentionSpec`` ...); default one full-attention
    group of ``layers`` layers. A layer's KV tensor is ``[blocks, heads, block, 2*head]``, or
    ``[blocks, block, head]`` for MLA latent pages, as vLLM 0.32 lays them out."""

    def __init__(self, model_dir: str, port: int, namespace: str = "t", block_size: int = 32,
                 chunk_size: int = 64, num_blocks: int = 256, layers: int = 2,
                 max_batched: int = 512, extra: dict | None = None, groups: list | None = None,
                 worker_specs: dict | None = None, offloading: bool = False, cudagraph_mode: str | None = None,
                 async_scheduling: bool = False, hash_block_size: int | None = None):
        self.block_size = block_size
        # tokens per block hash where they are fewer than a block's (vLLM >= 0.33's
        # prefix_match_unit, a hybrid model's gcd); vLLM states it in the KV cache config
        self.hash_block_size = hash_block_size or block_size
        if groups is None:
            groups = [([f"model.layers.{i}.self_attn.attn" for i in range(layers)], FullAttentionSpec(
                block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32))]
        self.layer_names = [n for names, _ in groups for n in names]
        self.group_of = {n: gi for gi, (names, _) in enumerate(groups) for n in names}
        if offloading:
            conf = {"spec_name": "AdpOffloadingSpec", "spec_module_path": "adpkv_vllm", "block_size": chunk_size,
                    "adpkv.port": port, "adpkv.namespace": namespace, "adpkv.timeout_s": 2.0,
                    "adpkv.busy_wait_s": 5.0}
            connector = dict(kv_connector="OffloadingConnector")
        else:
            # every hit loaded: these tests check restores, not the choice (test_load_choice.py)
            conf = {"adpkv.port": port, "adpkv.namespace": namespace, "adpkv.chunk_size": chunk_size,
                    "adpkv.load_choice": "always",
                    "adpkv.timeout_s": 2.0, "adpkv.busy_wait_s": 5.0, "adpkv.lookup_wait_s": 2.0}
            connector = dict(kv_connector="AdpKVConnector", kv_connector_module_path="adpkv_vllm")
        conf.update(extra or {})
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                                     max_model_len=8192, seed=0),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                                             max_model_len=8192, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(**connector, kv_role="kv_both", engine_id=str(uuid.uuid4()),
                                                kv_connector_extra_config=conf),
            device_config=DeviceConfig("cpu"),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        if cudagraph_mode is not None:
            # the CUDA graph mode vLLM settled on (on a GPU; a CPU config says NONE): the
            # connectors read it when they are made, and ``forward`` replays as vLLM would
            from vllm.config import CUDAGraphMode
            self.vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
        self.full_graph_steps = 0      # steps ``forward`` ran as a FULL graph (no layer hook called)
        # vLLM's asynchronous scheduling (a GPU's default): the connectors read it when made
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups])
        hashes = {"hash_block_size": hash_block_size} if hash_block_size else {}
        for k, v in hashes.items():
            setattr(self.kv_cache_config, k, v)
        # the worker first, as in vLLM: its rank-0 client also serves the scheduler's lookups.
        # Its config may carry a group's per-layer specs (vLLM's UniformTypeKVCacheSpecs) where
        # the scheduler's has one representative spec, as in vLLM 0.32
        worker_groups = [(names, (worker_specs or {}).get(gi, spec)) for gi, (names, spec) in enumerate(groups)]
        worker_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in worker_groups])
        for k, v in hashes.items():
            setattr(worker_config, k, v)
        if offloading:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
            self.worker = OffloadingConnector(self.vllm_config, KVConnectorRole.WORKER, worker_config)
        else:
            self.worker = AdpKVConnector(self.vllm_config, KVConnectorRole.WORKER, worker_config)
        self.kv = {n: self._kv_tensor(getattr(spec, "kv_cache_specs", {}).get(n, spec), num_blocks)
                   for names, spec in worker_groups for n in names}
        self.register_kv_caches()
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=block_size, log_stats=True, **hashes)
        self.connector = self.scheduler.connector
        self.requests: dict[str, Request] = {}
        self.load_errors: list[set[int]] = []
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()    # asynchronous loads ended (several groups)
        self.failed_recving: set[str] = set()

    def register_kv_caches(self) -> None:
        """What the model runner does once the KV cache is allocated."""
        self.worker.register_kv_caches(self.kv)

    def _kv_tensor(self, spec, num_blocks: int) -> torch.Tensor:
        if isinstance(spec, MLAAttentionSpec):
            return torch.zeros(num_blocks, self.block_size, spec.head_size)
        return torch.zeros(num_blocks, spec.num_kv_heads, self.block_size, 2 * spec.head_size)

    # ------------------------------------------------------------------ requests
    def add(self, tokens: list[int], max_tokens: int = 2, salt: str | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=f"r{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=sp,
                      pooling_params=None, cache_salt=salt,
                      block_hasher=get_request_block_hasher(self.hash_block_size, sha256))
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        return req

    # ------------------------------------------------------------------ one engine step
    def step(self, corrupt_kv: bool = False):
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        kco = self.run_worker(so)
        self.load_errors.append(kco.invalid_block_ids)
        self.finished_sending |= kco.finished_sending or set()
        self.finished_recving |= kco.finished_recving or set()
        self.failed_recving |= getattr(kco, "failed_recving", None) or set()   # none on vLLM 0.26
        req_ids = list(so.num_scheduled_tokens)
        index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _HAS_REQ_INDEX else {}  # < 0.34
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[5] for _ in req_ids],
                                kv_connector_output=kco, **index)
        self.scheduler.update_from_output(so, out)
        return so, meta

    def run_worker(self, so) -> KVConnectorOutput:
        """The model runner's part of one step: the worker role's calls around the layers'
        hooks and the KV each layer writes, in the order vLLM's runners make them."""
        meta = so.kv_connector_metadata
        w = self.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        self.forward(so)
        w.wait_for_save()
        if transfer_results_type() is None:
            # vLLM 0.26's runner: get_finished (no get_transfer_results, no failed_recving)
            sending, recving = w.get_finished(so.finished_req_ids)
            failed: dict = {}
        else:
            res = w.get_transfer_results(so.finished_req_ids)
            sending, recving = res.finished_sending, res.finished_recving
            failed = {"failed_recving": res.failed_recving}
        errors = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta()     # the OffloadingConnector's finished jobs
        w.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                 invalid_block_ids=errors, kv_connector_worker_meta=worker_meta, **failed)

    def forward(self, so) -> None:
        """The pass: per layer what its attention op calls on the connector around its KV write.
        A step vLLM would replay as a FULL CUDA graph (the mode's decode or mixed batches; a
        uniform decode batch: every request computes one token) calls no layer hook: the
        attention reads what the blocks hold when the pass begins, checked here then."""
        w = self.worker
        mode = self.vllm_config.compilation_config.cudagraph_mode
        n = list(so.num_scheduled_tokens.values())
        uniform_decode = bool(n) and all(x == 1 for x in n)
        if n and (mode.mixed_mode().name == "FULL" or (uniform_decode and mode.decode_mode().name == "FULL")):
            self.full_graph_steps += 1
            for req_id, k in so.num_scheduled_tokens.items():
                req = self.requests[req_id]
                self.check_kv(req, req.num_computed_tokens - k)   # what the graph's attention reads
            for li, name in enumerate(self.layer_names):
                self._compute(so, li, name)
            return
        for li, name in enumerate(self.layer_names):
            w.wait_for_layer_load(name)
            self._compute(so, li, name)
            w.save_kv_layer(name, self.kv[name], object())

    def _compute(self, so, li: int, name: str) -> None:
        """Write this step's KV: every scheduled position gets its prefix value (+ layer)."""
        kv = self.kv[name]
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            start = req.num_computed_tokens - n   # schedule() has advanced it already
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[self.group_of[name]]
            vals = prefix_values(req.all_token_ids[: start + n])
            for p in range(start, start + n):
                kv[blocks[p // self.block_size]].select(-2, p % self.block_size) \
                    .fill_(vals[p] + li)

    def run(self, timeout_s: float = 30.0):
        """Step until every request is finished and its blocks are released."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError("requests did not finish")
            so, _ = self.step()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.002)     # only waiting for saves to leave the blocks

    def step_until_scheduled(self, req: Request, timeout_s: float = 30.0):
        """Step until ``req`` is scheduled (a model with several KV cache groups first waits,
        unscheduled, for its asynchronous load); returns (that step's output, the loads planned
        up to it)."""
        deadline, loads = time.monotonic() + timeout_s, []
        while True:
            assert time.monotonic() < deadline, "the request was never scheduled"
            so, meta = self.step()
            loads += meta.loads
            if req.request_id in so.num_scheduled_tokens:
                return so, loads
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.002)     # waiting for the load's GETs

    def step_until_computed(self, req: Request, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while req.num_computed_tokens < n:
            assert time.monotonic() < deadline, "the prompt was not computed"
            self.step()

    def check_kv(self, req: Request, upto: int) -> None:
        """Every position up to ``upto`` in every block the request holds (a sliding-window
        group's null blocks, before its window, hold nothing) has its prefix value."""
        all_blocks = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
        vals = prefix_values(req.all_token_ids[:upto])
        for li, name in enumerate(self.layer_names):
            kv, blocks = self.kv[name], all_blocks[self.group_of[name]]
            pos = [p for p in range(upto) if blocks[p // self.block_size] != 0]
            at = (lambda b, o: kv[b, 0, o, 0]) if kv.dim() == 4 else (lambda b, o: kv[b, o, 0])
            got = torch.stack([at(blocks[p // self.block_size], p % self.block_size) for p in pos])
            want = torch.tensor([vals[p] for p in pos]) + li
            bad = (got - want).abs() > 1e-6
            assert not bool(bad.any()), (
                f"layer {name}: wrong KV at positions {[pos[i] for i in bad.nonzero().flatten()[:10].tolist()]}")

    def close(self) -> None:
        self.worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
