"""SGLang's command line in deploy/k8s/sglang.yaml is real: SGLang's own ServerArgs parser takes
it (hierarchical cache, the dynamic storage backend, its extra config), and SGLang's own backend
factory loads our AdpHiCacheStorage from the extra config's module and class; the backend talks to
the port of the pod's gateway. Nothing is started (the model and a GPU are not here)."""

from __future__ import annotations

import argparse
import json
import pathlib

import yaml
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import ServerArgs

from adpkv_sglang import AdpHiCacheStorage

MANIFEST = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "sglang.yaml"


def test_sglang_command_parses_and_loads_our_backend_on_the_gateway_port():
    objects = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    spec = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    gateway = yaml.safe_load(next(d for d in objects if d["kind"] == "ConfigMap")["data"]["gateway.yaml"])
    container = next(c for c in spec["containers"] if c["name"] == "sglang")
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(container["args"])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert args.hicache_mem_layout == "page_first"          # what interface_v1's zero-copy calls need
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["port"] == gateway["port"] and extra["interface_v1"] == 1
    cls = StorageBackendFactory._load_backend_class(extra["module_path"], extra["class_name"], extra["backend_name"])
    assert cls is AdpHiCacheStorage


def test_a_wrong_option_is_caught():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        parser.parse_args(["--model-path=m", "--hicache-storage-backend-extra-confg={}"])
    except SystemExit:
        return
    raise AssertionError("SGLang's parser took an option it does not have")


def test_a_misspelt_setting_is_refused():
    """The deploy manifest's extra config (SGLang's own keys and ours) is taken; a misspelt key of
    ours, with or without ``adpkv.``, stops the backend naming the near miss (it was silently
    ignored: the server ran on port 5557 with no namespace)."""
    import pytest
    from sgl_pools import storage_config

    objects = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    spec = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = next(c for c in spec["containers"] if c["name"] == "sglang")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    extra = json.loads(parser.parse_args(container["args"]).hicache_storage_backend_extra_config)
    from adpkv_sglang.config import SglangSettings
    assert SglangSettings.from_storage_config(storage_config(extra)).client.port == extra["port"]
    for typo, meant in (("prot", "port"), ("namesapce", "namespace"), ("adpkv.namesapce", "adpkv.namespace"),
                        ("adpkv.skip_exsting", "adpkv.skip_existing")):
        with pytest.raises(ValueError) as err:
            AdpHiCacheStorage(storage_config({**extra, typo: 5590}))
        assert f"'{typo}' (did you mean '{meant}'?)" in str(err.value), str(err.value)
