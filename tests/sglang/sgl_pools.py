"""Real SGLang host pools on CPU for the adpkv_sglang tests (and the benchmark).

SGLang builds its host pools from the device pool's buffer description; on a CPU
machine the "device" buffers are CPU tensors of the same shapes (nothing else is
stood in: the host pools, their layouts, page metadata and flat-page helpers are
SGLang's own code).
"""

from __future__ import annotations

import contextlib
import os

import torch

from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYOUTS = ("page_first", "page_first_direct", "layer_first")
CPU = torch.device("cpu")


@contextlib.contextmanager
def _budget():
    # SGLang sizes host pools against free memory minus a 10 GiB reserve; on a small
    # test machine book the (small) test pools against a fixed budget instead.
    with host_memory_budget_scope(1 << 40):
        yield


def _ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout: str, layers: int = 4, heads: int = 2, head_dim: int = 16, page: int = 8,
             pages: int = 24, dtype=torch.bfloat16, allocator: str = "default") -> MHATokenToKVPoolHost:
    dev_tokens = 2 * page
    k = tuple(torch.zeros(dev_tokens + page, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens + page, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=dtype, device=CPU)
    with _budget():
        return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                    host_token_capacity=pages * page, allocator_type=allocator)


def mla_pool(layout: str, layers: int = 4, kv_lora_rank: int = 64, rope_dim: int = 16, page: int = 8,
             pages: int = 24, dtype=torch.bfloat16, allocator: str = "default") -> MLATokenToKVPoolHost:
    dim = kv_lora_rank + rope_dim
    dev_tokens = 2 * page
    bufs = tuple(torch.zeros(dev_tokens + page, 1, dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
                         device_layer_num=layers, page_size=page, kv_lora_rank=kv_lora_rank,
                         qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=dtype, device=CPU)
    with _budget():
        return MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers, host_token_capacity=pages * page,
                                    allocator_type=allocator)


def fill_random(pool, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(-1).view(torch.uint8) if pool.kv_buffer.is_contiguous() else None
    assert raw is not None
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool, first_token: int) -> bytes:
    """The page's bytes in SGLang's own flat-page format (get_data_page)."""
    return pool.get_data_page(first_token, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def storage_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   model_name: str = "test-model", layout: str = "page_first",
                   metrics: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=metrics,
                                is_page_first_layout=layout == "page_first",
                                model_name=model_name, extra_config=dict(extra))


def page_hashes(n: int, salt: str = "") -> list[str]:
    """Chained SHA-256 page hashes as SGLang computes them (its own helper)."""
    from sglang.srt.mem_cache.utils import get_hash_str
    tokens = [(i * 7 + len(salt) * 13 + sum(map(ord, salt))) % 32000 for i in range(n * 4)]
    return get_hash_str(tokens, None, page_size=4)


# ---------------------------------------------------------------------------- hybrid models' pools
def mamba_pool(slots: int = 24, layers: int = 3, heads: int = 4, head_dim: int = 8, state_dim: int = 8,
               conv_dim: int = 32, conv_width: int = 3, layout: str = "page_first", allocator: str = "default"):
    """SGLang's Mamba state host pool (one state a slot, page size 1), built from CPU "device"
    state buffers of a Qwen3-Next-like shape: temporal (heads x head_dim x state_dim, fp32) and
    one conv state (conv_dim x conv_width, bf16)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    dev_slots = 4
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, dev_slots, heads, head_dim, state_dim, dtype=torch.float32),
        conv=(torch.zeros(layers, dev_slots, conv_dim, conv_width, dtype=torch.bfloat16),))
    with _budget():
        return MambaPoolHost(info, slots / dev_slots, 0, device_capacity=dev_slots, pin_memory=False,
                             device="cpu", layout=layout, allocator_type=allocator)


def indexer_pool(anchor, index_bytes_per_token: int = 132, allocator: str = "default"):
    """SGLang's DSA indexer host pool beside an MLA anchor pool (same page indices). Its
    device pool (DSATokenToKVPool needs CUDA) is a stand-in holding the attributes the host
    pool reads: one uint8 index buffer per layer."""
    from types import SimpleNamespace
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo
    layers = anchor.layer_num
    dev = SimpleNamespace(store_dtype=torch.uint8, start_layer=0, end_layer=layers, layer_num=layers,
                          device="cpu", layer_shard_enabled=False,
                          index_k_with_scale_buffer=[torch.zeros(anchor.page_size, index_bytes_per_token,
                                                                 dtype=torch.uint8) for _ in range(layers)])
    decl = HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=dev, indices_from_pool=PoolName.KV,
                        layout_source=PoolName.KV, host_pool_builder=None,
                        storage_info=HostPoolStorageInfo(bytes_per_token_per_layer=index_bytes_per_token,
                                                         dtype=torch.uint8))
    with _budget():
        return DSAIndexerPoolHost(decl, anchor, pin_memory=False, device="cpu", allocator_type=allocator)


def host_group(**pools):
    """SGLang's HostPoolGroup of a hybrid model: ``kv=`` the anchor, then ``mamba=``, ``swa=``,
    ``indexer=``, ``draft=`` ... (SGLang's pool names)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    entries = [PoolEntry(name=PoolName(name), host_pool=p, device_pool=None, layer_mapper=lambda i: i,
                         is_primary_index_anchor=name == "kv") for name, p in pools.items()]
    return HostPoolGroup(entries)


def fill_pool_random(pool, seed: int) -> None:
    """Random bytes in every buffer of any host pool (``fill_random`` for one-buffer pools)."""
    g = torch.Generator().manual_seed(seed)
    bufs = [pool.temporal_buffer, *pool.conv_buffer] if hasattr(pool, "temporal_buffer") else \
        [pool.index_k_with_scale_buffer] if hasattr(pool, "index_k_with_scale_buffer") else [pool.kv_buffer]
    for b in bufs:
        raw = b.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def hybrid_controller(backend, group, zero_copy: bool, config=None):
    """SGLang's ``HybridCacheController`` for its storage methods (``_page_backup``,
    ``_storage_hit_query``, ``_page_transfer``), with ``backend`` attached to ``group``.
    Its ``__init__`` needs CUDA streams and a GPU device pool, so the object is made with
    ``__new__`` and given the attributes those methods read; ``zero_copy`` picks the KV page
    functions as SGLang does (``interface_v1`` and the zero-copy backends: batch_*_v1; the
    others: the generic path); ``config``: the storage config (default: the backend's)."""
    import queue
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    c = HybridCacheController.__new__(HybridCacheController)
    c.storage_backend = backend
    c.storage_backend_type = "dynamic"
    c.storage_config = config if config is not None else backend.storage_config
    c.mem_pool_host = group
    c.storage_host_pool = group.anchor_entry.host_pool
    c.page_size = group.page_size
    c.prefetch_sync_queue = queue.Queue()
    c.page_get_func = c._page_get_zero_copy if zero_copy else c._generic_page_get
    c.page_set_func = c._page_set_zero_copy if zero_copy else c._generic_page_set
    return c


def object_files(card_dir, key: bytes) -> list[str]:
    """The files of the fs card ``card_dir`` that hold fragments of the object ``key``."""
    out = []
    for d, _, names in os.walk(card_dir):      # the databases' object subdirectories (fs_files)
        if os.path.basename(os.path.dirname(d)).startswith("db"):
            out += [os.path.join(d, n) for n in names if n.startswith(key.hex())]
    return out
