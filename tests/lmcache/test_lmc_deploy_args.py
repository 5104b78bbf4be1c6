"""The LMCache server's command line in deploy/k8s/lmcache.yaml is real: LMCache's own `lmcache`
CLI parser takes it, LMCache's own L2 config parser turns its --l2-adapter into a plugin config,
and LMCache's plugin factory builds our AdpL2Adapter from it, attached to a real gateway started
with the pod's own gateway settings (only the card, the ports and the door's group swapped)."""

from __future__ import annotations

import argparse
import os
import pathlib

import yaml
from lmcache.cli.main import register_commands
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

from adpkv_gateway.ops.spawn import GatewayProcess, free_port
from adpkv_lmcache import AdpL2Adapter

MANIFEST = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "lmcache.yaml"


def parse_server_command(container: dict) -> argparse.Namespace:
    assert container["command"][0] == "lmcache"
    tokens = container["command"][1:] + container["args"]
    parser = argparse.ArgumentParser(prog="lmcache")
    register_commands(parser.add_subparsers(dest="command"), tokens)
    return parser.parse_args(tokens)


def test_lmcache_server_command_parses_and_builds_our_adapter_on_the_pods_gateway(tmp_path):
    objects = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    spec = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    settings = yaml.safe_load(next(d for d in objects if d["kind"] == "ConfigMap")["data"]["gateway.yaml"])
    server = next(c for c in spec["containers"] if c["name"] == "lmcache")
    args = parse_server_command(server)
    assert args.shm_name and args.supported_transfer_mode == "engine_driven"
    config = parse_args_to_l2_adapters_config(args).adapters[0]
    params = config.adapter_params
    assert params["port"] == settings["port"], "the adapter talks to the pod's gateway"
    # the pod's gateway settings, on this machine's card directory, ports and group
    port = free_port()
    settings.update(metrics_port=free_port(), control_socket_group=str(os.getgid()), shared_memory_size=64 << 20)
    del settings["storage_devices"], settings["port"]
    with GatewayProcess([str(tmp_path / "card")], port=port, log_path=str(tmp_path / "gw.log"), **settings):
        params["port"] = port
        adapter = create_l2_adapter(config, l1_memory_desc=None)
        try:
            assert isinstance(adapter, AdpL2Adapter) and adapter._config.namespace == "llama-3-8b"
            assert adapter.report_status()["is_healthy"]
        finally:
            adapter.close()
