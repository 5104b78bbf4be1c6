"""``adpkv doctor`` on a healthy host and on each broken condition it claims to detect: real
gateway processes, real card directories, the CLI run as a user runs it.

Stand-ins, where this machine cannot produce the condition: a file system that refuses
O_DIRECT (every file system here takes it: ``os.open`` refuses it in-process instead), a
gateway of another adpkv version (a real gateway process whose ``__version__`` is set
before it starts), and an engine user without access to the door (the doctor judges the
user named by ``--engine-user`` from the socket's owner, group and mode, as the kernel would;
the tests run as root, whom the kernel lets through anyway).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from adpkv_gateway.ops import doctor, doctor_fs
from adpkv_gateway.ops.doctor_host import Host
from adpkv_gateway.cards.fs.card import CARD_FILE, FsCard
from adpkv_gateway.config import make_config
from adpkv_gateway.ops.spawn import GatewayProcess, free_port

from ..rankproc import gateway_door

ADPKV = [sys.executable, "-m", "adpkv_gateway.ops.cli"]


def run_doctor(*args, env_drop=(), **env):
    environ = {k: v for k, v in os.environ.items() if k not in env_drop}
    out = subprocess.run(ADPKV + ["doctor", *args], capture_output=True, text=True, timeout=120,
                         env={**environ, **env})
    return out.returncode, out.stdout + out.stderr


def level(out: str, check: str) -> str:
    m = re.search(rf"^(OK|WARN|FAIL|SKIP)\s+{re.escape(check)}(\s|$)", out, re.M)
    assert m, f"no {check!r} line in:\n{out}"
    return m.group(1)


def yaml_for(tmp_path, gw, **extra) -> str:
    settings = {"port": gw.port, "storage_devices": gw.card_dirs, "shared_memory_size": 64 << 20, **extra}
    path = tmp_path / "gateway.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in settings.items()) + "\n")
    return str(path)


def test_a_healthy_host_is_all_well(start_gateway, tmp_path):
    gw = start_gateway()
    for args in (["--port", str(gw.port)], ["--config", yaml_for(tmp_path, gw)]):
        code, out = run_doctor(*args, "--engine", "vllm", "--hash-algo", "xxhash", PYTHONHASHSEED="0")
        assert code == 0, out
        assert out.strip().endswith("all is well")
        for check in ("gateway", "door", "ring memory", "/dev/shm", f"card {gw.card_dirs[0]}", "o_direct",
                      "permissions", "fingerprint", "prefix hash"):
            assert level(out, check) == "OK", out


def test_no_gateway(tmp_path):
    port = free_port()
    code, out = run_doctor("--port", str(port), "--engine", "sglang")
    assert code == 1
    assert level(out, "gateway") == "FAIL" and f"no gateway answers on 127.0.0.1:{port}" in out
    assert level(out, "door") == "FAIL" and "fix: start the gateway" in out
    code, out = run_doctor("--port", str(port), "--engine", "sglang", "--json")
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1
    gateway = next(f for f in report["findings"] if f["check"] == "gateway")
    assert gateway["level"] == "FAIL" and gateway["fix"].startswith("start adpkv-gateway")


def test_a_gateway_of_another_version(tmp_path):
    # stand-in: a real gateway process whose adpkv version is set before it starts
    gw = GatewayProcess(str(tmp_path / "card"), shared_memory_size=8 << 20, log_path=str(tmp_path / "gw.log"))
    gw.command = lambda: [sys.executable, "-c", "import sys, adpkv_core; adpkv_core.__version__ = '0.0.9'; "
                          "from adpkv_gateway.loop.main import main; sys.argv[0] = 'adpkv-gateway'; sys.exit(main())",
                          "--port", str(gw.port), "--storage-devices", str(tmp_path / "card"),
                          "--shared-memory-size", str(8 << 20)]
    with gw:
        code, out = run_doctor("--port", str(gw.port), "--engine", "sglang")
    assert code == 2, out
    assert level(out, "gateway") == "WARN" and "adpkv 0.0.9; this host has" in out


@pytest.mark.parametrize("engine, algo, seed, python, want", [
    ("vllm", "xxhash", None, (3, 11), "FAIL"),
    ("vllm", "xxhash_cbor", None, (3, 11), "FAIL"),
    ("vllm", "xxhash", "0", (3, 11), "OK"),
    ("vllm", "xxhash", "random", (3, 11), "OK"),       # vLLM takes the string as the seed: the same every run
    ("vllm", "", None, (3, 11), "OK"),                 # sha256: vLLM's fixed default seed
    ("lmcache", "", None, (3, 11), "OK"),              # the server's default, blake3
    ("lmcache", "builtin", "42", (3, 11), "FAIL"),     # hash(None) differs per process before 3.12
    ("lmcache", "builtin", None, (3, 12), "FAIL"),
    ("lmcache", "builtin", "random", (3, 12), "FAIL"),
    ("lmcache", "builtin", "42", (3, 12), "OK"),
    ("lmcache", "xxhash", None, (3, 11), "FAIL"),      # vLLM's function, vLLM's seed rule
    ("sglang", "", None, (3, 11), "OK"),
])
def test_prefix_hash(engine, algo, seed, python, want):
    h = Host(make_config({}), engine=engine, hash_algo=algo, python=python,
             environ={} if seed is None else {"PYTHONHASHSEED": seed})
    (finding,) = doctor._prefix_hash(h)
    assert finding.level == want, finding


def test_the_python_fact_behind_lmcache_builtin():
    """What the builtin rule rests on, checked on this interpreter: on Python < 3.12 the hash of
    None (part of every LMCache builtin chunk hash) differs between two processes even with
    the same PYTHONHASHSEED."""
    probe = [sys.executable, "-c", "print(hash((7, (1, 2, 3), None)))"]
    runs = {subprocess.run(probe, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
                           check=True).stdout for _ in range(3)}
    assert (len(runs) > 1) == (sys.version_info < (3, 12)), runs


def test_prefix_hash_from_the_environment(start_gateway):
    gw = start_gateway()
    code, out = run_doctor("--port", str(gw.port), "--engine", "vllm", "--hash-algo", "xxhash",
                           env_drop=("PYTHONHASHSEED",))
    assert code == 1 and level(out, "prefix hash") == "FAIL" and "export PYTHONHASHSEED=0" in out


def test_capacity_beyond_the_file_system(start_gateway, tmp_path):
    gw = start_gateway()
    code, out = run_doctor("--config", yaml_for(tmp_path, gw, capacity_bytes=1 << 60), "--engine", "sglang")
    assert code == 1 and level(out, f"card {gw.card_dirs[0]}") == "FAIL"
    assert "is more than the file system can hold" in out


def test_a_card_in_memory_is_a_warning(start_gateway, tmp_path):
    card = f"/dev/shm/adpkv-doctor-test-{os.getpid()}"
    try:
        gw = start_gateway(card_dirs=[card])
        code, out = run_doctor("--port", str(gw.port), "--engine", "sglang")
        assert code == 2, out
        assert level(out, f"card {card}") == "WARN" and "lost at every reboot" in out
    finally:
        shutil.rmtree(card, ignore_errors=True)


def test_a_card_others_may_read(start_gateway):
    gw = start_gateway()
    os.chmod(gw.card_dirs[0], 0o755)
    code, out = run_doctor("--port", str(gw.port), "--engine", "sglang")
    assert code == 1 and level(out, "permissions") == "FAIL" and ". 0755" in out
    os.chmod(gw.card_dirs[0], 0o700)
    os.chmod(os.path.join(gw.card_dirs[0], CARD_FILE), 0o604)
    code, out = run_doctor("--port", str(gw.port), "--engine", "sglang")
    assert code == 1 and f"{CARD_FILE} 0604" in out


def test_the_door(start_gateway):
    gw = start_gateway()
    # stand-in for an engine user without access: judged from the socket as the kernel would
    code, out = run_doctor("--port", str(gw.port), "--engine", "sglang", "--engine-user", "nobody")
    assert code == 1 and level(out, "door") == "FAIL" and "user nobody may not connect" in out
    open_door = start_gateway(control_socket_mode="0666")
    code, out = run_doctor("--port", str(open_door.port), "--engine", "sglang", "--engine-user", "nobody")
    assert code == 2 and level(out, "door") == "WARN" and "so may every local user" in out
    st = os.stat(gateway_door(gw.port))
    assert doctor.may_connect(st, 65534, {65534}) is False and doctor.may_connect(st, st.st_uid, set()) is True


def test_a_door_anyone_may_replace(start_gateway, tmp_path):
    shared = tmp_path / "doors"
    shared.mkdir()
    os.chmod(shared, 0o777)                     # world-writable, no sticky bit
    gw = start_gateway(control_socket=str(shared / "adpkv.sock"))
    yaml = tmp_path / "gw.yaml"
    yaml.write_text(f"port: {gw.port}\ncontrol_socket: {shared / 'adpkv.sock'}\n"
                    f"storage_devices: [{gw.card_dirs[0]}]\nshared_memory_size: {64 << 20}\n")
    code, out = run_doctor("--config", str(yaml), "--engine", "sglang")
    assert code == 1 and level(out, "door") == "FAIL" and "anyone may remove or replace the door" in out
    os.chmod(shared, 0o1777)
    code, out = run_doctor("--config", str(yaml), "--engine", "sglang")
    assert level(out, "door") == "OK", out


def test_fingerprints(start_gateway, tmp_path):
    gw = start_gateway()
    code, out = run_doctor("--config", yaml_for(tmp_path, gw, key_layout_fingerprint="0123456789abcdef"),
                           "--engine", "sglang")
    assert code == 1 and level(out, "fingerprint") == "FAIL" and "refuses to start" in out
    other = FsCard(str(tmp_path / "other"))
    other.open()
    other.close()
    code, out = run_doctor("--config", yaml_for(tmp_path, gw, storage_devices=[str(tmp_path / "other")]),
                           "--engine", "sglang")
    assert code == 1 and level(out, "fingerprint") == "FAIL" and "serves other cards or settings" in out


def test_ring_and_dev_shm_room(tmp_path):
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(f"port: {free_port()}\nstorage_devices: [{tmp_path / 'card'}]\nshared_memory_size: {1 << 50}\n")
    code, out = run_doctor("--config", str(cfg), "--engine", "sglang", "--shm-bytes", "100000GiB")
    assert code == 1
    assert level(out, "ring memory") == "FAIL" and "exceeds" in out
    assert level(out, "/dev/shm") == "FAIL" and "the engine needs" in out


def test_o_direct_refused_with_o_direct_set(tmp_path, monkeypatch):
    # stand-in: every file system here takes O_DIRECT, so os.open refuses it in this process
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    h = Host(make_config({"storage_devices": [str(tmp_path / "card")], "o_direct": True}), config_given=True)
    findings = {f.check.strip(): f for f in doctor_fs.card(h, str(tmp_path / "card"), None)}
    assert findings["o_direct"].level == "WARN" and "falls back to the page cache" in findings["o_direct"].found
    h.config.o_direct = False
    findings = {f.check.strip(): f for f in doctor_fs.card(h, str(tmp_path / "card"), None)}
    assert findings["o_direct"].level == "OK" and "refused" in findings["o_direct"].found
    assert not any(n.startswith(doctor_fs.PROBE_NAME) for n in os.listdir(tmp_path)), "the probe file is removed"


def test_ownership_names_an_object_subdirectory_others_may_write(tmp_path):
    """Issue 26 item 4: the doctor judges each database's object subdirectories as the
    gateway does (a subdirectory writable by others: FAIL naming it; the gateway refuses it)."""
    from adpkv_gateway.ops.doctor_report import FAIL, OK
    root = str(tmp_path / "card")
    card = FsCard(root, num_dbs=2)
    card.open()
    fkey = b"x" * 9 + b"\x3f" + b"x" * 18 + b"\0\0"             # its file in db001/3f/ (byte 9)
    assert card.write(1, fkey, memoryview(b"payload"), object_bytes=7)
    card.close()
    assert [f.level for f in doctor_fs._card_ownership(root)] == [OK]
    os.chmod(os.path.join(root, "db001", "3f"), 0o777)
    finding, = doctor_fs._card_ownership(root)
    assert finding.level == FAIL and "db001/3f: writable by its group or others (mode 0777)" in finding.found, finding
