"""The vLLM command lines of deploy/k8s/ (vllm.yaml, lmcache.yaml) and deploy/compose.yaml are real: vLLM's own
`vllm serve` parser takes them and its own validation passes; the --kv-transfer-config becomes a
KVTransferConfig whose connector vLLM knows and whose offloading spec is our class, resolved by
vLLM's own factory, pointed at the port of the pod's gateway. Nothing is started (no GPU here)."""

from __future__ import annotations

import pathlib

import yaml
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def pod(name: str) -> tuple[dict, dict]:
    """(the vllm container, the gateway's settings) of a manifest."""
    objects = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    spec = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    gateway = yaml.safe_load(next(d for d in objects if d["kind"] == "ConfigMap")["data"]["gateway.yaml"])
    return next(c for c in spec["containers"] if c["name"] == "vllm"), gateway


def parse(container: dict):
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    assert container["command"][0] == "vllm"
    args = parser.parse_args(container["command"][1:] + container["args"])
    serve.validate(args)
    return args


def test_vllm_manifest_parses_and_names_our_offloading_spec_on_the_gateway_port():
    container, gateway = pod("vllm.yaml")
    args = parse(container)
    kv = args.kv_transfer_config
    assert kv.kv_connector == "OffloadingConnector" and kv.kv_role == "kv_both"
    assert kv.kv_connector in KVConnectorFactory._registry
    spec = OffloadingSpecFactory.get_spec_cls(kv.kv_connector_extra_config)
    assert issubclass(spec, OffloadingSpec) and spec.__module__.startswith("adpkv_vllm")
    assert kv.kv_connector_extra_config["adpkv.port"] == gateway["port"]
    assert {e["name"]: e["value"] for e in container["env"]}["PYTHONHASHSEED"] == "0"


def test_lmcache_manifest_vllm_talks_to_the_lmcache_server_of_its_pod():
    container, _ = pod("lmcache.yaml")
    kv = parse(container).kv_transfer_config
    assert kv.kv_connector == "LMCacheMPConnector" and kv.kv_connector in KVConnectorFactory._registry
    objects = [d for d in yaml.safe_load_all((DEPLOY / "lmcache.yaml").read_text()) if d]
    spec = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    server = next(c for c in spec["containers"] if c["name"] == "lmcache")
    assert f"--port={kv.kv_connector_extra_config['lmcache.mp.port']}" in server["args"]


def test_compose_vllm_command_parses():
    """deploy/compose.yaml: the image's entrypoint is `vllm serve`, the command its arguments."""
    engine = yaml.safe_load((DEPLOY.parent / "compose.yaml").read_text())["services"]["vllm"]
    kv = parse({"command": ["vllm", "serve"], "args": engine["command"]}).kv_transfer_config
    assert OffloadingSpecFactory.get_spec_cls(kv.kv_connector_extra_config).__module__.startswith("adpkv_vllm")


def test_a_wrong_option_is_caught():
    container, _ = pod("vllm.yaml")
    broken = {**container, "args": container["args"] + ["--kv-transfer-confg", "{}"]}
    try:
        parse(broken)
    except SystemExit:
        return
    raise AssertionError("vLLM's parser took an option it does not have")
