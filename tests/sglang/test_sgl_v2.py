"""Storage v2 (hybrid models) against real SGLang host pools, driven by SGLang's own controller code.

The pools are SGLang's: ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (KV, SWA, draft),
``MambaPoolHost`` (Mamba states), ``DSAIndexerPoolHost`` (DSA indexer), grouped in SGLang's
``HostPoolGroup``. The calls are made by SGLang's ``HybridCacheController`` methods
(``_page_backup``, ``_storage_hit_query``, ``_page_transfer``: backup, hit query, prefetch with
its KV-derived and trailing sidecars, in SGLang's order and with its extra_info). What did not run:
the controller's ``__init__`` (it needs CUDA streams and a GPU device pool), so the controller object
is made with ``__new__`` and given the attributes those methods read; its threads, the rank
all-reduce of the hit query (``_sync_prefetch_hit_query``: one rank here) and the host<->GPU copies.
The DSA indexer pool's device pool (``DSATokenToKVPool`` needs CUDA) is a stand-in holding its
per-layer buffers (``sgl_pools.indexer_pool``).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sgl_pools import (fill_pool_random, host_group, hybrid_controller, indexer_pool, mamba_pool, mha_pool,
                       mla_pool, object_files, page_bytes, storage_config)

from adpkv_sglang.hitpolicy import PoolPresence, restorable

SWA_WINDOW = 3      # pages of the sliding window the SWA pool keeps


# ---------------------------------------------------------------------------- a hybrid model
MODELS = {
    # Qwen3-Next-like: full attention KV + one Mamba state per prefix
    "qwen3next": dict(mla=False, aux=("mamba",)),
    # gpt-oss / Gemma-like: full attention KV + sliding-window KV (the window's last pages)
    "swa": dict(mla=False, aux=("swa",)),
    # DeepSeek sparse attention: MLA latent KV + DSA indexer pages beside every KV page
    "dsa": dict(mla=True, aux=("indexer",)),
    # a hybrid with an MTP draft model: KV + draft KV beside every page + Mamba state
    "draft": dict(mla=False, aux=("draft", "mamba")),
}


def make_pools(model: str, layout: str, seed: int, pages: int = 40, allocator: str = "default"):
    """The host pools of ``model``; ``allocator="shm"``: in shared memory (SGLang's shm allocator)."""
    spec = MODELS[model]
    kv = (mla_pool if spec["mla"] else mha_pool)(layout, pages=pages, allocator=allocator)
    pools = {"kv": kv}
    for name in spec["aux"]:
        if name == "mamba":
            pools[name] = mamba_pool(slots=16, allocator=allocator)
        elif name == "swa":
            pools[name] = mha_pool(layout, layers=2, heads=1, pages=40, allocator=allocator)
        elif name == "indexer":
            pools[name] = indexer_pool(kv, allocator=allocator)
        elif name == "draft":
            pools[name] = mha_pool(layout, layers=1, pages=40, allocator=allocator)
    for i, p in enumerate(pools.values()):
        fill_pool_random(p, seed * 10 + i)
    return pools


def attach(backends, cfg, pools):
    """What HybridCacheController.attach_storage_backend does with the backend: the anchor pool,
    then every pool of the group through v2, then on_host_pools_registered."""
    group = host_group(**pools)
    b = backends(cfg)
    b.register_mem_pool_host(group.anchor_entry.host_pool)
    for entry in group.entries:
        b.register_mem_host_pool_v2(entry.host_pool, entry.name)
    b.on_host_pools_registered()
    return b, group


def controller(b, group) -> HybridCacheController:
    return hybrid_controller(b, group, zero_copy=True)


def tokens_for(n_pages: int, page: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 32000 for i in range(n_pages * page)]


class Backup:
    """One backup operation as the radix cache hands it to the controller (BACKUP_STORAGE)."""

    def __init__(self, pools, hashes, kv_idx, aux=None):
        self.transfers, self.aux_idx = [], {}
        page = pools["kv"].page_size
        for name in aux if aux is not None else [n for n in pools if n != "kv"]:
            p = pools[name]
            if name == "mamba":                       # one state, at the last page of the span
                idx = p.alloc(1)
                self.transfers.append(PoolTransfer(name=PoolName.MAMBA, host_indices=idx, keys=[hashes[-1]],
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES))
            elif name == "swa":                       # the window's last pages
                w = min(SWA_WINDOW, len(hashes))
                idx = p.alloc(w * page)
                self.transfers.append(PoolTransfer(name=PoolName.SWA, host_indices=idx, keys=hashes[-w:],
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES))
            else:                                     # beside the KV pages: KV's indices and hashes
                idx = kv_idx
                self.transfers.append(PoolTransfer(name=PoolName(name), indices_from_pool=PoolName.KV))
            self.aux_idx[name] = idx


def backup(c, pools, tokens, prefix_hash=None, prefix_keys=None, aux=None):
    """Back up ``tokens`` (after ``prefix_hash``) with SGLang's controller; returns what was stored."""
    page = pools["kv"].page_size
    hashes = get_storage_hash_str(tokens, prefix_hash, page_size=page)
    kv_idx = pools["kv"].alloc(len(hashes) * page)
    plan = Backup(pools, hashes, kv_idx, aux)
    op = StorageOperation(kv_idx, tokens, hash_value=hashes, prefix_keys=prefix_keys,
                          pool_transfers=plan.transfers)
    c._page_backup(op)
    if c.storage_config.is_storage_writer:
        assert op.completed_tokens == len(tokens), "the KV pages were not all stored"
    return SimpleNamespace(hashes=hashes, kv_idx=kv_idx, aux_idx=plan.aux_idx, op=op)


def prefetch(c, pools, tokens, names=None, prefix_keys=None):
    """SGLang's prefetch of ``tokens``: hit query, host allocation, transfer (KV batches with their
    KV-derived pools, then the trailing pools). Returns the hit, the acks and the host indices."""
    page = pools["kv"].page_size
    names = [n for n in pools if n != "kv"] if names is None else names
    transfers = []
    for name in names:
        if name == "mamba":
            transfers.append(PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES))
        elif name == "swa":
            transfers.append(PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * SWA_WINDOW,
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES))
        else:
            transfers.append(PoolTransfer(name=PoolName(name), indices_from_pool=PoolName.KV))
    op = PrefetchOperation(CacheRequestHandle(rid="req", attempt_id=0), tokens, prefix_keys=prefix_keys,
                           pool_transfers=transfers)
    hit_hashes, hit_tokens = c._storage_hit_query(op)
    out = SimpleNamespace(hit_pages=hit_tokens // page, restorable=op.pool_storage_result.restorable_prefix_pages,
                          query_pool_hits=dict(op.query_pool_hit_pages), aux_idx={}, acks=[], kv_idx=None,
                          completed_pages=0, pool_hits={})
    if not hit_tokens:
        return out
    op.hash_value = hit_hashes
    op.host_indices = out.kv_idx = pools["kv"].alloc(hit_tokens)
    for t in transfers:                                   # staging for the trailing pools
        if t.name == PoolName.MAMBA:
            t.host_indices = out.aux_idx["mamba"] = pools["mamba"].alloc(1)
        elif t.name == PoolName.SWA:
            w = min(SWA_WINDOW, out.hit_pages)
            t.host_indices = out.aux_idx["swa"] = pools["swa"].alloc(w * page)
    c._page_transfer(op)
    while not c.prefetch_sync_queue.empty():
        out.acks.append(c.prefetch_sync_queue.get_nowait())
    out.completed_pages = max((a.completed_tokens or 0 for a in out.acks), default=0) // page
    out.pool_hits = {str(k): v for a in out.acks for k, v in (getattr(a, "pool_hits", None) or {}).items()}
    return out


def pages_of(pool, idx, n=None):
    p = pool.page_size
    n = len(idx) // p if n is None else n
    return [page_bytes(pool, int(idx[i * p])) for i in range(n)]


def cfg_for(gw, model, **extra):
    return storage_config({"port": gw.port, "model_id": f"tiny-{model}", "interface_v1": 1, **extra},
                          mla=MODELS[model]["mla"])


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("model", list(MODELS))
def test_hybrid_prefix_restores_byte_exact_after_new_instance_and_gateway_restart(start_gateway, backends,
                                                                                  model, layout):
    # (DSA indexer pages in layer_first have no page metadata: they move as SGLang's flat data pages)
    gw = start_gateway()
    src = make_pools(model, layout, seed=1)
    w, group = attach(backends, cfg_for(gw, model), src)
    n = 20
    tokens = tokens_for(n, src["kv"].page_size)
    stored = backup(controller(w, group), src, tokens)
    w.close()
    gw.restart(hard=True)                                  # kill -9, a new gateway process on the same card

    dst = make_pools(model, layout, seed=2)                 # other bytes everywhere
    r, group = attach(backends, cfg_for(gw, model), dst)
    got = prefetch(controller(r, group), dst, tokens)
    assert got.hit_pages == n and got.restorable[-1] == n
    assert got.completed_pages == n
    assert pages_of(dst["kv"], got.kv_idx) == pages_of(src["kv"], stored.kv_idx)
    for name in MODELS[model]["aux"]:
        if name in ("mamba", "swa"):
            assert pages_of(dst[name], got.aux_idx[name]) == pages_of(src[name], stored.aux_idx[name]), name
            assert got.pool_hits[name] == len(stored.aux_idx[name]) // dst[name].page_size
        else:                                              # beside the KV pages, at KV's indices
            assert pages_of(dst[name], got.kv_idx) == pages_of(src[name], stored.kv_idx), name


def test_missing_mamba_state_gives_the_shorter_prefix(gateway, backends):
    pools = make_pools("qwen3next", "page_first", seed=3)
    b, group = attach(backends, cfg_for(gateway, "qwen3next"), pools)
    c = controller(b, group)
    P = pools["kv"].page_size
    first = tokens_for(6, P)
    more = tokens_for(5, P, salt=11)
    a = backup(c, pools, first)                             # pages 0..5, state at page 5
    backup(c, pools, more, prefix_hash=a.hashes[-1], aux=[])   # pages 6..10, their state lost
    b.close()
    dst = make_pools("qwen3next", "page_first", seed=4)
    r, group = attach(backends, cfg_for(gateway, "qwen3next"), dst)
    got = prefetch(controller(r, group), dst, first + more)
    assert got.query_pool_hits[PoolName.KV] == 11          # the KV pages are all there
    assert got.hit_pages == 6 and got.restorable == [6]    # but only a prefix with its state is usable
    assert got.completed_pages == 6 and got.pool_hits["mamba"] == 1
    assert pages_of(dst["mamba"], got.aux_idx["mamba"]) == pages_of(pools["mamba"], a.aux_idx["mamba"])


def test_trailing_window_makes_five_pages_restorable_while_four_are_not(gateway, backends):
    pools = make_pools("swa", "page_first", seed=5)
    b, group = attach(backends, cfg_for(gateway, "swa"), pools)
    c = controller(b, group)
    P = pools["kv"].page_size
    head, tail = tokens_for(2, P), tokens_for(3, P, salt=5)
    h = backup(c, pools, head, aux=[])                      # pages 0..1 without SWA pages
    backup(c, pools, tail, prefix_hash=h.hashes[-1])         # pages 2..4 with their SWA pages
    res = b.batch_exists_v2(h.hashes + get_storage_hash_str(tail, h.hashes[-1], page_size=P),
                            [PoolTransfer(name=PoolName.SWA, keys=["x"] * SWA_WINDOW,
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert res.kv_hit_pages == 5 and res.restorable_prefix_pages == [5]


# ---------------------------------------------------------------------------- never a mixed group
@pytest.mark.parametrize("cards", [1, 3])
def test_a_state_from_another_write_is_never_restored_with_this_kv(start_gateway, tmp_path, backends, cards):
    """Two writes of the same prefix with different bytes (two servers, or a server and its
    restart). B's server dies between its sidecars (batch_set_v2) and its KV pages
    (batch_set_v1); then A backs the prefix up whole. Objects are never overwritten (a key names
    its content), so the card holds B's Mamba state and A's KV pages: they are not restored
    together (the state is reported not loaded, the usable prefix shrinks) and the stale state
    is dropped; the next backup stores the group whole and it restores, with one write's bytes.
    With 3 cards and SGLang's prefix keys, objects are placed by dialog mark (the drop finds them)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    gateway = start_gateway(card_dirs=[str(tmp_path / f"c{i}") for i in range(cards)])
    prefix = [] if cards > 1 else None                  # hicache_storage_pass_prefix_keys on / off
    P = 8
    tokens = tokens_for(4, P)
    hashes = get_storage_hash_str(tokens, None, page_size=P)
    src = {w: make_pools("qwen3next", "page_first", seed) for w, seed in (("A", 6), ("B", 7), ("C", 8))}

    extra = {} if prefix is None else {"prefix_keys": True}

    def server(who):
        b, group = attach(backends, cfg_for(gateway, "qwen3next", **extra), src[who])
        return b, controller(b, group)

    B, _ = server("B")
    b_kv = src["B"]["kv"].alloc(len(hashes) * P)
    info = HiCacheStorageExtraInfo(prefix_keys=None if prefix is None else hashes[:-1])   # as the controller
    assert all(B.batch_set_v2(Backup(src["B"], hashes, b_kv).transfers, info)[PoolName.MAMBA])
    B.close()                                                       # ... and B's KV never comes
    A, ca = server("A")
    a = backup(ca, src["A"], tokens, prefix_keys=prefix)
    A.close()

    def restore(seed):
        dst = make_pools("qwen3next", "page_first", seed)
        r, group = attach(backends, cfg_for(gateway, "qwen3next", **extra), dst)
        got = prefetch(controller(r, group), dst, tokens, prefix_keys=prefix)
        got.counters = dict(r.counters)
        r.close()
        return dst, got

    dst, got = restore(9)
    assert got.hit_pages == 4 and got.completed_pages == 4          # every object is stored ...
    assert pages_of(dst["kv"], got.kv_idx) == pages_of(src["A"]["kv"], a.kv_idx)
    assert got.pool_hits.get("mamba", 0) == 0, "B's state must not be restored with A's KV pages"
    assert got.counters["groups_rejected"] == 1

    C, cc = server("C")                                             # the next backup of the prefix
    c = backup(cc, src["C"], tokens, prefix_keys=prefix)
    assert C.counters["pages_rewritten"] == 1                       # the KV page the state closes
    C.close()
    dst, got = restore(10)
    assert got.completed_pages == 4 and got.pool_hits["mamba"] == 1
    assert pages_of(dst["mamba"], got.aux_idx["mamba"]) == pages_of(src["C"]["mamba"], c.aux_idx["mamba"])
    kv = pages_of(dst["kv"], got.kv_idx)
    assert kv[:3] == pages_of(src["A"]["kv"], a.kv_idx)[:3]          # KV pages: content-addressed
    assert kv[3] == pages_of(src["C"]["kv"], c.kv_idx)[3]            # the state's own page: its write


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_corrupt_or_missing_aux_pages_shrink_the_hit_never_wrong_bytes(gateway, backends, damage):
    pools = make_pools("draft", "page_first", seed=12)
    b, group = attach(backends, cfg_for(gateway, "draft"), pools)
    P = pools["kv"].page_size
    tokens = tokens_for(6, P)
    stored = backup(controller(b, group), pools, tokens)
    b.close()
    bad_page = 3                                            # the draft page beside KV page 3
    key = b.pools["draft"].storage_keys([stored.hashes[bad_page]])[0]
    files = object_files(gateway.card_dirs[0], key)
    assert files, "the draft page's object file"
    for f in files:
        if damage == "missing":
            os.unlink(f)
        else:
            with open(f, "r+b") as fh:
                fh.seek(os.path.getsize(f) - 40)
                fh.write(b"\xff" * 8)
    dst = make_pools("draft", "page_first", seed=13)
    r, group = attach(backends, cfg_for(gateway, "draft"), dst)
    untouched = pages_of(dst["draft"], torch.arange(0, dst["draft"].size))
    got = prefetch(controller(r, group), dst, tokens, names=["draft"])
    # the hit query may still count the page (the gateway's index); the load stops before it
    assert got.hit_pages in (bad_page, 6)
    assert got.completed_pages == bad_page
    n = bad_page
    assert pages_of(dst["kv"], got.kv_idx, n) == pages_of(pools["kv"], stored.kv_idx, n)
    assert pages_of(dst["draft"], got.kv_idx, n) == pages_of(pools["draft"], stored.kv_idx, n)
    if damage == "missing":                                 # a miss never writes into the pool
        bad = int(got.kv_idx[bad_page * P])
        assert page_bytes(dst["draft"], bad) == untouched[bad // P]


# ---------------------------------------------------------------------------- keys: pools, ranks, namespaces
def test_namespaces_and_ranks_never_see_each_others_pages(gateway, backends):
    pools = make_pools("qwen3next", "page_first", seed=20)
    b, group = attach(backends, cfg_for(gateway, "qwen3next"), pools)
    P = pools["kv"].page_size
    tokens = tokens_for(5, P)
    stored = backup(controller(b, group), pools, tokens)
    mamba = [PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert b.batch_exists_v2(stored.hashes, mamba).kv_hit_pages == 5
    b.close()
    for other in (dict(model_id="other"), dict(namespace="tenant-b")):
        o, _ = attach(backends, cfg_for(gateway, "qwen3next", **other), make_pools("qwen3next", "page_first", 21))
        res = o.batch_exists_v2(stored.hashes, mamba)
        assert res.kv_hit_pages == 0 and res.extra_pool_hit_pages == {}, other
        assert o.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=stored.hashes[-1:],
                                            host_indices=torch.tensor([0]))]) == {PoolName.MAMBA: [False]}
        o.close()
    # TP rank 1 of the same model: its own heads and its own Mamba shard, nothing of rank 0
    cfg1 = storage_config({"port": gateway.port, "model_id": "tiny-qwen3next", "interface_v1": 1},
                          tp_rank=1, tp_size=2)
    cfg0 = storage_config({"port": gateway.port, "model_id": "tiny-qwen3next", "interface_v1": 1},
                          tp_rank=0, tp_size=2)
    r0, _ = attach(backends, cfg0, make_pools("qwen3next", "page_first", 22))
    r1, _ = attach(backends, cfg1, make_pools("qwen3next", "page_first", 23))
    k0 = r0.pools["mamba"].storage_keys(["h"])[0]
    k1 = r1.pools["mamba"].storage_keys(["h"])[0]
    assert k0 != k1 and r0.kv.storage_keys(["h"]) != r1.kv.storage_keys(["h"])
    # the KV pool and the Mamba pool of one rank never share a key for the same page hash
    assert b.kv.storage_keys(["h"]) != b.pools["mamba"].storage_keys(["h"])


def test_mla_indexer_is_stored_once_and_read_by_every_rank(gateway, backends):
    """DSA: the MLA latent page and its indexer page are the same on every TP rank: the storage
    writer stores them once, the other rank sends nothing, both read the writer's bytes."""
    cfgs = [storage_config({"port": gateway.port, "model_id": "tiny-dsa", "interface_v1": 1}, mla=True,
                           tp_rank=rk, tp_size=2) for rk in range(2)]
    src = [make_pools("dsa", "page_first", seed=30 + rk) for rk in range(2)]
    ranks = [attach(backends, cfgs[rk], src[rk]) for rk in range(2)]
    P = src[0]["kv"].page_size
    tokens = tokens_for(4, P)
    out = [backup(controller(b, g), src[rk], tokens) for rk, (b, g) in enumerate(ranks)]
    stats = ranks[0][0].gateway_stats()
    assert stats is not None and stats.objects["stored"] == 2 * 4  # 4 latent + 4 indexer pages, once
    for b, _ in ranks:
        b.close()
    for rk in range(2):
        dst = make_pools("dsa", "page_first", seed=40 + rk)
        b, g = attach(backends, cfgs[rk], dst)
        got = prefetch(controller(b, g), dst, tokens)
        assert got.completed_pages == 4
        assert pages_of(dst["kv"], got.kv_idx) == pages_of(src[0]["kv"], out[0].kv_idx)
        assert pages_of(dst["indexer"], got.kv_idx) == pages_of(src[0]["indexer"], out[0].kv_idx)


# ---------------------------------------------------------------------------- hit policies
def test_hit_policies_as_sglang_documents_them():
    T, F = True, False
    trailing = PoolPresence(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, [F, F, T, T, T, F], window=3)
    res = restorable([T] * 6, [trailing])
    assert res.kv_hit_pages == 5 and res.restorable_prefix_pages == [5]     # 5 restorable, 4 not
    state = PoolPresence(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, [F, T, F, T, F, F])
    assert restorable([T] * 6, [state]).restorable_prefix_pages == [2, 4]
    every = PoolPresence(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES, [T, T, F, T])
    res = restorable([T, T, T, T], [every])
    assert res.kv_hit_pages == 2 and res.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.INDEXER: 2}
    assert restorable([T, F, T], [every]).kv_hit_pages == 1                 # KV's own prefix first
    blocks = PoolPresence("deepseek_v4_c4", PoolHitPolicy.BLOCK_GROUPS, [T, T, T, F, T, T],
                          block_pages=4, group_pages=2)
    res = restorable([T] * 8, [blocks])                   # one complete group: its block's pages
    assert res.kv_hit_pages == 8 and res.extra_pool_hit_pages["deepseek_v4_c4"] == 4
    assert restorable([F, T], [state]).kv_hit_pages == 0


def test_hybrid_without_interface_v1_uses_the_generic_kv_path(gateway, backends):
    """SGLang without ``interface_v1``: KV pages through the generic path (flat pages, no stamps),
    the Mamba state through v2; the prefix restores byte for byte."""
    src = make_pools("qwen3next", "page_first", seed=50)
    cfg = storage_config({"port": gateway.port, "model_id": "tiny-qwen3next"})
    w, group = attach(backends, cfg, src)
    assert not w.kv.stamped
    tokens = tokens_for(6, src["kv"].page_size)
    c = hybrid_controller(w, group, zero_copy=False)
    stored = backup(c, src, tokens)
    w.close()
    dst = make_pools("qwen3next", "page_first", seed=51)
    r, group = attach(backends, cfg, dst)
    got = prefetch(hybrid_controller(r, group, zero_copy=False), dst, tokens)
    assert got.hit_pages == 6 and got.completed_pages == 6 and got.pool_hits["mamba"] == 1
    assert pages_of(dst["kv"], got.kv_idx) == pages_of(src["kv"], stored.kv_idx)
    assert pages_of(dst["mamba"], got.aux_idx["mamba"]) == pages_of(src["mamba"], stored.aux_idx["mamba"])


def test_v2_without_a_gateway_and_with_bad_indices_never_raises(gateway, backends):
    """The cache never stops the engine: no gateway means misses and failed sets; bad host indices
    or an unregistered pool fail that pool's pages only, and nothing is written into the pools."""
    from adpkv_gateway.ops.spawn import free_port
    pools = make_pools("qwen3next", "page_first", seed=60)
    down = storage_config({"port": free_port(), "model_id": "m", "interface_v1": 1, "connect_timeout_s": 0.5,
                           "reconnect_s": 0})
    b, _ = attach(backends, down, pools)
    hashes = get_storage_hash_str(tokens_for(3, 8), None, page_size=8)
    state = PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:], host_indices=torch.tensor([1]),
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
    before = pools["mamba"].get_data_page(1).clone()
    res = b.batch_exists_v2(hashes, [state])
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    assert b.batch_set_v2([state]) == {PoolName.MAMBA: [False]}
    assert b.batch_get_v2([state]) == {PoolName.MAMBA: [False]}
    assert torch.equal(pools["mamba"].get_data_page(1), before)
    b.close()

    up, _ = attach(backends, cfg_for(gateway, "qwen3next"), pools)
    outside = PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:], host_indices=torch.tensor([10 ** 6]),
                           hit_policy=PoolHitPolicy.TRAILING_PAGES)
    two_for_one = PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:], host_indices=torch.tensor([1, 2]),
                               hit_policy=PoolHitPolicy.TRAILING_PAGES)
    unknown = PoolTransfer(name=PoolName.INDEXER, keys=hashes, host_indices=torch.arange(0, 24))
    got = up.batch_set_v2([outside])
    assert got == {PoolName.MAMBA: [False]}
    assert up.batch_set_v2([two_for_one, unknown]) == {PoolName.MAMBA: [False], PoolName.INDEXER: [False] * 3}
    assert up.batch_get_v2([outside, unknown]) == {PoolName.MAMBA: [False], PoolName.INDEXER: [False] * 3}
    assert up.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=[])]) == {PoolName.MAMBA: []}
    assert up.gateway_stats().objects.get("stored", 0) == 0
    assert all(up.batch_set_v1(hashes, pools["kv"].alloc(3 * 8)))
    assert up.batch_exists_v2(hashes, []).kv_hit_pages == 3
    assert up.batch_exists_v2(hashes, [unknown]).kv_hit_pages == 0   # a pool never registered: not usable


def test_kv_pages_handed_over_as_a_v2_pool_take_the_v1_path(gateway, backends):
    pools = make_pools("qwen3next", "page_first", seed=70)
    b, _ = attach(backends, cfg_for(gateway, "qwen3next"), pools)
    P = pools["kv"].page_size
    hashes = get_storage_hash_str(tokens_for(4, P), None, page_size=P)
    src = pools["kv"].alloc(4 * P)
    assert b.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=hashes, host_indices=src)]) == {PoolName.KV: [True] * 4}
    assert b.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.KV, keys=hashes)]).kv_hit_pages == 4
    assert b.batch_exists(hashes) == 4
    dst = pools["kv"].alloc(4 * P)
    assert b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=hashes, host_indices=dst)]) == {PoolName.KV: [True] * 4}
    assert pages_of(pools["kv"], dst) == pages_of(pools["kv"], src)


def test_backup_and_prefetch_race_on_an_evicting_card_never_restore_wrong_bytes(start_gateway, backends):
    """SGLang's backup thread stores page groups while its prefetch thread restores earlier ones,
    on a card small enough to evict while they run: every restore is a byte-exact prefix of what
    was stored, and a state is only restored with its whole prefix."""
    import random
    import threading

    P, n, groups_n = 8, 6, 10
    pools = make_pools("qwen3next", "page_first", seed=80, pages=80)
    kv_page = len(page_bytes(pools["kv"], 0)) + 16
    state = pools["mamba"].get_data_page(0).numel() + 16
    gw = start_gateway(capacity_bytes=6 * (n * kv_page + state) + (64 << 10), eviction_ratio=0.3)
    b, group = attach(backends, cfg_for(gw, "qwen3next"), pools)
    writer, reader = controller(b, group), controller(b, group)
    spans = [tokens_for(n, P, salt=1000 * g) for g in range(groups_n)]
    stored: dict[int, SimpleNamespace] = {}
    failures: list[str] = []
    done = threading.Event()

    def backup_thread():
        try:
            for g, tok in enumerate(spans):
                stored[g] = backup(writer, pools, tok)
        except Exception as exc:                      # reported by the main thread
            failures.append(f"backup: {exc!r}")
        finally:
            done.set()

    checked = {"full": 0, "partial": 0, "none": 0}

    def prefetch_thread():
        rnd = random.Random(1)
        try:
            while not done.is_set() or sum(checked.values()) < 12:
                if not stored:
                    done.wait(0.01)
                    continue
                g = rnd.choice(list(stored))
                got = prefetch(reader, pools, spans[g])
                k = got.completed_pages if got.hit_pages else 0
                src = stored[g]
                if k and pages_of(pools["kv"], got.kv_idx, k) != pages_of(pools["kv"], src.kv_idx, k):
                    failures.append(f"group {g}: KV pages differ")
                if got.pool_hits.get("mamba"):
                    if k != n:
                        failures.append(f"group {g}: a state restored with {k} of {n} pages")
                    elif pages_of(pools["mamba"], got.aux_idx["mamba"]) != \
                            pages_of(pools["mamba"], src.aux_idx["mamba"]):
                        failures.append(f"group {g}: the state differs")
                checked["full" if k == n else "partial" if k else "none"] += 1
                if got.kv_idx is not None:                # give the host slots back
                    pools["kv"].free(got.kv_idx)
                if "mamba" in got.aux_idx:
                    pools["mamba"].free(got.aux_idx["mamba"])
        except Exception as exc:
            failures.append(f"prefetch: {exc!r}")

    threads = [threading.Thread(target=backup_thread), threading.Thread(target=prefetch_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not failures, failures
    assert checked["full"] > 0, checked
    still = [b.batch_exists(stored[g].hashes) for g in range(groups_n)]
    assert min(still) < n, f"the card should have evicted ({still})"


def test_same_backend_restores_hybrid_groups_after_the_gateway_is_killed(start_gateway, backends):
    """kill -9 of the gateway: the v2 calls miss (never raise) until the backend re-attached by
    itself; then the same instance restores the page groups it stored before."""
    import time

    gw = start_gateway(engine_timeout_s=1)
    pools = make_pools("qwen3next", "page_first", seed=90)
    cfg = cfg_for(gw, "qwen3next", timeout_s=1.5, reconnect_s=0.2, connect_timeout_s=1.0)
    b, group = attach(backends, cfg, pools)
    c = controller(b, group)
    P = pools["kv"].page_size
    tokens = tokens_for(5, P)
    stored = backup(c, pools, tokens)
    gw.restart(hard=True)
    mamba = [PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    deadline = time.monotonic() + 20
    while b.batch_exists_v2(stored.hashes, mamba).kv_hit_pages != 5:
        assert time.monotonic() < deadline, "the backend did not come back"
        time.sleep(0.1)                                   # polling with a deadline
    got = prefetch(c, pools, tokens)
    assert got.completed_pages == 5 and got.pool_hits["mamba"] == 1
    assert pages_of(pools["kv"], got.kv_idx) == pages_of(pools["kv"], stored.kv_idx)
    assert pages_of(pools["mamba"], got.aux_idx["mamba"]) == pages_of(pools["mamba"], stored.aux_idx["mamba"])


def test_root_hit_query_of_the_hybrid_controller_finds_pages_placed_by_dialog_mark(start_gateway, tmp_path, backends):
    """With prefix keys on (several cards, objects placed by dialog mark) SGLang's hybrid
    controller queries a prefix at the root without prefix keys (it drops the empty list) while
    its backup passed []: with ``prefix_keys`` set the first query finds the group; without it,
    once any call brought prefix keys."""
    gw = start_gateway(card_dirs=[str(tmp_path / f"c{i}") for i in range(3)])
    P = 8
    spans = [tokens_for(4, P, salt=100 * i) for i in range(3)]
    src = make_pools("qwen3next", "page_first", seed=95)
    w, group = attach(backends, cfg_for(gw, "qwen3next", prefix_keys=True), src)
    for tok in spans:
        backup(controller(w, group), src, tok, prefix_keys=[])
    w.close()
    for setting, expect_first in ((True, 4), (False, None)):
        dst = make_pools("qwen3next", "page_first", seed=96)
        r, group = attach(backends, cfg_for(gw, "qwen3next", prefix_keys=setting), dst)
        c = controller(r, group)
        first = prefetch(c, dst, spans[0], prefix_keys=[])
        if expect_first is not None:
            assert first.hit_pages == expect_first and first.pool_hits["mamba"] == 1
        backup(c, dst, tokens_for(2, P, salt=999), prefix_keys=[])   # a call with prefix keys
        got = prefetch(c, dst, spans[1], prefix_keys=[])
        assert got.hit_pages == 4 and got.completed_pages == 4 and got.pool_hits["mamba"] == 1
        r.close()
