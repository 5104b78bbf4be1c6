"""The doctor's checks of fs cards: what ``adpkv doctor`` says about each card directory.

Contract: ``card_devices(h, stats)`` names the fs cards to check (the configuration's
``storage_devices`` when one was given or no gateway answers, else the running gateway's fs
cards by their absolute path; Redis-protocol URLs left out). ``card(h, device, stats)``
returns the card's findings, in this order: the directory (or where it will be created) is
writable (FAIL, and nothing else checked, if not); its file system and free space against
``capacity_bytes`` (tmpfs/ramfs/overlay: WARN; more capacity than the file system holds:
FAIL; capacity 0 with under ``LOW_FREE_BYTES`` free: WARN); ``  o_direct`` (a probe file
``PROBE_NAME``-<pid> written with O_DIRECT and removed; refused while ``o_direct`` is set:
WARN); ``  permissions`` (the card directory, its card file and first db directories:
any access for others is a FAIL); ``  ownership`` (the card directory, its card file and
every db directory and each of its object subdirectories, without following links: a symlink, one owned by another user than
the doctor's, or one writable by group or others is a FAIL, as the gateway refuses them,
``fs_files.not_own``). ``fstype(path)`` is the file system type of the mount
holding ``path``. Nothing here writes but the probe file, which is always removed.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import Optional

from adpkv_core.wire.protocol import GatewayStats

from adpkv_gateway.cards.fs.card import CARD_FILE
from adpkv_gateway.cards.fs.files import SUBDIR_NAMES, not_own
from adpkv_gateway.ops.doctor_host import Host
from adpkv_gateway.ops.doctor_report import FAIL, OK, WARN, Finding

LOW_FREE_BYTES = 1 << 30          # an fs card sized by free space with less than this is hardly a cache
EPHEMERAL_FS = {"tmpfs": "memory: lost at every reboot", "ramfs": "memory: lost at every reboot",
                "overlay": "a container's writable layer: lost with the container; mount a volume"}
PROBE_NAME = ".adpkv-doctor-probe"


def card_devices(h: Host, stats: Optional[GatewayStats]) -> list[str]:
    if h.config_given or stats is None:
        devices = list(h.config.storage_devices)
    else:
        devices = [c.path or c.device for c in stats.cards if c.kind == "fs"]
    return [d for d in devices if "://" not in str(d)]


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount holding ``path``."""
    best = ("/", "?")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                fstype = right.split()[0]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fstype)
    except (OSError, IndexError):
        pass
    return best


def fstype(path: str) -> str:
    return _mount_of(os.path.realpath(path))[1]


def probe_o_direct(directory: str) -> Optional[str]:
    """None when a file in ``directory`` can be written with O_DIRECT, else the refusal."""
    path = os.path.join(directory, f"{PROBE_NAME}-{os.getpid()}")
    buf = mmap.mmap(-1, 4096)           # page aligned, as O_DIRECT wants
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def card(h: Host, device: str, stats: Optional[GatewayStats]) -> list[Finding]:
    root = os.path.abspath(device)
    name = f"card {device}"
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        return [Finding(name, FAIL, f"{existing} is not a directory this user may write", "create the card's "
                        "directory for the gateway's user (and run the doctor as that user or root), or point "
                        "storage_devices elsewhere")]
    out = []
    point, fstype = _mount_of(os.path.realpath(existing))
    vfs = os.statvfs(existing)
    free = vfs.f_bavail * vfs.f_frsize
    used = next((c.used_bytes for c in (stats.cards if stats is not None else [])
                 if (c.path or c.device) == root), 0)
    where = f"{fstype} on {point}, {free / (1 << 30):.1f} GiB free" + ("" if root == existing else ", to be created")
    cap = h.config.capacity_bytes
    if fstype in EPHEMERAL_FS:
        out.append(Finding(name, WARN, f"{where}: {EPHEMERAL_FS[fstype]}", "put the card on a persistent drive"))
    elif cap and cap > free + used:
        out.append(Finding(name, FAIL, f"{where}: capacity_bytes {cap / (1 << 30):.1f} GiB is more than the file "
                           "system can hold (writes fail before eviction starts)",
                           f"capacity_bytes at most {(free + used) / (1 << 30):.1f} GiB, or 0 (free space at start)"))
    elif not cap and free < LOW_FREE_BYTES:
        out.append(Finding(name, WARN, f"{where}: capacity_bytes 0 sizes the card by free space, and little is free",
                           "free space on the drive or set capacity_bytes"))
    else:
        out.append(Finding(name, OK, where + (f", capacity {cap / (1 << 30):.1f} GiB" if cap else "")))
    refused = probe_o_direct(existing)
    if refused is None:
        out.append(Finding("  o_direct", OK, "accepted" + ("" if h.config.o_direct else " (o_direct is off)")))
    elif h.config.o_direct:
        out.append(Finding("  o_direct", WARN, f"refused ({refused}): o_direct is set, the gateway falls back to "
                           "the page cache", "put the card on a file system that takes O_DIRECT, or o_direct: false"))
    else:
        out.append(Finding("  o_direct", OK, f"refused ({refused}); o_direct is off"))
    out += _card_permissions(h, root)
    out += _card_ownership(root)
    return out


def _card_ownership(root: str) -> list[Finding]:
    """The gateway's refusal of a card someone else could tamper with, as a finding."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return []
    uid = os.geteuid()
    bad = []
    reason = not_own(st, uid, directory=True)
    if reason:
        bad.append(f"{root}: {reason}")
    elif stat.S_ISDIR(st.st_mode):
        for n in sorted(os.listdir(root)):
            if n == CARD_FILE or (n.startswith("db") and n[2:].isdigit()):
                try:
                    reason = not_own(os.lstat(os.path.join(root, n)), uid, directory=n != CARD_FILE)
                except OSError:
                    continue
                if reason:
                    bad.append(f"{n}: {reason}")
                elif n != CARD_FILE:
                    bad += _subdirs_not_own(os.path.join(root, n), n, uid)
    if bad:
        return [Finding("  ownership", FAIL, "the gateway refuses this card: " + "; ".join(bad[:4]) +
                        (f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""),
                        f"another user could swap its files: remove it, or give it to uid {uid} "
                        "(chown -R, chmod go-w) if its contents are known good")]
    return [Finding("  ownership", OK, f"owned by uid {uid}, no symlinks, writable by no one else")]


def _subdirs_not_own(db_path: str, db_name: str, uid: int) -> list[str]:
    """What is wrong with the object subdirectories of a database (``fs_files.SUBDIR_NAMES``;
    a missing one is made by the gateway), as the gateway judges them."""
    bad = []
    for sub in SUBDIR_NAMES:
        try:
            reason = not_own(os.lstat(os.path.join(db_path, sub)), uid, directory=True)
        except OSError:
            continue
        if reason:
            bad.append(f"{db_name}/{sub}: {reason}")
    return bad


def _card_permissions(h: Host, root: str) -> list[Finding]:
    if not os.path.isdir(root):
        return []
    want = 0o750 if h.config.card_group else 0o700
    loose = []
    for path in [root, os.path.join(root, CARD_FILE)] + [os.path.join(root, n) for n in sorted(os.listdir(root))[:4]
                                                          if n.startswith("db")]:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            continue
        if mode & 0o007:
            loose.append(f"{os.path.relpath(path, root)} {mode:04o}")
    if loose:
        return [Finding("  permissions", FAIL, "others may reach the card (" + ", ".join(loose) + "): it holds every "
                        "tenant's KV", f"chmod -R o-rwx {root} (the gateway keeps {want:04o}/{want & 0o640:04o})")]
    return [Finding("  permissions", OK, "no access for others" + (f"; group {h.config.card_group}"
                                                                   if h.config.card_group else ""))]
