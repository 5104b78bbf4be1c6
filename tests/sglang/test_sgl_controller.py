"""SGLang's own cache-controller storage code driving the backend.

``HiCacheController`` itself needs a GPU device pool and CUDA streams, so it cannot be built on a
CPU machine. Its storage methods (backup batch by batch, the prefetch hit query, the prefetch page
transfer) only use a few attributes of the controller: here they run unchanged, as SGLang's code,
on a stand-in object that holds those attributes (the backend, the real host pool, the page size, a
queue for the per-batch acks).
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

from sglang.srt.managers.cache_controller import HiCacheController as Controller
from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sgl_pools import fill_random, mha_pool, page_bytes, storage_config

from adpkv_gateway.ops import control


def controller_for(backend, pool):
    c = SimpleNamespace(storage_backend=backend, page_size=pool.page_size, storage_host_pool=pool,
                        mem_pool_host=pool, prefetch_sync_queue=queue.Queue(),
                        storage_config=backend.storage_config)
    c.page_set_func = lambda *a, **k: Controller._page_set_zero_copy(c, *a, **k)
    c.page_get_func = lambda *a, **k: Controller._page_get_zero_copy(c, *a, **k)
    c._page_transfer_kv_batch = lambda *a, **k: Controller._page_transfer_kv_batch(c, *a, **k)
    return c


def test_controller_backup_then_prefetch_over_several_batches(gateway, backends):
    pages = STORAGE_BATCH_SIZE + 72                    # two storage batches
    src = mha_pool("page_first", pages=pages + 4)
    fill_random(src, seed=40)
    P = src.page_size
    tokens = [(7 * i + 3) % 32000 for i in range(pages * P)]
    hashes = get_storage_hash_str(tokens, None, page_size=P)
    extra = {"port": gateway.port, "model_id": "tiny", "interface_v1": 1}
    writer = backends(storage_config(extra), src)
    c = controller_for(writer, src)
    stored = 150                                       # the server backs up a prefix first
    src_idx = src.alloc(pages * P)
    op = StorageOperation(src_idx[:stored * P], tokens[:stored * P], hash_value=hashes[:stored], prefix_keys=[])
    Controller._page_backup(c, op)
    assert op.completed_tokens == stored * P
    assert control.request(gateway.port, {"op": "STATS"})["stats"]["counters"]["put_requests"] == 2
    writer.close()

    # a restarted server: new backend, fresh pool; the prefetch path finds and loads the prefix
    dst = mha_pool("page_first", pages=pages + 4)
    reader = backends(storage_config(extra), dst)
    c = controller_for(reader, dst)
    pre = PrefetchOperation("req-1", tokens, last_hash=None, prefix_keys=[])
    hit_hashes, hit_tokens = Controller._storage_hit_query(c, pre)
    assert hit_tokens == stored * P and hit_hashes == hashes[:stored]
    pre.hash_value = hit_hashes
    pre.host_indices = dst.alloc(hit_tokens)
    assert Controller._page_transfer(c, pre) == stored
    acks = [c.prefetch_sync_queue.get_nowait() for _ in range(c.prefetch_sync_queue.qsize())]
    assert acks[-1].completed_tokens == stored * P
    for i in range(stored):
        assert page_bytes(dst, int(pre.host_indices[i * P])) == page_bytes(src, int(src_idx[i * P])), i
