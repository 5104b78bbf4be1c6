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


@dataclasses.dataclass
class GatewayConfig:
    storage_backend: str = "fs"              # fs (a directory) or resp (a Redis-protocol server)
    storage_devices: list = dataclasses.field(default_factory=lambda: ["./adpkv-card"])
    storage_slots: int = 16                  # slots of the key distribution over cards
    num_dbs: int = 16                        # databases of each card
    key_placement: str = "dialog"            # dialog or stripe
    key_layout_fingerprint: str = ""         # refuse to start on another key layout
    shared_storage: bool = False             # nobody may clean
    start_clean: int = 0                     # 1: delete everything at start (refused when shared)
    fragment_size: int = 0                   # split objects larger than this (0: never)
    fragment_spread_across_dbs: bool = True
    replicas: int = 1                        # cards each object is written to (read from the first in service)
    io_timeout_ms: int = 0                   # deadline of one card command (0: none)
    io_timeout_strikes: int = 3              # commands past it in a row before a card leaves service
    status_file: str = ""                    # Prometheus text file, rewritten every second
    port: int = 5557
    bind_address: str = "127.0.0.1"
    shared_memory_size: int = 1 << 30        # bytes of the ring in /dev/shm
    io_size: int = 1 << 20                   # typical object size, for the max_parallel_ios log line
    thread_pool_size: int = 0                # card I/O threads (0: auto, see default_io_threads)
    io_processes: int = 0                    # fs card reads in this many processes (0: in the threads)
    capacity_bytes: int = 0                  # per card; 0: the free space of its file system at start
    eviction_watermark: float = 0.95         # evict when usage passes this fraction of capacity
    eviction_ratio: float = 0.10             # ... down to (watermark - ratio) of capacity
    o_direct: bool = False                   # fs card: bypass the page cache
    fsync: bool = False                      # fs card: fsync each object before it becomes visible
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
        if self.shared_memory_size < (1 << 20):
            raise ValueError("shared_memory_size must be at least 1 MiB")
        if not 0.0 < self.eviction_watermark <= 1.0 or not 0.0 <= self.eviction_ratio < self.eviction_watermark:
            raise ValueError("need 0 < eviction_watermark <= 1 and 0 <= eviction_ratio < eviction_watermark")
        if self.shared_storage and int(self.start_clean):
            raise ValueError("start_clean: 1 with shared_storage: true would delete other deployments' "
                             "keys; refusing to start")
        return self


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag for each setting."""
    parser.add_argument("--config", help="gateway YAML file")
    for name, f in _fields().items():
        flag = "--" + name.replace("_", "-")
        if name == "storage_devices":
            parser.add_argument(flag, nargs="+", default=None, help="card directories (fs) or URLs (resp)")
        elif f.type in ("bool", bool):
            parser.add_argument(flag, default=None, type=_parse_bool, metavar="{0,1}")
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, default=None, type=kind)


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
            values[name] = _parse_bool(v)
        elif kind == "int":
            values[name] = int(v)
        elif kind == "float":
            values[name] = float(v)
        elif name == "storage_devices" and isinstance(v, str):
            values[name] = [v]
    return GatewayConfig(**values).validate()


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return bool(v)
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {v!r}")
