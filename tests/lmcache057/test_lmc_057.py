"""What LMCache 0.5.7 added to the L2 adapter interface, on the adpkv adapter (real gateway).

- ``get_memory_tags()`` (abstract in 0.5.7: an adapter without it does not instantiate):
  ``MemoryTags(STORAGE, LOCAL)``, or ``REMOTE`` when the ``--l2-adapter`` spec says
  ``"shared": true`` (LMCache's own field, handed to the adapter as its storage manager does,
  ``set_backend_identity``); the prefetch controller's filter takes or leaves the adapter by them.
- ``submit_touch(keys)``: LMCache's eviction listeners learn of the access at once; no request
  goes to the gateway (its LRU counts reads), and the objects stay readable byte for byte.
"""

from __future__ import annotations

import argparse
import json

import pytest

from lmc_helpers import fresh_prefix, gateway_stats, load, make_key, make_obj, same_bytes, store


def _through_lmcaches_loader(port: int, **outer):
    """An adapter made the way ``lmcache server --l2-adapter '<spec>'`` makes it: LMCache's
    parser and plugin factory, then the backend identity its storage manager stamps."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = {"type": "plugin", "module_path": "adpkv_lmcache", "class_name": "AdpL2Adapter",
            "adapter_params": {"port": port, "namespace": "tags"}, **outer}
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    adapter = create_l2_adapter(cfg, l1_memory_desc=None)
    adapter.set_backend_identity("plugin", shared=cfg.shared)
    return adapter


@pytest.mark.parametrize("shared", [False, True])
def test_memory_tags_say_storage_local_or_shared(lmc_gateway, shared):
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags
    from lmcache.v1.distributed.storage_controllers.prefetch_controller import _tags_allowed

    from adpkv_lmcache import AdpL2Adapter

    adapter = _through_lmcaches_loader(lmc_gateway.port, **({"shared": True} if shared else {}))
    try:
        assert isinstance(adapter, AdpL2Adapter)
        residency = MemoryResidency.REMOTE if shared else MemoryResidency.LOCAL
        tags = adapter.get_memory_tags()
        assert tags == MemoryTags(MemorySegment.STORAGE, residency)
        # what a request restricted to local storage gets: this adapter only when not shared
        local_only = frozenset({MemoryTags(MemorySegment.STORAGE, MemoryResidency.LOCAL)})
        assert _tags_allowed(tags, local_only) is (not shared)
        assert _tags_allowed(tags, None)
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()


def test_touch_reaches_lmcaches_listeners_and_sends_nothing(lmc_gateway, adapter):
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    class Recorder(L2AdapterListener):
        def __init__(self):
            self.accessed = []

        def on_l2_keys_stored(self, keys, sizes):
            pass

        def on_l2_keys_accessed(self, keys):
            self.accessed.append(list(keys))

        def on_l2_keys_deleted(self, keys):
            pass

    prefix = fresh_prefix()
    keys = [make_key(i, prefix=prefix) for i in range(3)]
    objs = [make_obj(4096, seed=i) for i in range(3)]
    assert store(adapter, keys, objs).is_successful()
    rec = Recorder()
    adapter.register_listener(rec)
    data_requests = ("get_requests", "put_requests", "exist_requests", "get_region_requests")
    before = {k: gateway_stats(lmc_gateway.port)["counters"].get(k, 0) for k in data_requests}
    adapter.submit_touch(keys[:2])
    adapter.submit_touch([])
    assert rec.accessed == [keys[:2]]                  # synchronous: LMCache's LRU sees it at once
    after = {k: gateway_stats(lmc_gateway.port)["counters"].get(k, 0) for k in data_requests}
    assert after == before                             # no request went to the gateway
    out = [make_obj(4096, fill=0.0) for _ in range(3)]
    got = load(adapter, keys, out)
    assert got.popcount() == 3
    assert all(same_bytes(a, b) for a, b in zip(objs, out))
