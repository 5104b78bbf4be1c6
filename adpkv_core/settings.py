"""The adapter settings shared by every engine (one vocabulary, three spellings)."""

from __future__ import annotations

import dataclasses
import os
import pwd
from typing import Any, Mapping


@dataclasses.dataclass
class ClientConfig:
    """How an adapter reaches its gateway and builds its keys.

    vLLM spells these ``adpkv.<name>`` in kv_connector_extra_config, LMCache in
    ``adapter_params`` and SGLang in the extra-config of the HiCache backend.
    """

    port: int = 5557
    host: str = "127.0.0.1"
    socket: str = ""                     # the gateway's door; "": /dev/shm/adpkv-<port>.sock
    namespace: str = ""                  # deployment namespace (required on shared cards)
    key_namespace_from_model: bool = False
    affinity_chunks: int = 1             # chunks of the prompt start that make the dialog mark
    timeout_s: float = 10.0              # a request without progress for this long turns the cache off
    connect_timeout_s: float = 3.0       # attach deadline at start
    busy_wait_s: float = 10.0            # how long to retry while another engine is still attached
    heartbeat_s: float = 1.0
    gateway_users: str = ""              # besides root and our own user: who may run our gateway (names/uids, commas)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None, prefix: str = "") -> "ClientConfig":
        """Read the known fields from a mapping (keys optionally prefixed, e.g. ``adpkv.``)."""
        settings = settings or {}
        values = {}
        for f in dataclasses.fields(cls):
            for name in (prefix + f.name, f.name) if prefix else (f.name,):
                if name in settings:
                    values[f.name] = _coerce(f.type, settings[name], name)
                    break
        env_affinity = os.environ.get("ADPKV_AFFINITY_CHUNKS")
        if "affinity_chunks" not in values and env_affinity:
            values["affinity_chunks"] = int(env_affinity)
        cfg = cls(**values)
        if cfg.affinity_chunks < 1:
            raise ValueError("affinity_chunks must be >= 1")
        if not 0 < cfg.port < 65536:
            raise ValueError(f"port {cfg.port} out of range")
        cfg.trusted_gateway_uids()        # an unknown user is an error now, not at attach
        return cfg

    def trusted_gateway_uids(self) -> frozenset[int]:
        """The uids whose gateway this client attaches to: root, this process's effective
        uid, and those ``gateway_users`` names (user names or uids, comma-separated).
        ``ValueError`` naming the setting for a user that does not exist."""
        uids = {0, os.geteuid()}
        for item in self.gateway_users.split(","):
            item = item.strip()
            if not item:
                continue
            if item.isdigit():
                uids.add(int(item))
                continue
            try:
                uids.add(pwd.getpwnam(item).pw_uid)
            except KeyError:
                raise ValueError(f"setting gateway_users: no user {item!r} on this host "
                                 "(user names or uids, comma-separated)") from None
        return frozenset(uids)


_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off"))


def parse_bool(value: Any, name: str) -> bool:
    """The one boolean reader of every adpkv setting (gateway flags and YAML, adapter settings).

    Accepts Python bools, the integers 0 and 1, and the strings true/false, 1/0, yes/no,
    on/off in any case. Anything else (a typo like ``ture``, an empty string, 2) raises
    ``ValueError`` naming the setting: a misspelt switch is an error, never a silent False.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ValueError(f"setting {name}={value!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def _coerce(type_name: Any, value: Any, name: str) -> Any:
    kind = {"int": int, "float": float, "str": str, "bool": bool}.get(str(type_name), None)
    if kind is bool:
        return parse_bool(value, name)
    try:
        return kind(value) if kind else value
    except (TypeError, ValueError):
        raise ValueError(f"setting {name}={value!r} is not a valid {type_name}") from None
