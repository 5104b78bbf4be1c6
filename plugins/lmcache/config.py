"""``AdpL2AdapterConfig``: the ``adapter_params`` of the adpkv L2 adapter.

LMCache finds this class by convention (``<class_name>Config`` in the plugin
module) and builds it with ``from_dict(adapter_params)``; on a ``ValueError``
the server prints ``help()`` and exits. The settings are the adpkv vocabulary
shared by every engine adapter (port, namespace, key_namespace_from_model,
affinity_chunks, timeouts) plus a few of this adapter's own.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from adpkv_core.settings import parse_bool, parse_number, refuse_unknown

from ._compat import L2AdapterConfigBase

AFFINITY_ENV = "LMC_ADPKV_AFFINITY_CHUNKS"
DEFAULT_NAMESPACE = "lmcache"


@dataclasses.dataclass
class _Field:
    name: str
    kind: type
    default: Any
    doc: str
    minimum: Optional[float] = None     # a number field: at least this (``above``: more than it)
    above: bool = False
    maximum: Optional[int] = None       # an int field: at most this


FIELDS: tuple[_Field, ...] = (
    _Field("port", int, 5557, "control port of the adpkv gateway", 1, maximum=65535),
    _Field("host", str, "127.0.0.1", "host of the gateway (the ring is in /dev/shm: same host only)"),
    _Field("namespace", str, DEFAULT_NAMESPACE,
           "deployment namespace of every key (required to share cards between deployments)"),
    _Field("key_namespace_from_model", bool, False,
           "derive the namespace from ObjectKey.model_name (one namespace per model) instead of `namespace`"),
    _Field("affinity_chunks", int, 1,
           f"leading chunks of a prompt that make its dialog mark (card placement); env {AFFINITY_ENV}",
           1),
    _Field("timeout_s", float, 10.0, "a request without progress this long turns the cache off", 0, above=True),
    _Field("connect_timeout_s", float, 3.0, "deadline to attach to the gateway", 0, above=True),
    _Field("heartbeat_s", float, 1.0, "ping interval while idle", 0, above=True),
    _Field("busy_wait_s", float, 10.0,
           "at attach, wait this long for a previous engine (e.g. a restarted server) to leave the gateway",
           0),
    _Field("reconnect_s", float, 5.0,
           "after the gateway stopped answering, retry attaching after this long (doubling up to 60 s; 0: never)",
           0),
    _Field("gateway_users", str, "",
           "besides root and this process's user, the users (names or uids, comma-separated) whose gateway "
           "this adapter may attach to (and in whose door directories it looks for the door)"),
    _Field("usage_refresh_s", float, 1.0, "get_usage() asks the gateway at most this often", 0),
    _Field("l1_direct", bool, True,
           "when LMCache's L1 pool is a /dev/shm file, let the gateway read and write it directly "
           "(no ring copy)"),
    _Field("mark_cache_entries", int, 1 << 20,
           "dialog marks remembered from lookups, applied to later stores/loads of the same keys", 0),
)

_BY_NAME = {f.name: f for f in FIELDS}


class AdpL2AdapterConfig(L2AdapterConfigBase):
    """Config of ``AdpL2Adapter`` (see ``help()`` for the fields)."""

    def __init__(self, **values: Any):
        for f in FIELDS:
            setattr(self, f.name, values.pop(f.name, f.default))
        if values:
            raise ValueError(f"unknown adpkv adapter_params: {', '.join(sorted(values))}")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "AdpL2AdapterConfig":
        d = dict(d or {})
        d.pop("type", None)   # present when built from a full adapter spec
        refuse_unknown(d, _BY_NAME, "adapter_params key")     # with "did you mean"
        if "affinity_chunks" not in d and os.environ.get(AFFINITY_ENV, "").strip():
            raw = os.environ[AFFINITY_ENV].strip()
            try:
                d["affinity_chunks"] = int(raw)
            except ValueError:
                raise ValueError(f"{AFFINITY_ENV}={raw!r} is not an integer") from None
        values = {}
        for name, raw in d.items():
            f = _BY_NAME[name]
            values[name] = _coerce(f, raw)
        return cls(**values)

    @classmethod
    def help(cls) -> str:
        lines = ["adpkv L2 adapter (plugin) — adapter_params fields:"]
        for f in FIELDS:
            lines.append(f"- {f.name} ({f.kind.__name__}, default {f.default!r}): {f.doc}")
        lines += [
            "",
            "Example:",
            '{"type":"plugin","module_path":"adpkv_lmcache","class_name":"AdpL2Adapter",'
            '"adapter_params":{"port":5557,"namespace":"llama-3-8b","affinity_chunks":1}}',
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ views
    def client_settings(self) -> dict:
        """The shared adpkv vocabulary, as ``adpkv_core`` ClientConfig.from_settings reads it."""
        return {"port": self.port, "host": self.host, "namespace": self.namespace,
                "key_namespace_from_model": self.key_namespace_from_model,
                "affinity_chunks": self.affinity_chunks, "timeout_s": self.timeout_s, "connect_timeout_s": self.connect_timeout_s,
                "heartbeat_s": self.heartbeat_s, "busy_wait_s": self.busy_wait_s,
                "gateway_users": self.gateway_users}

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in FIELDS}

    def __repr__(self) -> str:
        return f"AdpL2AdapterConfig({self.as_dict()})"


def _coerce(f: _Field, raw: Any) -> bool | int | float | str:
    """One adapter_params value, read by the shared parsers (``parse_bool``, ``parse_number``)."""
    if f.kind is bool:
        return parse_bool(raw, f.name)
    if f.kind is str:
        if not isinstance(raw, str):
            raise ValueError(f"{f.name} must be a string, got {raw!r}")
        return raw
    number = parse_number(raw, f.name, "seconds" if f.name.endswith("_s") else "",
                          f.minimum if f.minimum is not None else float("-inf"), f.above)
    if f.kind is float:
        return number
    if not number.is_integer() or (f.maximum is not None and number > f.maximum):
        raise ValueError(f"{f.name} must be an integer{'' if f.maximum is None else f' <= {f.maximum}'}, got {raw!r}")
    return int(number)
