"""Issue 38 item 8: the small things a newcomer trips on, each run as a user would (the CLI as a
subprocess: exit code, the one line, no traceback) against real gateway processes."""

from __future__ import annotations

import json
import re
import subprocess

from adpkv_core import __version__
from adpkv_gateway.ops.spawn import free_port

from .test_cli_edges import ADPKV, ADPKV_GATEWAY, run


def _one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_version_on_both_commands_and_in_the_start_log(gateway):
    for cmd, name in ((ADPKV, "adpkv"), (ADPKV_GATEWAY, "adpkv-gateway")):
        out = run(cmd + ["--version"])
        assert out.returncode == 0, out.stderr
        assert _one_line(out.stdout) == f"{name} {__version__}"
    assert f"Gateway listening on 127.0.0.1:{gateway.port} (adpkv-gateway {__version__}, pid " in gateway.log(), \
        gateway.log()


def test_the_open_files_line_is_no_to_do(gateway):
    lines = [ln for ln in gateway.log().splitlines() if "Open files" in ln]
    assert lines and not any("raise it" in ln for ln in lines), lines


def test_status_text_has_hit_ratio_bytes_latency_and_usage_prints_mib(gateway):
    out = run(ADPKV + ["status", "--port", str(gateway.port)])
    assert out.returncode == 0, out.stderr
    assert re.search(r"^objects : hits \d+  misses \d+  hit ratio (-|\d+\.\d%)  stored", out.stdout, re.M), out.stdout
    assert re.search(r"^bytes   : read \d+\.\d MiB  written \d+\.\d MiB$", out.stdout, re.M), out.stdout
    assert re.search(r"^latency : ", out.stdout, re.M), out.stdout
    out = run(ADPKV + ["usage", "--port", str(gateway.port)])
    assert out.returncode == 0, out.stderr
    assert re.match(r"\d+\.\d MiB used of \d+ MiB \(\d+\.\d\d%\), \d+ objects on 1 card\(s\)", out.stdout), out.stdout


def test_status_json_without_a_gateway_prints_json():
    port = free_port()
    out = run(ADPKV + ["status", "--json", "--port", str(port), "--timeout", "0.5"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    answer = json.loads(out.stdout)
    assert answer["error"] == "no_gateway" and answer["port"] == port, answer


def test_doctor_port_without_a_gateway_says_so_and_checks_no_default_card(tmp_path):
    (tmp_path / "adpkv-card").mkdir()           # the default card, which that gateway need not use
    port = free_port()
    out = subprocess.run(ADPKV + ["doctor", "--port", str(port), "--timeout", "0.5", "--json"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    findings = json.loads(out.stdout)["findings"]
    assert any(f["check"] == "gateway" and f["level"] == "FAIL" and str(port) in f["found"] for f in findings)
    assert any(f["check"] == "card" and "cards are unknown" in f["found"] for f in findings), findings
    assert not any("adpkv-card" in f["found"] for f in findings), findings


def test_sizes_take_units_in_yaml_and_flags(start_gateway, tmp_path):
    gw = start_gateway(shared_memory_size="64MiB", capacity_bytes="1GiB")     # flags
    out = run(ADPKV + ["status", "--json", "--port", str(gw.port)])
    stats = json.loads(out.stdout)
    assert stats["ring_size"] == 64 << 20 and stats["cards"][0]["capacity_bytes"] == 1 << 30, stats
    path = tmp_path / "sizes.yaml"
    path.write_text(f"port: {gw.port}\nshared_memory_size: 6GiB\ncapacity_bytes: 512 MiB\n"
                    "namespace_quotas: {a: 1GiB}\n")
    from adpkv_gateway.config import from_yaml
    config = from_yaml(str(path))
    assert (config.shared_memory_size, config.capacity_bytes) == (6 << 30, 512 << 20)
    assert config.namespace_quotas == {"a": 1 << 30}
    path.write_text("shared_memory_size: 6GB5\n")
    out = run(ADPKV_GATEWAY + ["--config", str(path)])
    assert out.returncode == 2, out.stderr
    line = _one_line(out.stderr)
    assert "shared_memory_size" in line and "'6GB5' is not a number of bytes" in line, line


README = __import__("pathlib").Path(__file__).resolve().parents[3] / "README.md"


def test_readme_yaml_example_reads_and_check_that_it_works_says_what_the_commands_print(gateway):
    """The README's gateway YAML is a valid configuration (sizes with units), and each command of
    "Check that it works" prints what that section calls good output, against a real gateway."""
    text = README.read_text()
    from adpkv_gateway.config import make_config
    import yaml
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    example.pop("status_file")                  # its directory is the node exporter's: not on this host
    assert make_config(example).shared_memory_size == 6 << 30
    section = text.split("## Check that it works", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^(adpkv \S+) --port 5557", section, re.M)
    assert commands == ["adpkv status", "adpkv doctor"], section
    status = run(ADPKV + ["status", "--port", str(gateway.port)])
    assert status.returncode == 0 and status.stdout.startswith(f"gateway :{gateway.port}  up "), status.stdout
    assert "engine  : none" in status.stdout and re.search(r"^card \S+  fs .*  active  ", status.stdout, re.M)
    doctor = run(ADPKV + ["doctor", "--port", str(gateway.port)])
    assert doctor.returncode == 0 and doctor.stdout.strip().endswith("all is well"), doctor.stdout


def test_a_card_remounted_read_only_is_reported_as_read_only(start_gateway, tmp_path):
    """A card whose file system was remounted read-only: the start is refused with one line that
    says so (it said "cannot remove the leftover adpkv-card.json.tmp", a file that does not exist)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    assert mounted.returncode == 0, f"this test mounts a tmpfs (run the suite as root): {mounted.stderr}"
    try:
        card = str(mnt / "card")
        gw = start_gateway(card_dirs=[card])
        assert gw.stop() == 0
        remount = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        assert remount.returncode == 0, remount.stderr
        out = run(ADPKV_GATEWAY + ["--port", str(free_port()), "--storage-devices", card,
                                   "--shared-memory-size", "8MiB"])
        text = out.stdout + out.stderr
        assert out.returncode == 2 and "Traceback" not in text, text
        assert f"fs card {card}: read-only file system" in text and "leftover" not in text, text
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
