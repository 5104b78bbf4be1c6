"""``adpkv doctor``: check a host before the engine starts, and say what to fix.

Run it on the engine's host, as root or the gateway's user (it looks into the card), in the
engine's environment (``PYTHONHASHSEED`` is read from the doctor's own), naming the engine's user
(``--engine-user``), with the gateway's YAML (``--config``; relative card paths resolve from
the doctor's working directory) or its port (the running gateway's cards then); the checks:

- ``gateway``: it answers PING and STATS; its adpkv version against this host's;
- ``door``: the gateway's Unix socket exists (the YAML's ``control_socket``, else the port's door
  in the door directory of the doctor's user, the engine's user or root: ``adpkv_core.wire.door``),
  and the engine's user (``--engine-user``, default the doctor's) may connect to it (write
  permission on the socket by owner, group or others, as the kernel decides); a door any local
  user may open is a warning, and so is a default door in a directory the engine's client does
  not look in (another user's: its ``gateway_users`` must name that user); one in a
  world-writable directory without the sticky bit (anyone may replace it) is a failure;
- ``ring memory``: the ring is a sealed memfd (not a file in ``/dev/shm``): before the gateway
  runs, ``shared_memory_size`` must fit the host's available memory and this cgroup's limit;
- ``/dev/shm``: a writable tmpfs (a non-root gateway's door directory is there) with room for
  what the engine puts there itself (``--shm-bytes``: LMCache's L1 pool with ``--shm-name``);
- ``status file``: the directory of ``status_file`` exists and the doctor's user may create
  files in it (the gateway refuses to start otherwise); with a gateway running, the file is
  fresh (rewritten every second);
- per fs card (``doctor_fs``): the directory (or where it will be created) is writable; its file system
  (tmpfs and a container's overlay lose the cache: warning); free space against
  ``capacity_bytes``; O_DIRECT accepted (a probe file written and removed);
  permissions (others must have no access: the card holds every tenant's KV);
- ``fingerprint``: the key layout fingerprint of the cards' serials and settings against
  ``key_layout_fingerprint`` and against the running gateway's;
- ``prefix hash``: what the engine's keys rest on stays the same across restarts:
  vLLM's ``prefix_caching_hash_algo`` (``--hash-algo``; xxhash/xxhash_cbor draw a random
  seed per process unless ``PYTHONHASHSEED`` is set), the LMCache server's ``--hash-algorithm``
  (default blake3 of the token ids: stable; ``builtin`` is Python's ``hash`` of
  ``(prefix, tokens, None)``: on Python < 3.12 ``hash(None)`` is None's address, different in
  every process whatever ``PYTHONHASHSEED`` says, and from 3.12 stable only with a numeric
  ``PYTHONHASHSEED``; the others are vLLM's functions and vLLM's seed rule), SGLang (SHA-256 of
  the token ids: nothing to set).

Every check gives OK, WARN or FAIL (SKIP where it cannot apply). The exit code is 0 when
all are OK, 1 with any FAIL, 2 with warnings only.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import time
from typing import Optional

from adpkv_core import __version__
from adpkv_core.wire import protocol as P
from adpkv_core.wire.door import SHM_DIR, door_dir, find_door

from adpkv_gateway.ops import control
from adpkv_gateway.cards.fs.card import CARD_FILE
from adpkv_gateway.config import socket_mode
from adpkv_gateway.observe.metrics import status_file_problem
from adpkv_gateway.store.placement import key_layout_fingerprint
from adpkv_gateway.ops.doctor_fs import card as _card, card_devices, fstype as _fstype
from adpkv_gateway.ops.doctor_host import Host
from adpkv_gateway.ops.doctor_report import FAIL, OK, SKIP, WARN, Finding

MiB = 1 << 20
STATUS_STALE_S = 10.0          # a running gateway rewrites its status file every second
VLLM_SEEDED_ALGOS = ("xxhash", "xxhash_cbor")            # vLLM: random NONE_HASH seed without PYTHONHASHSEED
ENGINES = ("vllm", "sglang", "lmcache")


def examine(h: Host) -> list[Finding]:
    """Every check, in the order an operator fixes them."""
    stats, findings = _gateway(h)
    findings += _door(h)
    findings += _ring_memory(h, stats)
    findings += _dev_shm(h)
    findings += _status_file(h, stats)
    if stats is None and not h.config_given and h.port_given:
        # the default card (./adpkv-card) is not that gateway's: checking it would mislead
        findings.append(Finding("card", SKIP, f"no gateway answers on port {h.config.port} and no --config: "
                                "its cards are unknown, none checked (nor their fingerprint)",
                                "start the gateway, or give its --config"))
    else:
        for device in card_devices(h, stats):
            findings += _card(h, device, stats)
        findings += _fingerprint(h, stats)
    findings += _prefix_hash(h)
    return findings


# ---------------------------------------------------------------------------- gateway
def _gateway(h: Host) -> tuple[Optional[P.GatewayStats], list[Finding]]:
    where = f"{h.host}:{h.config.port}"
    pong = control.request(h.config.port, {"op": "PING"}, host=h.host, timeout_s=h.timeout_s)
    if pong is None:
        return None, [Finding("gateway", FAIL, f"no gateway answers on {where}: the engine would run without "
                              "the external cache", "start adpkv-gateway (with this --config / --port) first")]
    if pong.get("v") != P.PROTOCOL_VERSION:
        return None, [Finding("gateway", FAIL, f"the gateway on {where} speaks protocol {pong.get('v')}, this "
                              f"host's adpkv {P.PROTOCOL_VERSION}", "run the same adpkv version on both sides")]
    reply = control.request(h.config.port, {"op": "STATS"}, host=h.host, timeout_s=h.timeout_s,
                            door=h.config.control_socket or None)
    if reply is None or reply.get("op") != "OK":
        why = reply["msg"] if reply else "no answer to STATS"
        return None, [Finding("gateway", WARN, f"answers PING on {where} but not STATS ({why})",
                              "see the door check below")]
    raw = reply.get("stats")
    version = raw.get("version", "?") if isinstance(raw, dict) else "?"
    try:
        stats = P.gateway_stats(raw)
    except P.ProtocolError as exc:
        return None, [Finding("gateway", WARN, f"answers on {where}, adpkv {version}, but its STATS reply is not "
                              f"what this host's adpkv {__version__} reads ({exc})",
                              "run the same adpkv version in the gateway and the engine")]
    if version != __version__:
        return stats, [Finding("gateway", WARN, f"answers on {where}, adpkv {version}; this host has {__version__}",
                               "run the same adpkv version in the gateway and the engine")]
    return stats, [Finding("gateway", OK, f"answers on {where} (adpkv {version}, protocol {P.PROTOCOL_VERSION}, "
                           f"{len(stats.cards)} card(s), {sum(c.active for c in stats.cards)} in service)")]


# ---------------------------------------------------------------------------- door
def _user(h: Host) -> tuple[int, set[int], str]:
    """uid, groups and name of the engine's user."""
    if not h.engine_user:
        uid = os.getuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return uid, set(os.getgroups()) | {os.getgid()}, name
    try:
        pw = pwd.getpwuid(int(h.engine_user)) if h.engine_user.isdigit() else pwd.getpwnam(h.engine_user)
    except KeyError:
        raise ValueError(f"--engine-user {h.engine_user!r} is not a user of this host") from None
    return pw.pw_uid, set(os.getgrouplist(pw.pw_name, pw.pw_gid)), pw.pw_name


def may_connect(st: os.stat_result, uid: int, groups: set[int]) -> bool:
    """Whether a process of ``uid``/``groups`` may connect to a Unix socket file (write permission)."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _door(h: Host) -> list[Finding]:
    uid, groups, name = _user(h)
    try:
        path = h.config.control_socket or find_door(h.config.port, {os.geteuid(), uid, 0})
        st = os.stat(path)
    except FileNotFoundError as exc:
        where = f"{h.config.control_socket} does not exist" if h.config.control_socket else str(exc)
        return [Finding("door", FAIL, f"{where}: no gateway serves port {h.config.port} here",
                        "start the gateway; engine and gateway must share the door's directory (docs/gateway.md, "
                        "Where the door is)")]
    if not stat.S_ISSOCK(st.st_mode):
        return [Finding("door", FAIL, f"{path} is not a socket", "remove it and restart the gateway")]
    mode = stat.S_IMODE(st.st_mode)
    owner = f"{_uname(st.st_uid)}:{_gname(st.st_gid)} {mode:04o}"
    if not may_connect(st, uid, groups):
        return [Finding("door", FAIL, f"{path} ({owner}): user {name} may not connect, so its engine gets no cache",
                        f"put {name} in group {_gname(st.st_gid)} or set control_socket_group to a group of it "
                        "(docs/gateway.md, Security)")]
    found = f"{path} ({owner}), user {name} may connect"
    parent = os.stat(os.path.dirname(path) or ".")
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
        return [Finding("door", FAIL, f"{found}; but every user may write {os.path.dirname(path)} and it has no "
                        "sticky bit: anyone may remove or replace the door",
                        f"chmod +t {os.path.dirname(path)} (as /dev/shm is: 1777), or a control_socket elsewhere")]
    if not h.config.control_socket and os.path.dirname(path) not in (door_dir(uid), door_dir(0)):
        return [Finding("door", WARN, found + f"; but {name}'s engine looks for it only in {door_dir(uid)} and "
                        f"{door_dir(0)} unless told more",
                        f"set the engine's gateway_users to {_uname(st.st_uid)} (or its socket to {path})")]
    if mode & stat.S_IWOTH:
        return [Finding("door", WARN, found + "; so may every local user",
                        "control_socket_mode 0660 with control_socket_group set to the engines' group")]
    if h.config_given and mode != socket_mode(h.config):
        return [Finding("door", WARN, found + f"; the YAML says control_socket_mode {h.config.control_socket_mode}",
                        "restart the gateway with this configuration")]
    return [Finding("door", OK, found)]


def _uname(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _gname(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# ---------------------------------------------------------------------------- memory
def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> Optional[int]:
    """Bytes this process's cgroup (v2) may still take, or None without a limit."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            rel = next((l.split(":", 2)[2].strip() for l in fh if l.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="ascii") as fh:
            limit = fh.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="ascii") as fh:
            return int(limit) - int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _ring_memory(h: Host, stats: Optional[P.GatewayStats]) -> list[Finding]:
    if stats is not None:
        return [Finding("ring memory", OK, f"the gateway holds its ring: {stats.ring_size / MiB:.0f} MiB (a sealed "
                        "memfd handed out at the door, not a file in /dev/shm)")]
    want = h.config.shared_memory_size
    available, room = _meminfo_available(), _cgroup_room()
    if room is not None and want > room:
        return [Finding("ring memory", FAIL, f"shared_memory_size {want / MiB:.0f} MiB exceeds what this cgroup may "
                        f"still take ({room / MiB:.0f} MiB): the gateway would be killed for memory",
                        "lower shared_memory_size or raise the container's memory limit")]
    if available is not None and want > available:
        return [Finding("ring memory", FAIL, f"shared_memory_size {want / MiB:.0f} MiB exceeds the host's available "
                        f"memory ({available / MiB:.0f} MiB)", "lower shared_memory_size")]
    return [Finding("ring memory", OK, f"shared_memory_size {want / MiB:.0f} MiB fits (available "
                    f"{(available or 0) / MiB:.0f} MiB{'' if room is None else f', cgroup room {room / MiB:.0f} MiB'})")]


def _dev_shm(h: Host) -> list[Finding]:
    if not os.path.isdir(SHM_DIR):
        return [Finding("/dev/shm", FAIL, f"{SHM_DIR} does not exist", "mount a tmpfs there (in Kubernetes: "
                        "an emptyDir with medium Memory shared by the engine and gateway containers)")]
    fstype = _fstype(SHM_DIR)
    vfs = os.statvfs(SHM_DIR)
    free, size = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    found = f"{fstype}, {free / MiB:.0f} of {size / MiB:.0f} MiB free"
    if fstype not in ("tmpfs", "ramfs"):
        return [Finding("/dev/shm", WARN, found + ": not memory", "mount a tmpfs on /dev/shm")]
    if not os.access(SHM_DIR, os.W_OK | os.X_OK) and not h.config.control_socket:
        return [Finding("/dev/shm", FAIL, found + ": not writable here, and a non-root gateway's door goes there",
                        "make /dev/shm writable (mode 1777) or set control_socket elsewhere")]
    if h.shm_bytes > free:
        return [Finding("/dev/shm", FAIL, found + f": the engine needs {h.shm_bytes / MiB:.0f} MiB there "
                        "(--shm-bytes)", "give /dev/shm more room (docker --shm-size; Kubernetes emptyDir "
                        "medium Memory sizeLimit) or shrink the engine's shared-memory pool")]
    return [Finding("/dev/shm", OK, found + (f", room for the engine's {h.shm_bytes / MiB:.0f} MiB"
                                              if h.shm_bytes else ""))]


# ---------------------------------------------------------------------------- status file
def _status_file(h: Host, stats: Optional[P.GatewayStats]) -> list[Finding]:
    path = h.config.status_file
    if not path:
        return [Finding("status file", SKIP, "no status_file in this configuration" if h.config_given else
                        "give the gateway's --config to check its status_file")]
    problem = status_file_problem(path)
    if problem:
        return [Finding("status file", FAIL, problem + ": the gateway refuses to start",
                        f"mkdir -p {os.path.dirname(os.path.abspath(path))} (writable by the gateway's user), "
                        "or another status_file")]
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        age = None
    if stats is not None and age is not None and age > STATUS_STALE_S:
        return [Finding("status file", WARN, f"{path} was last written {age:.0f} s ago, yet a gateway answers: "
                        "it writes another status_file, or cannot write this one",
                        "restart the gateway with this configuration; its log says why it cannot write")]
    return [Finding("status file", OK, f"{path}: its directory is writable" +
                    (f", written {age:.0f} s ago" if age is not None else ""))]


# ---------------------------------------------------------------------------- fingerprint
def _fingerprint(h: Host, stats: Optional[P.GatewayStats]) -> list[Finding]:
    devices = (list(h.config.storage_devices) if h.config_given or stats is None
               else [c.path or c.device for c in stats.cards])
    serials: list[str] = []
    remote = False
    for device in devices:
        if "://" in str(device):
            remote = True        # a Redis-protocol card's serial is in the server: only the gateway knows it
            break
        try:
            with open(os.path.join(device, CARD_FILE), encoding="utf-8") as fh:
                serials.append(str(json.load(fh)["serial"]))
        except FileNotFoundError:
            return [Finding("fingerprint", SKIP, f"{device} is no card yet (the gateway creates it at first start)")]
        except PermissionError:
            return [Finding("fingerprint", SKIP, f"this user may not read {device}/{CARD_FILE} (run the doctor as "
                            "root or the gateway's user)")]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [Finding("fingerprint", FAIL, f"{device}/{CARD_FILE} is unreadable: {exc}",
                            "restore the card's file or give the gateway an empty directory")]
    c = h.config
    mine = None if remote else key_layout_fingerprint(serials, c.storage_slots, c.num_dbs, c.key_placement,
                                                               c.fragment_size)
    running = stats.fingerprint if stats is not None else None
    actual = mine or running
    if actual is None:
        return [Finding("fingerprint", SKIP, "Redis-protocol cards and no gateway running: only the gateway knows "
                        "their serials")]
    if c.key_layout_fingerprint and c.key_layout_fingerprint != actual:
        return [Finding("fingerprint", FAIL, f"the cards and settings give {actual}, key_layout_fingerprint "
                        f"is {c.key_layout_fingerprint}: the gateway refuses to start (its peers place keys elsewhere)",
                        "use the cards and settings of that layout, or update key_layout_fingerprint everywhere")]
    if h.config_given and mine and running and mine != running:
        return [Finding("fingerprint", FAIL, f"the running gateway's layout is {running}, this configuration's cards "
                        f"give {mine}: it serves other cards or settings",
                        "restart the gateway with this configuration")]
    return [Finding("fingerprint", OK, actual + (" (the running gateway's too)" if running and mine else ""))]


# ---------------------------------------------------------------------------- prefix hash
def _prefix_hash(h: Host) -> list[Finding]:
    seed = h.environ.get("PYTHONHASHSEED")
    if not h.engine:
        return [Finding("prefix hash", SKIP, "name the engine (--engine vllm|sglang|lmcache) to check what its keys "
                        f"rest on; PYTHONHASHSEED is {'unset' if seed is None else seed}")]
    if h.engine == "sglang":
        return [Finding("prefix hash", OK, "SGLang's page hashes are SHA-256 of the token ids: the same in every run")]
    algo = h.hash_algo or ("sha256" if h.engine == "vllm" else "blake3")
    setting = "prefix_caching_hash_algo" if h.engine == "vllm" else "lmcache server --hash-algorithm"
    never = "a persistent cache never hits after a restart"
    if h.engine == "lmcache" and algo == "blake3":
        return [Finding("prefix hash", OK, f"{setting} blake3: a digest of the token ids, the same in every run")]
    if h.engine == "lmcache" and algo == "builtin":
        fix = f"{setting} blake3 (the default)"
        if h.python < (3, 12):
            return [Finding("prefix hash", FAIL, f"{setting} builtin is Python's hash of (prefix, tokens, None); on "
                            f"Python {h.python[0]}.{h.python[1]} hash(None) is None's address, another in every "
                            f"process whatever PYTHONHASHSEED says: {never}", fix)]
        if seed is None or seed == "random":
            return [Finding("prefix hash", FAIL, f"{setting} builtin is Python's hash, random per process with "
                            f"PYTHONHASHSEED {'unset' if seed is None else seed}: {never}",
                            fix + ", or export PYTHONHASHSEED=0 for every LMCache process")]
        return [Finding("prefix hash", OK, f"{setting} builtin with PYTHONHASHSEED={seed}: keep it in every "
                        "process and restart")]
    if algo in VLLM_SEEDED_ALGOS and seed is None:
        return [Finding("prefix hash", FAIL, f"{setting} {algo} with PYTHONHASHSEED unset: vLLM draws a random "
                        f"NONE_HASH seed per process: {never}",
                        f"export PYTHONHASHSEED=0 for every engine process (or {setting} sha256)")]
    if seed is None:
        return [Finding("prefix hash", OK, f"{setting} {algo}: vLLM's fixed default seed (keep PYTHONHASHSEED unset "
                        "in every engine process: a value set anywhere becomes that process's seed)")]
    return [Finding("prefix hash", OK, f"{setting} {algo}, seed PYTHONHASHSEED={seed}: the same value in every "
                    "engine process and restart")]
