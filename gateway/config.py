"""Gateway settings: YAML keys as in the gateway specification, or flags.

Sizes are plain byte counts (a unit is not read in YAML). Every key can also be
given as a flag, ``--storage-devices``, ``--port`` and so on; flags win.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Optional

import yaml

from adpkv_core.settings import parse_bool

from .namespaces import parse_owners
from .quotas import parse_quotas


@dataclasses.dataclass
class GatewayConfig:
    # A statement of intent, checked: each device's form gives its card's kind; ``resp`` makes a
    # device that is not a redis:// or redis+cluster:// URL an error (never a directory by mistake)
    storage_backend: str = "fs"
    storage_devices: list = dataclasses.field(default_factory=lambda: ["./adpkv-card"])
    storage_slots: int = 16                  # slots of the key distribution over cards
    num_dbs: int = 16                        # databases of each card
    key_placement: str = "dialog"            # dialog or stripe
    key_layout_fingerprint: str = ""         # refuse to start on another key layout
    previous_key_layout_fingerprint: str = ""  # a card-set change: the layout the cards record (gateway/layout_record.py)
    move_rate_bytes: int = 64 << 20          # a card-set change: bytes per second the mover moves at most
    shared_storage: bool = False             # nobody may clean
    start_clean: int = 0                     # 1: delete everything at start (refused when shared)
    fragment_size: int = 0                   # split objects larger than this (0: never)
    fragment_spread_across_dbs: bool = True
    replicas: int = 1                        # cards each object is written to (read from the first in service)
    io_timeout_ms: int = 0                   # deadline of one card command (0: none)
    io_timeout_strikes: int = 3              # commands past it in a row before a card leaves service
    resp_wait_ms: int = 0                    # cluster cards: WAIT 1 <ms> after each object (0: off)
    status_file: str = ""                    # Prometheus text file, rewritten every second
    metrics_port: int = 0                    # serve /metrics over HTTP on this port (0: off)
    metrics_address: str = "127.0.0.1"       # ... on this address (0.0.0.0: every interface, e.g. in a pod)
    port: int = 5557
    bind_address: str = "127.0.0.1"
    control_socket: str = ""                 # the door (Unix socket); "": /dev/shm/adpkv-<port>.sock
    control_socket_mode: str = "0660"        # its permissions (octal): who may use the gateway at all
    control_socket_group: str = ""           # its group (name or gid); "": the gateway's own
    operator_group: str = ""                 # members may CLEAN (root and the gateway's user always may)
    door_connections_per_user: int = 256     # door connections one user may hold (not root, ours, the engine's)
    door_handshake_s: float = 10.0           # a door connection must get a session and use it within this
    shared_memory_size: int = 1 << 30        # bytes of the ring in /dev/shm
    thread_pool_size: int = 0                # card I/O threads (0: auto, see default_io_threads)
    io_processes: int = 0                    # fs card reads in this many processes (0: in the threads)
    capacity_bytes: int = 0                  # per card; 0: the free space of its file system at start
    eviction_watermark: float = 0.95         # evict when usage passes this fraction of capacity
    eviction_ratio: float = 0.10             # ... down to (watermark - ratio) of capacity
    o_direct: bool = False                   # fs card: bypass the page cache
    fsync: bool = False                      # fs card: fsync each object before it becomes visible
    card_group: str = ""                     # fs card: share files with this group (0640/0750; else 0600/0700)
    namespace_quotas: dict = dataclasses.field(default_factory=dict)  # fs cards: namespace -> bytes per card
    namespace_owners: dict = dataclasses.field(default_factory=dict)  # namespace -> the uids it belongs to
    engine_timeout_s: float = 5.0            # a rank silent this long is detached
    log_level: str = "INFO"

    def validate(self) -> "GatewayConfig":
        if self.storage_backend not in ("fs", "resp"):
            raise ValueError(f"storage_backend must be fs or resp, not {self.storage_backend!r}")
        if not self.storage_devices:
            raise ValueError("storage_devices lists no card")
        if self.key_placement not in ("dialog", "stripe"):
            raise ValueError(f"key_placement must be dialog or stripe, not {self.key_placement!r}")
        if self.storage_slots < 1 or self.num_dbs < 1 or self.thread_pool_size < 0:
            raise ValueError("storage_slots and num_dbs must be >= 1, thread_pool_size >= 0")
        if self.thread_pool_size == 0:
            self.thread_pool_size = default_io_threads()
        if self.io_processes < 0:
            raise ValueError("io_processes must be >= 0")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.fragment_size < 0:
            raise ValueError("fragment_size must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be 0 (off) or a TCP port")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError("metrics_port must differ from port (the control port)")
        if self.move_rate_bytes < 1:
            raise ValueError("move_rate_bytes must be >= 1 (bytes per second the mover moves at most)")
        if self.previous_key_layout_fingerprint and not (
                len(self.previous_key_layout_fingerprint) == 16
                and all(ch in "0123456789abcdef" for ch in self.previous_key_layout_fingerprint)):
            raise ValueError("previous_key_layout_fingerprint must be 16 hex digits (a key layout fingerprint)")
        if self.resp_wait_ms < 0:
            raise ValueError("resp_wait_ms must be >= 0 (0: no WAIT after writes)")
        try:
            mode = int(str(self.control_socket_mode), 8)
        except ValueError:
            raise ValueError(f"control_socket_mode must be octal permissions like 0660, "
                             f"not {self.control_socket_mode!r}") from None
        if not 0 <= mode <= 0o777:
            raise ValueError("control_socket_mode must be within 0000..0777")
        if self.door_connections_per_user < 1:
            raise ValueError("door_connections_per_user must be >= 1")
        if not self.door_handshake_s > 0:
            raise ValueError("door_handshake_s must be a number of seconds > 0")
        if self.shared_memory_size < (1 << 20):
            raise ValueError("shared_memory_size must be at least 1 MiB")
        if not 0.0 < self.eviction_watermark <= 1.0 or not 0.0 <= self.eviction_ratio < self.eviction_watermark:
            raise ValueError("need 0 < eviction_watermark <= 1 and 0 <= eviction_ratio < eviction_watermark")
        if self.card_group and not self.card_group.strip():
            raise ValueError("card_group must name a group (or be empty)")
        self.namespace_quotas = parse_quotas(self.namespace_quotas)
        self.namespace_owners = parse_owners(self.namespace_owners)
        if self.shared_storage and int(self.start_clean):
            raise ValueError("start_clean: 1 with shared_storage: true would delete other deployments' "
                             "keys; refusing to start")
        return self


def socket_mode(config: GatewayConfig) -> int:
    """The door's permission bits (``control_socket_mode`` is written in octal)."""
    return int(str(config.control_socket_mode), 8)


def default_io_threads() -> int:
    """Card I/O threads when not configured: two per core, 4 to 16. More threads than that
    only fight over the GIL (measured: 16 threads on 2 cores read the page cache 30 % slower
    than 4); use ``io_processes`` to scale reads further on a many-core host."""
    return max(4, min(16, 2 * (os.cpu_count() or 2)))


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(GatewayConfig)}


def load_yaml(path: str) -> dict:
    """The settings of a YAML file; unknown keys are an error."""
    with open(path, "r", encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    unknown = sorted(set(data) - set(_fields()))
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    return data


# One line of ``adpkv-gateway --help`` per setting (the default is appended). A setting
# missing here still gets its flag, with its default only; tests/core/ops/test_cli_edges.py
# checks that every setting has a line.
HELP: dict[str, str] = {
    "storage_backend": "the intended card kind, checked: resp refuses a device that is not a redis:// or "
                       "redis+cluster:// URL (each device's form gives its card's kind; fs checks nothing)",
    "storage_devices": "the cards: directories (fs) or redis:// / redis+cluster:// URLs (resp)",
    "storage_slots": "slots of the key distribution over the cards",
    "num_dbs": "databases of each card (fragments spread over them)",
    "key_placement": "dialog (a dialog's blocks on one card) or stripe (spread over all cards)",
    "key_layout_fingerprint": "refuse to start unless the key layout has this fingerprint (empty: any)",
    "previous_key_layout_fingerprint": "with key_layout_fingerprint: the layout a card-set change moves from",
    "move_rate_bytes": "bytes per second the mover moves at most during a card-set change",
    "shared_storage": "the cards are shared with other deployments: nobody may clean",
    "start_clean": "1: delete every object at start (refused with shared_storage)",
    "fragment_size": "split objects larger than this many bytes into fragments (0: never)",
    "fragment_spread_across_dbs": "put the fragments of one object in different databases",
    "replicas": "cards each object is written to (read from the first one in service)",
    "io_timeout_ms": "deadline of one card command in ms (0: none)",
    "io_timeout_strikes": "commands in a row past the deadline or failing before a card leaves service",
    "resp_wait_ms": "redis+cluster:// cards: after each object, WAIT 1 <ms> for a replica to hold it; "
                    "an object no replica acknowledged in time is reported not stored (0: off)",
    "status_file": "Prometheus text file rewritten every second (empty: none)",
    "metrics_port": "serve the same metrics at http://metrics_address:metrics_port/metrics (0: off)",
    "metrics_address": "address the /metrics endpoint listens on (0.0.0.0: every interface)",
    "port": "control port (ZeroMQ); also names the door /dev/shm/adpkv-<port>.sock",
    "bind_address": "address the control port binds to",
    "control_socket": "the door: the Unix socket where local processes get a session (empty: from port)",
    "control_socket_mode": "the door's permissions, octal: who may use the gateway at all",
    "control_socket_group": "the door's group, name or gid (empty: the gateway's own group)",
    "operator_group": "members may clean the cards (root and the gateway's user always may)",
    "door_connections_per_user": "door connections one local user may hold open (root, the gateway's user and "
                                 "the attached engine's user are never refused for room)",
    "door_handshake_s": "seconds a door connection has to ask for a session, and then to use it on the control "
                        "port, before it is closed",
    "shared_memory_size": "bytes of the shared-memory ring",
    "thread_pool_size": "card I/O threads (0: two per core, 4 to 16)",
    "io_processes": "fs card reads run in this many processes (0: in the I/O threads)",
    "capacity_bytes": "capacity of each card in bytes (0: the free space of its file system at start)",
    "eviction_watermark": "evict (LRU) when usage passes this fraction of capacity",
    "eviction_ratio": "... down to (eviction_watermark - eviction_ratio) of capacity",
    "o_direct": "fs card: bypass the page cache (O_DIRECT)",
    "fsync": "fs card: fsync each object before it becomes visible",
    "engine_timeout_s": "seconds without a heartbeat before a rank is detached",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "card_group": "fs card: share its files with this group (0640/0750; empty: 0600/0700, owner only)",
    "namespace_quotas": "fs cards: bytes each key namespace may hold per card, NAME=BYTES[,NAME=BYTES] "
                        "(YAML: a mapping); over it a namespace evicts its own least recently used objects",
    "namespace_owners": "the users (names or uids) a key namespace belongs to, NAME=USER[+USER...][,NAME=...] "
                        "(YAML: {name: [users]}); a namespace not named belongs to the uid that first used it",
}


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        value = f.default
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if value == "" else str(value)


def _bool_flag(name: str):
    def parse(text: str) -> bool:
        try:
            return parse_bool(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = "boolean"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag for each setting (flags win over the YAML)."""
    parser.add_argument("--config", metavar="YAML", help="gateway YAML file (keys as below; flags win)")
    for name, f in _fields().items():
        flag = "--" + name.replace("_", "-")
        text = f"{HELP.get(name, name)} (default: {_default_text(f)})".replace("%", "%%")
        if name == "storage_devices":
            parser.add_argument(flag, nargs="+", default=None, metavar="DEV", help=text)
        elif name == "namespace_quotas":
            parser.add_argument(flag, default=None, metavar="NAME=BYTES,...", help=text)
        elif name == "namespace_owners":
            parser.add_argument(flag, default=None, metavar="NAME=USER+USER,...", help=text)
        elif f.type in ("bool", bool):
            parser.add_argument(flag, default=None, type=_bool_flag(name), metavar="BOOL", help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, default=None, type=kind, metavar=kind.__name__.upper(), help=text)


def from_args(args: argparse.Namespace) -> GatewayConfig:
    """Settings from ``--config`` overlaid with the flags that were given."""
    values: dict[str, Any] = load_yaml(args.config) if getattr(args, "config", None) else {}
    for name in _fields():
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    return make_config(values)


def make_config(values: Optional[dict] = None) -> GatewayConfig:
    values = dict(values or {})
    fields = _fields()
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
    for name, v in list(values.items()):
        kind = str(fields[name].type)
        if kind == "bool":
            values[name] = parse_bool(v, name)
        elif kind in ("int", "float"):
            try:
                values[name] = int(v) if kind == "int" else float(v)
            except (TypeError, ValueError):
                raise ValueError(f"setting {name}={v!r} is not a valid {kind}") from None
        elif name == "storage_devices" and isinstance(v, str):
            values[name] = [v]
    return GatewayConfig(**values).validate()

