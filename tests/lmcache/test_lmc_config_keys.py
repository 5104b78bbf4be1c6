"""Config parsing, LMCache's plugin loading path, version gate, key mapping and dialog marks."""

from __future__ import annotations

import argparse
import json

import pytest

from lmc_helpers import make_key


# ---------------------------------------------------------------------------- config
def test_config_defaults_and_help():
    from adpkv_lmcache import AdpL2AdapterConfig

    c = AdpL2AdapterConfig.from_dict({})
    assert (c.port, c.host, c.namespace, c.affinity_chunks) == (5557, "127.0.0.1", "lmcache", 1)
    h = AdpL2AdapterConfig.help()
    for name in ("port", "namespace", "key_namespace_from_model", "affinity_chunks",
                 "timeout_s", "LMC_ADPKV_AFFINITY_CHUNKS"):
        assert name in h


def test_config_values_and_coercion():
    from adpkv_lmcache import AdpL2AdapterConfig

    c = AdpL2AdapterConfig.from_dict({"type": "plugin", "port": "6000", "namespace": "llama-3-8b",
                                      "affinity_chunks": 4, "key_namespace_from_model": "true",
                                      "timeout_s": 2})
    assert (c.port, c.namespace, c.affinity_chunks, c.key_namespace_from_model, c.timeout_s) == \
        (6000, "llama-3-8b", 4, True, 2.0)


@pytest.mark.parametrize("bad", [{"port": 0}, {"port": 70000}, {"port": True}, {"port": "x"},
                                 {"affinity_chunks": 0}, {"namespace": 5}, {"timeout_s": -1},
                                 {"key_namespace_from_model": "maybe"}, {"prot": 5557},
                                 {"fragment_bytes": 131072}])
def test_config_rejects_bad_values(bad):
    from adpkv_lmcache import AdpL2AdapterConfig

    with pytest.raises(ValueError):
        AdpL2AdapterConfig.from_dict(bad)


@pytest.mark.parametrize("bad, says", [({"timeout_s": 0}, "timeout_s must be a number of seconds > 0"),
                                       ({"busy_wait_s": "-1"}, "busy_wait_s must be a number of seconds >= 0"),
                                       ({"heartbeat_s": True}, "heartbeat_s must be a number of seconds > 0"),
                                       ({"port": 5557.5}, "port must be an integer <= 65535"),
                                       ({"mark_cache_entries": "lots"}, "mark_cache_entries must be a number >= 0")])
def test_config_numbers_read_by_the_shared_parser(bad, says):
    """Every number of adapter_params goes through adpkv_core.settings.parse_number: its error
    names the field and what it must be."""
    from adpkv_lmcache import AdpL2AdapterConfig

    with pytest.raises(ValueError, match=says):
        AdpL2AdapterConfig.from_dict(bad)
    assert AdpL2AdapterConfig.from_dict({"port": "6001.0", "reconnect_s": "0"}).port == 6001


@pytest.mark.parametrize("name", ["key_namespace_from_model", "l1_direct"])
def test_config_refuses_a_misspelt_switch_naming_it(name):
    from adpkv_lmcache import AdpL2AdapterConfig

    with pytest.raises(ValueError, match=name):
        AdpL2AdapterConfig.from_dict({name: "ture"})
    assert getattr(AdpL2AdapterConfig.from_dict({name: "OFF"}), name) is False


def test_affinity_chunks_from_env(monkeypatch):
    from adpkv_lmcache import AdpL2AdapterConfig

    monkeypatch.setenv("LMC_ADPKV_AFFINITY_CHUNKS", "3")
    assert AdpL2AdapterConfig.from_dict({}).affinity_chunks == 3
    assert AdpL2AdapterConfig.from_dict({"affinity_chunks": 2}).affinity_chunks == 2   # params win
    monkeypatch.setenv("LMC_ADPKV_AFFINITY_CHUNKS", "three")
    with pytest.raises(ValueError):
        AdpL2AdapterConfig.from_dict({})


def test_loaded_through_lmcache_plugin_factory(lmc_gateway):
    """The exact path of `lmcache server --l2-adapter '{"type":"plugin",...}'`."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    from adpkv_lmcache import AdpL2Adapter

    spec = {"type": "plugin", "module_path": "adpkv_lmcache", "class_name": "AdpL2Adapter",
            "adapter_params": {"port": lmc_gateway.port, "namespace": "factory-test", "affinity_chunks": 2}}
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    adapter = create_l2_adapter(cfg.adapters[0], l1_memory_desc=None)
    try:
        assert isinstance(adapter, AdpL2Adapter)
        assert adapter._config.namespace == "factory-test"      # built via AdpL2AdapterConfig
        assert adapter._config.affinity_chunks == 2
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()


def test_bad_params_fail_in_lmcache_parser_with_help():
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = {"type": "plugin", "module_path": "adpkv_lmcache", "class_name": "AdpL2Adapter",
            "adapter_params": {"port": "not-a-port"}}
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    with pytest.raises(ValueError, match="port"):
        create_l2_adapter(cfg.adapters[0])


def test_version_gate():
    from adpkv_lmcache import LMCACHE_VERSION, check_lmcache_version

    assert LMCACHE_VERSION.startswith("0.5")
    for ok in ("0.5.0", "0.5.6", "0.5.10.post1"):
        assert check_lmcache_version(ok) == ok
    for bad in ("0.4.7", "0.4.1", "0.6.0", "1.0.0"):
        with pytest.raises(ImportError, match="lmcache >=0.5,<0.6"):
            check_lmcache_version(bad)


# ---------------------------------------------------------------------------- keys
def test_key_is_stable_across_processes():
    """Golden value: a restarted server must compute the same key (never change silently)."""
    from adpkv_lmcache.keys import KeyMapper

    k = make_key(b"\x01" * 32, model="meta-llama/Llama-3.1-8B", kv_rank=0x01000100, group=1, salt="tenant-a")
    assert KeyMapper("lmcache").key(k).hex() == \
        "01a839057e151f80cfe17b5752b84128ffa6c56268d44b655c000000"
    assert len(KeyMapper("x").key(k)) == 28


def test_key_fields_and_namespaces():
    from adpkv_lmcache.keys import KeyMapper

    m = KeyMapper("ns-a")
    base = make_key(7)
    variants = [make_key(8), make_key(7, model="m2"), make_key(7, kv_rank=3), make_key(7, group=2),
                make_key(7, salt="s")]
    keys = {m.key(k) for k in [base] + variants}
    assert len(keys) == 6
    assert KeyMapper("ns-b").key(base) != m.key(base)
    assert KeyMapper("").key(base) == KeyMapper("lmcache").key(base)   # empty = default namespace
    key = m.key(base)      # version:u8 | namespace id:8 | chunk digest:16 | layer:u16 | kind:u8
    assert (key[0], int.from_bytes(key[25:27], "big"), key[27]) == (1, 0, 0)
    # per-model namespaces
    pm = KeyMapper("ns-a", namespace_from_model=True)
    assert pm.key(base) != m.key(base)
    assert pm.keys([base, make_key(7, model="m2")]) == [pm.key(base), pm.key(make_key(7, model="m2"))]
    # changed meaning (adpkv_core.keys.key_namespace): LMCache gives the adapter no revision, KV dtype
    # or geometry, so with key_namespace_from_model the identity is unknown and every adapter gets a
    # new namespace (a cold cache, never a wrong hit); it was "<namespace>/model:<model_name>"
    assert KeyMapper("ns-a", namespace_from_model=True).key(base) != pm.key(base)


def test_dialog_marks_follow_the_prompt_and_are_remembered():
    from adpkv_lmcache.keys import KeyMapper, MarkBook

    m = KeyMapper()
    prompt = [make_key(i, prefix=b"P") for i in range(6)]
    other = [make_key(i, prefix=b"Q") for i in range(6)]
    book = MarkBook(affinity_chunks=2)
    marks = book.marks_for_lookup(prompt, m.keys(prompt))
    assert marks[0] != marks[1] and len(set(marks[1:])) == 1   # chunk 0 own mark, then the dialog's
    assert all(marks)
    # a later lookup of a longer prompt with the same start gives the same marks
    longer = prompt + [make_key(6, prefix=b"P")]
    assert book.marks_for_lookup(longer, m.keys(longer))[:6] == marks
    # stores/loads of those keys (any subset, any order) reuse the marks; unknown keys get 0
    sub = [prompt[4], other[0], prompt[2]]
    assert book.marks(m.keys(sub)) == [marks[4], 0, marks[2]]
    assert book.marks(m.keys(other)) is None
    # all object groups and TP slices of a dialog share its marks
    groups = prompt[:3] + [make_key(i, prefix=b"P", group=1) for i in range(3)]
    gm = book.marks_for_lookup(groups, m.keys(groups))
    assert gm[:3] == gm[3:] == marks[:3]


def test_mark_book_is_bounded():
    from adpkv_lmcache.keys import KeyMapper, MarkBook

    m = KeyMapper()
    book = MarkBook(affinity_chunks=1, max_entries=10)
    for j in range(5):
        ks = [make_key(i, prefix=bytes([j])) for i in range(4)]
        book.marks_for_lookup(ks, m.keys(ks))
    assert len(book) == 10
