"""What ``adpkv doctor`` is told about the engine and the gateway (``Host``): the input of every
check (``doctor``, ``doctor_fs``)."""

from __future__ import annotations

import dataclasses
import os
import sys

from adpkv_gateway.config import GatewayConfig


@dataclasses.dataclass
class Host:
    """What the doctor is told about the engine and the gateway."""
    config: GatewayConfig
    config_given: bool = False
    port_given: bool = False           # --port given (without --config): that gateway's cards are not the default
    host: str = "127.0.0.1"
    timeout_s: float = 3.0
    engine: str = ""                   # vllm | sglang | lmcache | "" (prefix hash not checked)
    hash_algo: str = ""                # the engine's prefix hash setting ("" = its default)
    engine_user: str = ""              # who runs the engine ("" = the doctor's user)
    shm_bytes: int = 0                 # what the engine itself puts in /dev/shm
    environ: dict = dataclasses.field(default_factory=lambda: dict(os.environ))
    python: tuple = tuple(sys.version_info[:2])   # the engine's Python (the doctor runs in its environment)
