"""The adapter settings shared by every engine (one vocabulary, three spellings)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import pwd
from typing import Any, Iterable, Mapping


@dataclasses.dataclass
class ClientConfig:
    """How an adapter reaches its gateway and builds its keys.

    vLLM spells these ``adpkv.<name>`` in kv_connector_extra_config, LMCache in
    ``adapter_params`` and SGLang in the extra-config of the HiCache backend.
    """

    port: int = 5557
    host: str = "127.0.0.1"
    socket: str = ""                     # the gateway's door; "": found from port (adpkv_core.wire.door.find_door)
    namespace: str = ""                  # deployment namespace (required on shared cards)
    key_namespace_from_model: bool = False
    affinity_chunks: int = 1             # chunks of the prompt start that make the dialog mark
    timeout_s: float = 10.0              # a request without progress for this long turns the cache off
    connect_timeout_s: float = 3.0       # attach deadline at start
    busy_wait_s: float = 10.0            # how long to retry while another engine is still attached
    heartbeat_s: float = 1.0
    gateway_users: str = ""              # besides root and our own user: who may run our gateway (names/uids, commas)

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The shared vocabulary every adapter reads: these fields and ``reconnect_s``
        (``adpkv_core.attachment.reconnect_setting``)."""
        return tuple(f.name for f in dataclasses.fields(cls)) + ("reconnect_s",)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None, prefix: str = "",
                      also: Iterable[str] = (), where: str = "") -> "ClientConfig":
        """Read the known fields from a mapping (keys optionally prefixed, e.g. ``adpkv.``).

        With a ``prefix``, every key that carries it is ours: one that is neither a name of
        the shared vocabulary (``setting_names``) nor one of ``also`` (the adapter's own
        settings, unprefixed names) is refused with a ``ValueError`` naming it and the near
        miss ("did you mean"): a misspelt port or namespace must never run the engine on the
        wrong gateway or in the wrong namespace. Keys without the prefix belong to the engine
        and are left alone. ``where``: what the settings are, for the message."""
        settings = settings or {}
        if prefix:
            refuse_unknown((k for k in settings if isinstance(k, str) and k.startswith(prefix)),
                           [prefix + n for n in (*cls.setting_names(), *also)],
                           where or f"{prefix}* setting")
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


def refuse_unknown(keys: Iterable[str], known: Iterable[str], what: str) -> None:
    """The one check of every adapter's settings: ``ValueError`` naming each of ``keys`` that
    is not in ``known``, with the closest known name ("did you mean") where one is near, and
    the known names. ``what``: the kind of setting, for the message (e.g. ``adpkv.* setting``)."""
    names = sorted(set(known))
    unknown = sorted(set(keys) - set(names))
    if not unknown:
        return
    parts = []
    for key in unknown:
        near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        parts.append(f"{key!r} (did you mean {near[0]!r}?)" if near else repr(key))
    raise ValueError(f"adpkv: unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; "
                     f"known: {', '.join(names)}")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
               "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9,
               "tb": 10 ** 12}


def parse_size(value: Any) -> int:
    """A number of bytes as every adpkv setting writes it: an integer, or a string of a number
    and a unit (``512MiB``, ``6 GiB``, ``1.5G``; KiB/MiB/GiB/TiB and K/M/G/T are powers of
    1024, KB/MB/GB/TB of 1000). ``ValueError`` for anything else (a fraction of a byte, a bool,
    an unknown unit)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number of bytes")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        number = text.rstrip("bBkKmMgGtTiI ").strip()
        unit = text[len(number):].strip().lower()
        if unit in _SIZE_UNITS and number:
            try:
                scaled = float(number) * _SIZE_UNITS[unit] if not number.lstrip("+-").isdigit() \
                    else int(number) * _SIZE_UNITS[unit]
            except ValueError:
                scaled = None
            if scaled is not None and float(scaled).is_integer():
                return int(scaled)
    raise ValueError(f"{value!r} is not a number of bytes (an integer, or a number with a unit: "
                     "512MiB, 6GiB, 1.5G)")


def parse_number(value: Any, name: str, unit: str = "", minimum: float = 0.0, above: bool = False) -> float:
    """The one reader of every adpkv setting that is a number (of ``unit``: "seconds", ...): an
    int, a float or a string of one, never a bool, of at least ``minimum`` (``above``: more than
    it). ``ValueError`` naming ``name`` and what it must be."""
    must = f"a number{' of ' + unit if unit else ''} {'>' if above else '>='} {minimum:g}"
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {must}, got {value!r}") from None
    if not (number > minimum if above else number >= minimum):          # NaN too
        raise ValueError(f"{name} must be {must}, got {value!r}")
    return number


def parse_byte_count(value: Any, name: str) -> int:
    """A setting that is a number of bytes >= 0 (``parse_size``: an integer, or a number with a
    unit). ``ValueError`` naming ``name``."""
    try:
        nbytes = parse_size(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of bytes (an integer, or a number with a "
                         "unit: 512MiB, 6GiB)") from None
    if nbytes < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")
    return nbytes


_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off"))


def parse_pairs(value: Any, name: str, form: str, maps: str) -> list[tuple[Any, Any]]:
    """A setting that maps names to values, as YAML gives it (a mapping) or as a flag
    (``NAME=VALUE[,NAME=VALUE...]``): its pairs as given, in order (each pair's checks are the
    caller's); none for an empty value. ``form``: how one item of the flag reads (e.g.
    ``NAME=BYTES``), ``maps``: what the mapping holds (e.g. ``namespace to bytes``), both for
    the ValueError naming ``name``."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        pairs: list[tuple[Any, Any]] = []
        for item in value.split(","):
            key, sep, val = item.strip().rpartition("=")
            if not sep or not key:
                raise ValueError(f"{name}: {item.strip()!r} is not {form}")
            pairs.append((key, val))
        return pairs
    if isinstance(value, Mapping):
        return list(value.items())
    raise ValueError(f"{name} must map {maps}, not {type(value).__name__}")


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
    if kind is float:          # every float of ClientConfig is a time
        return parse_number(value, name, "seconds")
    try:
        return kind(value) if kind else value
    except (TypeError, ValueError):
        raise ValueError(f"setting {name}={value!r} is not a valid {type_name}") from None
