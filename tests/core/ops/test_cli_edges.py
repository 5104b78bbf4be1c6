"""The user-facing edges of the two console scripts, run as a user runs them (subprocesses).

- ``adpkv``: the gateway options (--config, --host, --port, --timeout) work before and after
  the subcommand, against a real gateway.
- ``adpkv-gateway --help``: one help line per setting, with its default.
- A misspelt switch (``ture``) is refused with a message naming the setting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from adpkv_gateway.ops import control
from adpkv_gateway.config import GatewayConfig
from adpkv_gateway.ops.spawn import free_port


def _script(name: str, module: str) -> list[str]:
    """The installed console script next to this interpreter, else ``python -m``."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return [path] if os.access(path, os.X_OK) else [sys.executable, "-m", module]


ADPKV = _script("adpkv", "adpkv_gateway.ops.cli")
ADPKV_GATEWAY = _script("adpkv-gateway", "adpkv_gateway.loop.main")


def run(cmd: list[str], timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def _yaml(tmp_path, port: int, **extra) -> str:
    path = tmp_path / "gateway.yaml"
    lines = [f"port: {port}", "bind_address: 127.0.0.1"] + [f"{k}: {v}" for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# ---------------------------------------------------------------------------- adpkv
def test_status_and_usage_take_the_options_before_or_after_the_subcommand(gateway, tmp_path):
    port = gateway.port
    yaml_path = _yaml(tmp_path, port)
    for argv in (["status", "--port", str(port)],                       # README: adpkv status --port 5557
                 ["--port", str(port), "status"],
                 ["status", "--config", yaml_path],                     # README: adpkv status --config ...
                 ["--config", yaml_path, "status"],
                 ["status", "--timeout", "5", "--host", "127.0.0.1", "--port", str(port), "--json"],
                 ["--port", "1", "status", "--port", str(port)]):       # after the subcommand wins
        out = run(ADPKV + argv)
        assert out.returncode == 0, (argv, out.stdout, out.stderr)
        if "--json" in argv:
            assert f'"port": {port}' in out.stdout, out.stdout
        else:
            assert f"gateway :{port} " in out.stdout, (argv, out.stdout)
    for argv in (["usage", "--port", str(port)], ["usage", "--config", yaml_path]):
        out = run(ADPKV + argv)
        assert out.returncode == 0, (argv, out.stdout, out.stderr)
        assert "MiB used of" in out.stdout


def test_an_option_after_the_subcommand_is_the_one_used(tmp_path):
    """No gateway on that port: the error names it (the option was read, not the default)."""
    port = free_port()
    out = run(ADPKV + ["status", "--port", str(port), "--timeout", "0.5"])
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert f"no gateway answered on 127.0.0.1:{port}" in out.stderr, out.stderr
    out = run(ADPKV + ["clean", "--yes", "--config", _yaml(tmp_path, port), "--timeout", "0.5"])
    assert out.returncode == 1 and f"127.0.0.1:{port}" in out.stderr, out.stderr


def _objects_on_cards(port: int) -> int:
    return sum(c["objects"] for c in control.request(port, {"op": "STATS"})["stats"]["cards"])


def test_bench_takes_the_config_after_the_subcommand(gateway, tmp_path):
    """``adpkv bench --config gateway.yaml`` measures the running gateway of that YAML, in the
    regime that gateway runs (its YAML has no o_direct: hot, the raw baseline through the page
    cache too: it compared a page-cache restore with O_DIRECT reads), and leaves its card as it
    found it (its objects used to stay on the live card)."""
    before = control.request(gateway.port, {"op": "STATS"})["stats"]["objects"].get("stored", 0)
    objects = _objects_on_cards(gateway.port)
    out = run(ADPKV + ["bench", "--config", _yaml(tmp_path, gateway.port), "--sizes", "128KiB",
                       "--total", "4MiB", "--repeat", "1", "--dir", str(tmp_path / "b")],
              timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.fullmatch(r"store_vs_raw=\d+\.\d\d restore_vs_raw=\d+\.\d\d \(hot 128 KiB\)",
                        out.stdout.strip().splitlines()[-1]), out.stdout
    assert "regime hot (o_direct: false in" in out.stdout and "hot    128 KiB" in out.stdout, out.stdout
    after = control.request(gateway.port, {"op": "STATS"})["stats"]["objects"].get("stored", 0)
    assert after >= before + 32, "the bench must have stored through the gateway of the YAML"
    assert _objects_on_cards(gateway.port) == objects, "the bench must remove what it stored"


def test_bench_help_says_what_it_does_and_each_option():
    out = run(ADPKV + ["bench", "--help"])
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert "starts its own gateway for each regime and size" in text and "deletes every object it stored" in text
    options = out.stdout.split("options:", 1)[1]
    for option in ("--sizes", "--regime", "--ranks", "--total", "--per-request", "--threads", "--repeat", "--dir"):
        # the option's entry, then its help text (on its line or the next), before the next option
        entry = re.search(rf"^  {option}(?: \S+)?(.*?)(?=^  -)", options + "\n  -", re.M | re.S)
        assert entry and entry.group(1).strip(), (option, options)


# ---------------------------------------------------------------------------- adpkv-gateway
def _expected_default(f: dataclasses.Field) -> str:
    value = getattr(GatewayConfig(), f.name)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "''" if value == "" else str(value)


def _help_blocks(text: str) -> dict[str, str]:
    """Each ``--flag`` of argparse's help with its (wrapped) help text joined into one line."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (--[a-z0-9-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line[m.end():].strip()
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(body.split()) for flag, body in blocks.items()}


def test_gateway_help_lists_every_setting_with_its_default():
    out = run(ADPKV_GATEWAY + ["--help"], timeout=60)
    assert out.returncode == 0, out.stderr
    blocks = _help_blocks(out.stdout)
    assert "--config" in blocks and blocks["--config"]
    for f in dataclasses.fields(GatewayConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in blocks, f"{flag} missing from adpkv-gateway --help"
        body = blocks[flag]
        default = f"(default: {_expected_default(f)})"
        assert body.endswith(default), f"{flag}: {body!r} does not end with {default!r}"
        # some words of help besides the metavar and the default
        words = body[: -len(default)].split()
        assert len(words) >= 3, f"{flag} has no help text: {body!r}"


# ---------------------------------------------------------------------------- booleans
def test_gateway_refuses_a_misspelt_switch_as_flag_and_in_yaml(tmp_path):
    out = run(ADPKV_GATEWAY + ["--storage-devices", str(tmp_path / "c"), "--port", str(free_port()),
                               "--o-direct", "ture"], timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "o_direct" in out.stderr and "ture" in out.stderr, out.stderr
    yaml_path = _yaml(tmp_path, free_port(), fsync="ture", storage_devices=f"[{tmp_path / 'c'}]")
    out = run(ADPKV_GATEWAY + ["--config", yaml_path], timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "fsync" in out.stderr and "ture" in out.stderr, out.stderr
    assert not (tmp_path / "c").exists(), "a refused configuration must not touch the card"


@pytest.mark.parametrize("text, value", [("true", True), ("FALSE", False), ("1", True), ("0", False),
                                         ("Yes", True), ("no", False), (" on ", True), ("off", False),
                                         (True, True), (False, False), (1, True), (0, False)])
def test_one_boolean_parser(text, value):
    from adpkv_core.settings import ClientConfig, parse_bool
    from adpkv_gateway.config import make_config

    assert parse_bool(text, "x") is value
    assert make_config({"o_direct": text}).o_direct is value
    assert ClientConfig.from_settings({"adpkv.key_namespace_from_model": text},
                                      prefix="adpkv.").key_namespace_from_model is value


@pytest.mark.parametrize("bad", ["ture", "", "2", 2, None, "y", 1.0])
def test_a_misspelt_switch_is_refused_naming_the_setting(bad):
    from adpkv_core.settings import ClientConfig, parse_bool
    from adpkv_gateway.config import make_config

    with pytest.raises(ValueError, match="my_switch"):
        parse_bool(bad, "my_switch")
    with pytest.raises(ValueError, match="shared_storage"):
        make_config({"shared_storage": bad})
    with pytest.raises(ValueError, match="adpkv.key_namespace_from_model"):
        ClientConfig.from_settings({"adpkv.key_namespace_from_model": bad}, prefix="adpkv.")
