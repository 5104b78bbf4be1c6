"""Issue 38 item 4: the status file never lies. A ``status_file`` whose directory is missing is
refused at start in one line (and the doctor says so), and a stopped gateway's last status file
says ``adpkv_gateway_up 0``. Real gateway processes, the commands run as a user runs them."""

from __future__ import annotations

import subprocess
import time

from prometheus_client.parser import text_string_to_metric_families

from adpkv_gateway.ops.spawn import free_port

from .test_cli_edges import ADPKV, ADPKV_GATEWAY
from .test_doctor import level, run_doctor


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_a_status_file_in_a_missing_directory_is_refused_at_start(tmp_path):
    status = tmp_path / "no-such-dir" / "adpkv.prom"
    card = tmp_path / "card"
    proc = subprocess.Popen(ADPKV_GATEWAY + ["--port", str(free_port()), "--storage-devices", str(card),
                                             "--shared-memory-size", str(8 << 20), "--status-file", str(status)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the gateway started with a status_file it cannot write:\n{out}") from None
    assert proc.returncode == 2, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert f"its directory {status.parent} does not exist" in out and "refusing to start" in out, out
    assert not card.exists(), "a refused start must not touch the card"


def test_the_doctor_checks_the_status_file_directory(tmp_path):
    card = tmp_path / "card"
    yaml = tmp_path / "gateway.yaml"
    for status, want in ((tmp_path / "missing" / "s.prom", "FAIL"), (tmp_path / "s.prom", "OK")):
        yaml.write_text(f"port: {free_port()}\nstorage_devices: [{card}]\nstatus_file: {status}\n")
        code, out = run_doctor("--config", str(yaml), "--engine", "sglang")
        assert level(out, "status file") == want, out
        if want == "FAIL":
            assert code == 1 and f"its directory {status.parent} does not exist" in out, out


def test_a_stopped_gateway_s_status_file_says_up_0(start_gateway, tmp_path):
    status = tmp_path / "adpkv.prom"
    gw = start_gateway(status_file=str(status))
    deadline = time.monotonic() + 30
    while not (status.exists() and samples(status.read_text()).get("adpkv_gateway_up") == 1):
        assert time.monotonic() < deadline, "the status file never said up 1"
        time.sleep(0.1)
    running = samples(status.read_text())
    assert abs(running["adpkv_gateway_updated_timestamp_seconds"] - time.time()) < 60
    assert gw.stop() == 0
    stopped = samples(status.read_text())
    assert stopped["adpkv_gateway_up"] == 0, status.read_text()
    assert stopped["adpkv_gateway_updated_timestamp_seconds"] >= running["adpkv_gateway_updated_timestamp_seconds"]
    out = subprocess.run(ADPKV + ["status", "--port", str(gw.port), "--timeout", "1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "no gateway answered" in out.stderr
