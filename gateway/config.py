"""Gateway settings: YAML keys as in the gateway specification, or flags.

Sizes are plain byte counts (a unit is not read in YAML). Every key can also be
given as a flag, ``--storage-devices``, ``--port`` and so on; flags win.

Contract: every setting is read and checked here, once, before anything else happens
(``from_args``, ``make_config``; ``load_yaml`` for the file). A setting that cannot be used
raises ``ConfigError`` (a ``ValueError``): one line naming where it was read (the YAML file,
or the flag), the setting, the value and what it allows, with "did you mean" for a
misspelt key. Each number is checked against its range (``RANGES``: every int and float
setting has one) and each word against its choices (``CHOICES``); a bool, float or list
given for an integer is refused, never truncated. Nothing here touches the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import pwd
from typing import Any, Mapping, NamedTuple, Optional, Union

import yaml

from adpkv_core.settings import parse_bool, parse_pairs, parse_size

from adpkv_gateway.cards.quotas import tenant_id


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
    previous_key_layout_fingerprint: str = ""  # a card-set change: the layout the cards record (gateway/layout/record.py)
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
    control_socket: str = ""                 # the door (Unix socket); "": adpkv_core.wire.door.door_path
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
        """Check every setting (``ConfigError`` naming the first that cannot be used); the
        automatic ``thread_pool_size`` is resolved here."""
        for name, rule in RANGES.items():
            _check_range(name, getattr(self, name), rule)
        for name, choices in CHOICES.items():
            if str(getattr(self, name)).upper() not in {c.upper() for c in choices}:
                raise ConfigError(name, f"{getattr(self, name)!r} is not one of {', '.join(choices)}")
        if not self.storage_devices:
            raise ConfigError("storage_devices", "lists no card")
        if self.thread_pool_size == 0:
            self.thread_pool_size = default_io_threads()
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError("metrics_port", f"must differ from port (the control port; both are {self.port})")
        if self.previous_key_layout_fingerprint and not _is_fingerprint(self.previous_key_layout_fingerprint):
            raise ConfigError("previous_key_layout_fingerprint",
                              f"{self.previous_key_layout_fingerprint!r} is not 16 hex digits (a key layout fingerprint)")
        if self.key_layout_fingerprint and not _is_fingerprint(self.key_layout_fingerprint):
            raise ConfigError("key_layout_fingerprint",
                              f"{self.key_layout_fingerprint!r} is not 16 hex digits (a key layout fingerprint)")
        try:
            mode = int(self.control_socket_mode, 8)
        except ValueError:
            mode = -1
        if not 0 <= mode <= 0o777:
            raise ConfigError("control_socket_mode", f"{self.control_socket_mode!r} is not octal permissions "
                              "within 0000..0777, like '0660'")
        if not self.eviction_ratio < self.eviction_watermark:
            raise ConfigError("eviction_ratio", f"{self.eviction_ratio} must be below eviction_watermark "
                              f"({self.eviction_watermark}): the card evicts down to watermark - ratio")
        if self.card_group and not self.card_group.strip():
            raise ConfigError("card_group", "must name a group (or be empty)")
        for name, parse in (("namespace_quotas", parse_quotas), ("namespace_owners", parse_owners)):
            try:
                setattr(self, name, parse(getattr(self, name)))
            except ValueError as exc:
                raise ConfigError(name, _without_name(str(exc), name)) from None
        if self.shared_storage and self.start_clean:
            raise ConfigError("start_clean", "1 with shared_storage: true would delete other deployments' "
                              "keys; refusing to start")
        return self


class ConfigError(ValueError):
    """A setting that cannot be used, in one line: ``FILE: setting: what is wrong and what it
    allows``, ``setting (--flag): ...`` for a flag, ``FILE: what is wrong`` for the file itself
    (``setting`` empty). ``where`` (the file, or the flag) is added by ``located``."""

    def __init__(self, setting: str, problem: str, where: str = ""):
        self.setting, self.problem, self.where = setting, problem, where
        if where.startswith("--"):
            text = f"{setting} ({where}): {problem}"
        else:
            text = ": ".join(part for part in (where, setting, problem) if part)
        super().__init__(" ".join(text.splitlines()))        # one line, whatever a value held

    def located(self, where: str) -> "ConfigError":
        """The same error, naming where the setting was read."""
        return ConfigError(self.setting, self.problem, where)


class Range(NamedTuple):
    """What a number setting allows: ``low`` (exclusive when ``above``) up to ``high`` (None:
    no bound), and what it is."""
    low: float
    high: Optional[float] = None
    what: str = ""
    above: bool = False

    def allows(self, value: float) -> bool:
        low_ok = value > self.low if self.above else value >= self.low
        return math.isfinite(value) and low_ok and (self.high is None or value <= self.high)

    def text(self) -> str:
        low = _number(self.low) if self.low < (1 << 20) else f"{self.low / (1 << 20):g} MiB"
        span = (f"> {low}" if self.above else f">= {low}") if self.high is None else f"{low}..{_number(self.high)}"
        return f"{self.what}, {span}" if self.what else span


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# Every int and float setting and what it allows (tests/core/ops/test_config_errors.py checks
# that none is missing).
RANGES: dict[str, Range] = {
    "storage_slots": Range(1, None, "slots of the key distribution"),
    "num_dbs": Range(1, 1000, "databases per card (db000..db999)"),
    "move_rate_bytes": Range(1, None, "bytes per second"),
    "start_clean": Range(0, 1, "0 or 1"),
    "fragment_size": Range(0, None, "bytes (0: never split)"),
    "replicas": Range(1, None, "cards per object"),
    "io_timeout_ms": Range(0, None, "milliseconds (0: none)"),
    "io_timeout_strikes": Range(1, None, "commands in a row"),
    "resp_wait_ms": Range(0, None, "milliseconds (0: off)"),
    "metrics_port": Range(0, 65535, "a TCP port (0: off)"),
    "port": Range(1, 65535, "a TCP port"),
    "door_connections_per_user": Range(1, None, "connections"),
    "door_handshake_s": Range(0, None, "seconds", above=True),
    "shared_memory_size": Range(1 << 20, None, "bytes of the ring"),
    "thread_pool_size": Range(0, None, "threads (0: auto)"),
    "io_processes": Range(0, None, "processes (0: none)"),
    "capacity_bytes": Range(0, None, "bytes (0: the file system's free space)"),
    "eviction_watermark": Range(0, 1, "a fraction of capacity", above=True),
    "eviction_ratio": Range(0, 1, "a fraction of capacity"),
    "engine_timeout_s": Range(0, None, "seconds", above=True),
}

# settings that are a number of bytes: an integer or a number with a unit (512MiB, 6GiB: parse_size)
SIZES = frozenset(("move_rate_bytes", "fragment_size", "shared_memory_size", "capacity_bytes"))

CHOICES: dict[str, tuple[str, ...]] = {
    "storage_backend": ("fs", "resp"),
    "key_placement": ("dialog", "stripe"),
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}


def _check_range(name: str, value: float, rule: Range) -> None:
    if not rule.allows(value):
        raise ConfigError(name, f"{value!r} is out of range ({rule.text()})")


def _is_fingerprint(text: str) -> bool:
    return len(text) == 16 and all(ch in "0123456789abcdef" for ch in text)


def _without_name(message: str, name: str) -> str:
    """A message of a parser that already names the setting, without that name."""
    for head in (name + ": ", name + " "):
        if message.startswith(head):
            return message[len(head):]
    return message


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
    """The settings of a YAML file: ``ConfigError`` naming the file when it cannot be read, is
    not YAML, is not a mapping, or names a key that is no setting (with the setting it
    probably meant). The values are checked by ``make_config``."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError("", f"cannot read it: {exc.strerror or exc}", path) from None
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"not UTF-8 text (byte {exc.start})", path) from None
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {_yaml_problem(exc)}", path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"the top level must be a mapping of settings (key: value), not a "
                          f"{type(data).__name__}", path)
    unknown = [k for k in data if k not in _fields()]
    if unknown:
        raise ConfigError(_key_text(unknown[0]), unknown_setting(unknown[0], _fields()), path)
    return data


def _key_text(key: Any) -> str:
    """A key as an error names it: as written when it is a plain word, else quoted."""
    text = str(key)
    return text if text and text.isprintable() and text.strip() == text else repr(key)


def unknown_setting(key: Any, known) -> str:
    """Why ``key`` is refused: no such setting, and the one it probably meant."""
    near = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return "unknown setting" + (f" (did you mean {near[0]}?)" if near else
                                " (adpkv-gateway --help lists every setting)")


def _yaml_problem(exc: Exception) -> str:
    """A YAML parser error in one line: where and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


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
    "port": "control port (ZeroMQ); also names the door adpkv-<port>.sock in /run/adpkv (root) or "
            "/dev/shm/adpkv-<uid> (another user)",
    "bind_address": "address the control port binds to",
    "control_socket": "the door: the Unix socket where local processes get a session (empty: from port, in "
                      "the gateway's user's door directory)",
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
        elif name in SIZES:        # a number of bytes, with or without a unit: checked by make_config
            parser.add_argument(flag, default=None, metavar="BYTES", help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, default=None, type=kind, metavar=kind.__name__.upper(), help=text)


def from_args(args: argparse.Namespace) -> GatewayConfig:
    """Settings from ``--config`` overlaid with the flags that were given; ``ConfigError``
    names the file or the flag of a setting that cannot be used."""
    path = getattr(args, "config", None)
    values: dict[str, Any] = load_yaml(path) if path else {}
    flags = set()
    for name in _fields():
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
            flags.add(name)
    try:
        return make_config(values)
    except ConfigError as exc:
        if exc.setting in flags:
            raise exc.located("--" + exc.setting.replace("_", "-")) from None
        raise (exc.located(path) if path else exc) from None


def from_yaml(path: str) -> GatewayConfig:
    """The settings of a YAML file alone (what the operator CLI reads of the gateway's file);
    ``ConfigError`` names the file."""
    try:
        return make_config(load_yaml(path))
    except ConfigError as exc:
        raise (exc if exc.where else exc.located(path)) from None


def make_config(values: Optional[dict] = None) -> GatewayConfig:
    """The settings of ``values`` (setting -> value), converted and checked (``ConfigError``)."""
    values = dict(values or {})
    fields = _fields()
    unknown = [k for k in values if k not in fields]
    if unknown:
        raise ConfigError(_key_text(unknown[0]), unknown_setting(unknown[0], fields))
    for name, v in list(values.items()):
        values[name] = _convert(name, str(fields[name].type), v)
    return GatewayConfig(**values).validate()


def _convert(name: str, kind: str, v: Any) -> Any:
    """One setting's value as its field's type; ``ConfigError`` for a value of another kind
    (never a silent truncation: 5.5 is no int, true no port)."""
    if kind == "bool":
        try:
            return parse_bool(v, name)
        except ValueError:
            raise ConfigError(name, f"{v!r} is not a boolean (true/false, 1/0, yes/no, on/off)") from None
    if kind == "int" and name in SIZES:
        try:
            return parse_size(v)
        except ValueError as exc:
            rule = RANGES.get(name)
            raise ConfigError(name, f"{exc} ({rule.text() if rule else 'bytes'})") from None
    if kind == "int":
        rule = RANGES.get(name)
        if isinstance(v, bool) and rule is not None and (rule.low, rule.high) == (0, 1):
            return int(v)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
            return int(v.strip())
        raise ConfigError(name, f"{v!r} is not an integer ({rule.text() if rule else 'a whole number'})")
    if kind == "float":
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
        rule = RANGES.get(name)
        raise ConfigError(name, f"{v!r} is not a number ({rule.text() if rule else 'a number'})")
    if kind == "list":              # storage_devices: one device, or a list of them
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(d, str) and d.strip() for d in items):
            raise ConfigError(name, f"{v!r} is not a list of devices (directories or redis:// URLs)")
        return items
    if kind == "dict":
        return v                    # namespace_quotas, namespace_owners: their own parsers (validate)
    if name == "control_socket_mode" and isinstance(v, int) and not isinstance(v, bool):
        raise ConfigError(name, f"{v!r} is a number: write the mode quoted, as octal digits like '0660' "
                          "(YAML reads 0660 unquoted as the number 432)")
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ConfigError(name, f"{v!r} is not a string")
    return str(v)


# --------------------------------------------------------------------------- namespace settings
def parse_quotas(value: Union[None, str, Mapping]) -> dict[str, int]:
    """``namespace_quotas`` as given in YAML (a mapping) or as a flag (``a=1,b=2``):
    namespace -> bytes. Raises ValueError with the reason."""
    out: dict[str, int] = {}
    for name, size in parse_pairs(value, "namespace_quotas", "NAME=BYTES", "namespace to bytes"):
        if not isinstance(name, str) or not name:
            raise ValueError(f"namespace_quotas: {name!r} is not a namespace name")
        try:
            nbytes = parse_size(size)             # bytes, or a number with a unit (512MiB)
        except (TypeError, ValueError):
            raise ValueError(f"namespace_quotas: {name}={size!r} is not a byte count (e.g. 1073741824 or 1GiB)") from None
        if nbytes <= 0:
            raise ValueError(f"namespace_quotas: {name}={nbytes}: a quota must be > 0 bytes")
        tenant_id(name)      # an id: name must be well formed
        out[name] = nbytes
    return out


def parse_owners(value: Union[None, str, Mapping]) -> dict[str, list[int]]:
    """``namespace_owners`` as given in YAML (``{namespace or id:<16 hex>: [user or uid, ...]}``)
    or as a flag (``NAME=USER[+USER...][,NAME=...]``): namespace -> uids. User names are
    resolved on this host. Raises ValueError with the reason."""
    pairs = [(n, u.split("+") if isinstance(u, str) and isinstance(value, str) else u)
             for n, u in parse_pairs(value, "namespace_owners", "NAME=USER[+USER...]", "a namespace to its users")]
    out: dict[str, list[int]] = {}
    for name, users in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"namespace_owners: {name!r} is not a namespace name")
        try:
            tenant_id(name)
        except ValueError:
            raise ValueError(f"namespace_owners: {name!r} is not id: and 16 hex digits") from None
        if isinstance(users, (str, int)):
            users = [users]
        if not isinstance(users, (list, tuple)) or not users:
            raise ValueError(f"namespace_owners: {name}: give a list of users or uids")
        out[name] = sorted({_uid(name, u) for u in users})
    return out


def _uid(namespace: str, user) -> int:
    if isinstance(user, bool):
        raise ValueError(f"namespace_owners: {namespace}: {user!r} is not a user or uid")
    if isinstance(user, int) or (isinstance(user, str) and user.strip().isdigit()):
        uid = int(user)
        if not 0 <= uid < 2 ** 32 - 1:
            raise ValueError(f"namespace_owners: {namespace}: uid {uid} is out of range")
        return uid
    if isinstance(user, str) and user.strip():
        try:
            return pwd.getpwnam(user.strip()).pw_uid
        except KeyError:
            raise ValueError(f"namespace_owners: {namespace}: no user {user!r} on this host") from None
    raise ValueError(f"namespace_owners: {namespace}: {user!r} is not a user or uid")
