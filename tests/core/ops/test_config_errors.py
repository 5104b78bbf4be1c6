"""Issue 38 items 1 and 2: a gateway YAML an operator got wrong is answered in one line (the
file, the setting, what it allows; "did you mean" for a near miss), exit 2, no traceback, by
every command that reads it (``adpkv-gateway``, ``adpkv status|usage|clean|doctor``), run as
a user runs them (subprocesses), and a Hypothesis fuzz of the file (random keys, kinds and
values, random text) finds nothing else; and every number setting is checked against its range where
it is read (``gateway/config.py``), so ``port: 70000`` no longer starts a gateway on 4464.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from adpkv_gateway.config import RANGES, ConfigError, GatewayConfig, from_yaml, make_config
from adpkv_gateway.ops.spawn import free_port

from .test_cli_edges import ADPKV, ADPKV_GATEWAY, run

COMMANDS = {
    "adpkv-gateway": ADPKV_GATEWAY,
    "adpkv status": ADPKV + ["status"],
    "adpkv usage": ADPKV + ["usage"],
    "adpkv clean": ADPKV + ["clean", "--yes"],
    "adpkv doctor": ADPKV + ["doctor"],
}

# (name, the YAML, what the one line must say besides the file's name)
MISTAKES = [
    ("a misspelt key", "storage_device: [{card}]\nport: {port}\n",
     ["storage_device: unknown setting (did you mean storage_devices?)"]),
    ("a key that is no setting", "colour: blue\nport: {port}\n", ["colour: unknown setting", "--help"]),
    ("a port that is no number", "port: abc\n", ["port: 'abc' is not an integer (a TCP port, 1..65535)"]),
    ("a YAML syntax error", "port: [{port}\nstorage_devices: [{card}]\n", ["not valid YAML: line 2"]),
    ("a list at the top level", "- port: {port}\n", ["the top level must be a mapping"]),
    ("a port out of range", "port: 70000\nstorage_devices: [{card}]\n",
     ["port: 70000 is out of range (a TCP port, 1..65535)"]),
]


def one_line_refusal(out, *wanted: str) -> str:
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 2, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    for w in wanted:
        assert w in text, (w, text)
    return text


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("mistake, yaml_text, wanted", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_in_the_yaml_is_one_line_and_exit_2(command, mistake, yaml_text, wanted, tmp_path):
    card = tmp_path / "card"
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml_text.format(card=card, port=free_port()))
    out = run(COMMANDS[command] + ["--config", str(path)], timeout=60)
    text = one_line_refusal(out, str(path), *wanted)
    assert text.startswith(command.split()[0]), text
    assert not card.exists(), "a refused configuration must not touch the card"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_missing_file_is_one_line_and_exit_2(command, tmp_path):
    path = tmp_path / "nowhere.yaml"
    one_line_refusal(run(COMMANDS[command] + ["--config", str(path)], timeout=60),
                     f"{path}: cannot read it: No such file or directory")


def test_a_bad_flag_names_the_flag_and_the_setting(tmp_path):
    out = run(ADPKV_GATEWAY + ["--storage-devices", str(tmp_path / "card"), "--port", "70000"], timeout=60)
    one_line_refusal(out, "port (--port): 70000 is out of range (a TCP port, 1..65535)")
    out = run(ADPKV + ["status", "--port", "70000"], timeout=60)
    assert out.returncode == 2 and "'70000' is not a TCP port, 1..65535" in out.stderr, out.stderr
    assert not (tmp_path / "card").exists()


def test_every_number_setting_has_a_range():
    numbers = {f.name for f in dataclasses.fields(GatewayConfig) if str(f.type) in ("int", "float")}
    assert numbers == set(RANGES), numbers ^ set(RANGES)


@pytest.mark.parametrize("setting, value, says", [
    ("port", 70000, "port: 70000 is out of range (a TCP port, 1..65535)"),
    ("port", 0, "port: 0 is out of range"),
    ("port", True, "port: True is not an integer"),
    ("port", 5557.5, "port: 5557.5 is not an integer"),
    ("metrics_port", 65536, "metrics_port: 65536 is out of range (a TCP port (0: off), 0..65535)"),
    ("num_dbs", 0, "num_dbs: 0 is out of range (databases per card (db000..db999), 1..1000)"),
    ("num_dbs", 1001, "num_dbs: 1001 is out of range"),
    ("storage_slots", 0, "storage_slots: 0 is out of range"),
    ("replicas", 0, "replicas: 0 is out of range"),
    ("io_timeout_strikes", 0, "io_timeout_strikes: 0 is out of range"),
    ("start_clean", 2, "start_clean: 2 is out of range (0 or 1, 0..1)"),
    ("shared_memory_size", 4096, "shared_memory_size: 4096 is out of range (bytes of the ring, >= 1 MiB)"),
    ("capacity_bytes", -1, "capacity_bytes: -1 is out of range"),
    ("fragment_size", -1, "fragment_size: -1 is out of range"),
    ("eviction_watermark", 1.5, "eviction_watermark: 1.5 is out of range (a fraction of capacity, 0..1)"),
    ("eviction_watermark", 0, "eviction_watermark: 0.0 is out of range"),
    ("eviction_ratio", -0.1, "eviction_ratio: -0.1 is out of range"),
    ("eviction_ratio", 0.96, "eviction_ratio: 0.96 must be below eviction_watermark (0.95)"),
    ("engine_timeout_s", 0, "engine_timeout_s: 0.0 is out of range (seconds, > 0)"),
    ("door_handshake_s", float("nan"), "door_handshake_s: nan is out of range"),
    ("log_level", "LOUD", "log_level: 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR"),
    ("control_socket_mode", 432, "control_socket_mode: 432 is a number: write the mode quoted"),
    ("control_socket_mode", "0999", "control_socket_mode: '0999' is not octal permissions"),
    ("key_layout_fingerprint", "abc", "key_layout_fingerprint: 'abc' is not 16 hex digits"),
    ("storage_devices", {"a": 1}, "storage_devices: {'a': 1} is not a list of devices"),
    ("card_group", ["x"], "card_group: ['x'] is not a string"),
])
def test_a_value_out_of_range_is_refused_naming_the_setting(setting, value, says):
    with pytest.raises(ConfigError) as refused:
        make_config({setting: value})
    assert str(refused.value).startswith(says), str(refused.value)


def test_values_in_range_are_taken():
    c = make_config({"port": "6000", "metrics_port": 0, "num_dbs": 1000, "start_clean": True, "log_level": "debug",
                     "eviction_watermark": 1, "eviction_ratio": 0, "shared_memory_size": 1 << 20,
                     "control_socket_mode": "0600", "storage_devices": "/tmp/x"})
    assert (c.port, c.num_dbs, c.start_clean, c.eviction_watermark, c.storage_devices) == \
        (6000, 1000, 1, 1.0, ["/tmp/x"])


# ---------------------------------------------------------------------------- fuzz
SETTINGS = [f.name for f in dataclasses.fields(GatewayConfig)]
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats()
                      | st.text(max_size=12) | st.sampled_from(["0660", "INFO", "stripe", "/tmp/x", "a=1", "1e3"]),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=3), max_leaves=6)
KEYS = st.sampled_from(SETTINGS) | st.text(max_size=20)


@settings(max_examples=200, database=None, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(KEYS, VALUES, max_size=6) | VALUES, raw=st.none() | st.text(max_size=60))
def test_fuzzed_yaml_is_a_config_or_one_config_error(doc, raw, tmp_path):
    """Random settings (known and unknown keys, any kind of value) and random text: the file is
    either good settings within their ranges or one ConfigError naming the file; nothing else
    escapes (what the commands turn into one line and exit 2)."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump(doc))
    try:
        config = from_yaml(str(path))
    except ConfigError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc), str(exc)
        return
    for name, rule in RANGES.items():
        assert rule.allows(getattr(config, name)), (name, getattr(config, name))
