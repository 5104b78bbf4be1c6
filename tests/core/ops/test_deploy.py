"""The deployment files (deploy/), checked offline: no container builder or registry is
reachable here, so no image is built; what can be checked without one is.

- The Dockerfiles pass hadolint; the gateway image's settings parse, its HEALTHCHECK is the
  operator CLI's ``adpkv status --config``, its volume is the card the settings name.
- The Kubernetes manifests validate (strict) against the Kubernetes schemas (kubernetes-validate's
  offline copies) and have the shape docs/operations.md describes: the gateway a
  non-root native sidecar, /dev/shm one memory emptyDir in every container and the door
  directory of the gateway's user in it, the engine's adapter trusting that user (and so
  looking for the door there), the door's group the pod's fsGroup, the card the volume the
  settings name, the metrics port the one scraped, the engine pointed at the gateway's port
  through a class our adapters define.
- The gateway of each manifest runs here as the container would (its args, its ConfigMap's
  settings; only the card directory, the ports and the door's group are swapped for the test
  machine's): the probe command answers 0 while it runs and not 0 once it stopped, and its
  /metrics answers.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import urllib.request

import kubernetes_validate
import pytest
import yaml

from adpkv_core.wire.door import door_dir
from adpkv_gateway import config as cfg
from adpkv_gateway.ops.spawn import GatewayProcess, free_port

REPO = pathlib.Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
K8S_VERSION = "1.33.0"          # native sidecars (restartPolicy: Always on an init container): >= 1.29
HADOLINT = pathlib.Path(sys.executable).parent / "hadolint"
PLUGIN_DIRS = {"adpkv_vllm": REPO / "plugins" / "vllm", "adpkv_sglang": REPO / "plugins" / "sglang",
               "adpkv_lmcache": REPO / "plugins" / "lmcache"}


def docs(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(items, what):
    assert len(items) == 1, f"expected one {what}, found {len(items)}"
    return items[0]


def settings_of(text: str, tmp_path: pathlib.Path) -> cfg.GatewayConfig:
    """Parse gateway settings as ``adpkv-gateway --config`` does (unknown keys are an error)."""
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return cfg.make_config(cfg.load_yaml(str(path)))


def gateway_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adpkv-gateway", exit_on_error=False)
    cfg.add_arguments(parser)
    return parser


class Pod:
    """A manifest's pod: the gateway sidecar, the other containers, volumes, its ConfigMap."""

    def __init__(self, path: pathlib.Path):
        objects = docs(path)
        self.objects = objects
        self.deployment = one([d for d in objects if d["kind"] == "Deployment"], "Deployment")
        self.configmap = one([d for d in objects if d["kind"] == "ConfigMap"], "ConfigMap")
        self.template = self.deployment["spec"]["template"]
        self.spec = self.template["spec"]
        self.gateway = one([c for c in self.spec.get("initContainers", []) if c["name"] == "adpkv-gateway"],
                           "adpkv-gateway init container")
        self.engines = self.spec["containers"]
        self.volumes = {v["name"]: v for v in self.spec["volumes"]}

    def mount(self, container: dict, path: str) -> dict:
        """The volume mounted at ``path`` in ``container``."""
        m = one([m for m in container.get("volumeMounts", []) if m["mountPath"] == path], f"mount at {path}")
        return self.volumes[m["name"]]

    def config_text(self) -> tuple[str, str]:
        """(the gateway's --config path, the text the pod gives that file)."""
        args = gateway_parser().parse_args(self.gateway["args"])
        directory, name = os.path.split(args.config)
        volume = self.mount(self.gateway, directory)
        assert volume["configMap"]["name"] == self.configmap["metadata"]["name"]
        return args.config, self.configmap["data"][name]


# ---------------------------------------------------------------- Dockerfiles
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.engine"])
def test_dockerfiles_pass_hadolint(dockerfile):
    out = subprocess.run([str(HADOLINT), str(DEPLOY / dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_a_real_check(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install foo\n")
    out = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout      # an image without a tag


def dockerfile_instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_gateway_image_runs_the_gateway_as_a_user_on_its_settings_and_checks_health(tmp_path):
    steps = dockerfile_instructions(DEPLOY / "Dockerfile")
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    ops = dict(final)
    user = ops["USER"].split(":")[0]
    assert user not in ("root", "0") and int(user) > 0
    config = settings_of((DEPLOY / "gateway.yaml").read_text(), tmp_path)
    assert json.loads(ops["VOLUME"]) == config.storage_devices
    assert {int(p) for p in ops["EXPOSE"].split()} == {config.port, config.metrics_port}
    assert "COPY deploy/gateway.yaml /etc/adpkv/gateway.yaml" in " ".join(f"{o} {a}" for o, a in final)
    health = json.loads(ops["HEALTHCHECK"].split("CMD", 1)[1])
    assert health == ["adpkv", "status", "--config", "/etc/adpkv/gateway.yaml"]
    entry, cmd = json.loads(ops["ENTRYPOINT"]), json.loads(ops["CMD"])
    assert entry == ["adpkv-gateway"] and gateway_parser().parse_args(cmd).config == "/etc/adpkv/gateway.yaml"
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'adpkv-gateway = "adpkv_gateway.loop.main:main"' in scripts and 'adpkv = "adpkv_gateway.ops.cli:main"' in scripts
    assert not int(config.start_clean) and config.metrics_port and config.control_socket_group == "10001"


# ---------------------------------------------------------------- Kubernetes manifests
def test_there_are_manifests_for_vllm_sglang_and_lmcache():
    assert {p.stem for p in MANIFESTS} >= {"vllm", "sglang", "lmcache"}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(manifest):
    for obj in docs(manifest):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_schema_check_is_a_real_check():
    deployment = Pod(DEPLOY / "k8s" / "vllm.yaml").deployment
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []       # not a field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, K8S_VERSION, strict=True)


def engine_settings(container: dict) -> dict:
    """The JSON settings an engine container hands its adapter (the argument after the flag)."""
    args = container.get("args", [])
    for flag in ("--kv-transfer-config", "--hicache-storage-backend-extra-config", "--l2-adapter"):
        if flag in args:
            return {"flag": flag, **json.loads(args[args.index(flag) + 1])}
    return {}


def defines_class(module: str, name: str) -> bool:
    """Whether our adapter package ``module`` (its subpackages too) defines ``name`` (read, not
    imported: the engines are not installed in this venv)."""
    for path in PLUGIN_DIRS[module].rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return True
    return False


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_pod_shape(manifest, tmp_path):
    pod = Pod(manifest)
    _, text = pod.config_text()
    config = settings_of(text, tmp_path)
    gw = pod.gateway
    # the gateway: a native sidecar, non-root, never wiping the card, probed with `adpkv status`
    assert gw["restartPolicy"] == "Always"
    sc = gw["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0 and sc["allowPrivilegeEscalation"] is False
    assert not int(config.start_clean)
    for probe in ("startupProbe", "livenessProbe"):
        cmd = gw[probe]["exec"]["command"]
        assert cmd[:2] == ["adpkv", "status"] and cmd[cmd.index("--config") + 1] == pod.config_text()[0]
    # the card: the volume mounted where the settings say, a hostPath or a claim of this file
    assert config.storage_backend == "fs" and len(config.storage_devices) == 1
    card = pod.mount(gw, config.storage_devices[0])
    if "persistentVolumeClaim" in card:
        claims = {d["metadata"]["name"] for d in pod.objects if d["kind"] == "PersistentVolumeClaim"}
        assert card["persistentVolumeClaim"]["claimName"] in claims
    else:
        assert card["hostPath"]["path"].startswith("/")
    # /dev/shm: one memory-backed emptyDir in every container, where the door directory of
    # the gateway's (non-root) user is: the default door, no control_socket
    for container in [gw] + pod.engines:
        shm = pod.mount(container, "/dev/shm")
        assert shm["emptyDir"]["medium"] == "Memory", container["name"]
    assert not config.control_socket and door_dir(sc["runAsUser"]).startswith("/dev/shm/")
    # the door: mode 0660, group = the pod's fsGroup, which every container has
    assert cfg.socket_mode(config) == 0o660
    assert int(config.control_socket_group) == pod.spec["securityContext"]["fsGroup"]
    assert gw["securityContext"]["runAsGroup"] == pod.spec["securityContext"]["fsGroup"]
    # metrics: served on every interface of the pod, on the port Prometheus is told to scrape
    annotations = pod.template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == config.metrics_port and config.metrics_address == "0.0.0.0"
    assert {p["containerPort"] for p in gw["ports"] if p["name"] == "metrics"} == {config.metrics_port}
    # the engine side: our adapter, on the gateway's port
    adapters = [s for s in map(engine_settings, pod.engines) if s]
    ours = []
    for s in adapters:
        extra = s.get("kv_connector_extra_config", {})
        if s.get("kv_connector_module_path") in PLUGIN_DIRS:
            ours.append((s["kv_connector_module_path"], s["kv_connector"], extra["adpkv.port"],
                         extra.get("adpkv.gateway_users")))
        elif extra.get("spec_module_path") in PLUGIN_DIRS:
            ours.append((extra["spec_module_path"], extra["spec_name"], extra["adpkv.port"],
                         extra.get("adpkv.gateway_users")))
        elif s.get("module_path") in PLUGIN_DIRS:      # SGLang's extra config, LMCache's L2 adapter
            params = s.get("adapter_params", s)
            ours.append((s["module_path"], s["class_name"], params["port"], params.get("gateway_users")))
    module, name, port, users = one(ours, "engine container with an adpkv adapter")
    assert defines_class(module, name), f"{module} defines no {name}"
    assert port == config.port
    # whatever user the engine's image runs as, its client trusts the gateway's user and so
    # looks for the door in that user's door directory (adpkv_core.wire.door.find_door)
    assert users == str(sc["runAsUser"]), users


def test_the_pod_shape_check_catches_a_gateway_on_another_port(tmp_path):
    """A manifest whose engine points at another port than its gateway's is caught."""
    text = (DEPLOY / "k8s" / "vllm.yaml").read_text().replace('"adpkv.port":5557', '"adpkv.port":5558')
    broken = tmp_path / "vllm.yaml"
    broken.write_text(text)
    with pytest.raises(AssertionError, match="5558"):
        test_pod_shape(broken, tmp_path)


# ---------------------------------------------------------------- the gateway as its pod runs it
def wait_for(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_the_manifest_gateway_runs_and_its_probe_and_metrics_answer(manifest, tmp_path):
    pod = Pod(manifest)
    config_path, text = pod.config_text()
    values = yaml.safe_load(text)
    # what differs on this machine: the card directory, free ports, the door's group, a small ring
    values.update(storage_devices=[str(tmp_path / "card")], port=free_port(), metrics_port=free_port(),
                  control_socket_group=str(os.getgid()), shared_memory_size=64 << 20)
    local = tmp_path / "gateway.yaml"
    local.write_text(yaml.safe_dump(values))
    args = [str(local) if a == config_path else a for a in pod.gateway["args"]]
    gw = GatewayProcess(values["storage_devices"], port=values["port"], log_path=str(tmp_path / "gw.log"))
    gw.command = lambda: [sys.executable, "-m", "adpkv_gateway.loop.main", *args]
    probe = [str(local) if a == config_path else a for a in pod.gateway["livenessProbe"]["exec"]["command"]]
    probe = [sys.executable, "-m", "adpkv_gateway.ops.cli", *probe[1:]]
    with gw:
        out = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "fingerprint" in out.stdout, out.stdout + out.stderr
        url = f"http://127.0.0.1:{values['metrics_port']}/metrics"
        wait_for(lambda: b"adpkv_gateway_storage_groups_active 1.0" in urllib.request.urlopen(url, timeout=5).read())
    out = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no gateway answered" in out.stderr, shlex.join(probe)


# ---------------------------------------------------------------- one host: Docker Compose
COMPOSE = DEPLOY / "compose.yaml"
CHECK_JSONSCHEMA = pathlib.Path(sys.executable).parent / "check-jsonschema"


def test_compose_file_validates_against_the_compose_specification(tmp_path):
    ok = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    typo = tmp_path / "compose.yaml"
    typo.write_text(COMPOSE.read_text().replace("    group_add:", "    groups_add:"))
    bad = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(typo)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0, "the schema check took an unknown key"


def test_compose_wiring(tmp_path):
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    gw, engine = services["gateway"], services["vllm"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in gw["volumes"]}     # container path -> host path
    args = gateway_parser().parse_args(gw["command"])
    config = settings_of((COMPOSE.parent / mounts[args.config]).read_text(), tmp_path)
    assert gw["user"].split(":")[0] != "0" and not int(config.start_clean)
    assert mounts[config.storage_devices[0]].startswith("/")          # the card: a host directory
    assert gw["healthcheck"]["test"] == ["CMD", "adpkv", "status", "--config", args.config]
    assert f"{config.metrics_port}:{config.metrics_port}" in gw["ports"] and config.metrics_address == "0.0.0.0"
    # the engine: in the gateway's IPC namespace (its /dev/shm and so the door), network (the
    # control port on 127.0.0.1) and the door's group; started once the gateway is healthy
    assert gw["ipc"] == "shareable" and engine["ipc"] == "service:gateway"
    assert engine["network_mode"] == "service:gateway" and config.bind_address == "127.0.0.1"
    assert config.control_socket_group in engine["group_add"] and cfg.socket_mode(config) == 0o660
    # the door: the default one of the gateway's user, in the /dev/shm the engine shares; the
    # engine trusts that user, and so looks for the door in its door directory
    user = gw["user"].split(":")[0]
    assert not config.control_socket and door_dir(int(user)).startswith("/dev/shm/")
    assert engine["depends_on"]["gateway"]["condition"] == "service_healthy"
    kv = json.loads(engine["command"][engine["command"].index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    assert extra["adpkv.port"] == config.port and defines_class(extra["spec_module_path"], extra["spec_name"])
    assert extra["adpkv.gateway_users"] == user
    assert engine["environment"]["PYTHONHASHSEED"] == "0"
