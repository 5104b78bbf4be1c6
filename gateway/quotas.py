"""Tenant quotas: bytes per namespace on a card, each namespace with its own LRU.

A tenant is a key namespace (``adpkv_core.keys``): every key carries the 8-byte id of
its namespace (bytes 1..8), so the gateway knows each object's tenant without being
told. ``namespace_quotas`` (YAML mapping ``namespace: bytes``, or the flag
``--namespace-quotas NAME=BYTES[,NAME=BYTES]``) caps what a namespace may hold on each
card. A write that would take its namespace past the quota first evicts that
namespace's own least recently used objects (never another's, never a pinned one, never
the object being written); if that cannot make room, the write is refused (not stored).
An evicted object is a miss, as after any eviction.

A namespace is named as the keys' namespace: the adapter's ``namespace`` setting when
it derives nothing, else ``model-<hash>`` (``key_namespace``: vLLM's offloading and tier
paths, SGLang, ``key_namespace_from_model``), which a quota can also name by its id as
``adpkv usage`` shows it: ``id:<16 hex digits>``.

A ``cache_salt`` is no tenant here: vLLM, SGLang and LMCache fold it into the chunk hash
the key is built from, so the gateway cannot tell salts apart. Tenants that need quotas
get their own namespace (the adapters' ``namespace`` setting).

``TenantBook`` is the per-card ledger: what each namespace holds (bytes, objects, LRU
order) and what it may hold. The card keeps it under its own lock; nothing here locks.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional, Union

from adpkv_core.keys import namespace_id
from adpkv_core.settings import parse_size

NS_ID = slice(1, 9)    # where a key holds its namespace's id


def tenant_of(key: bytes) -> bytes:
    """The namespace id of an object or fragment key."""
    return key[NS_ID]


def parse_quotas(value: Union[None, str, Mapping]) -> dict[str, int]:
    """``namespace_quotas`` as given in YAML (a mapping) or as a flag (``a=1,b=2``):
    namespace -> bytes. Raises ValueError with the reason."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        pairs = []
        for item in value.split(","):
            name, sep, size = item.strip().rpartition("=")
            if not sep or not name:
                raise ValueError(f"namespace_quotas: {item.strip()!r} is not NAME=BYTES")
            pairs.append((name, size))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        raise ValueError(f"namespace_quotas must map namespace to bytes, not {type(value).__name__}")
    out: dict[str, int] = {}
    for name, size in pairs:
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


ID_PREFIX = "id:"      # a namespace named by its id as ``adpkv usage`` shows it: id:<16 hex digits>


def tenant_id(name: str) -> bytes:
    """The namespace id keys carry for a namespace name, or for ``id:<16 hex digits>``."""
    if name.startswith(ID_PREFIX):
        try:
            tid = bytes.fromhex(name[len(ID_PREFIX):])
        except ValueError:
            tid = b""
        if len(tid) != 8:
            raise ValueError(f"namespace_quotas: {name!r} is not id: and 16 hex digits")
        return tid
    return namespace_id(name)


def quotas_by_id(quotas: Mapping[str, int]) -> dict[bytes, int]:
    """Namespace quotas keyed by the namespace id that keys carry."""
    return {tenant_id(name): nbytes for name, nbytes in quotas.items()}


@dataclasses.dataclass
class TenantUsage:
    """One namespace on one card (what STATS reports)."""
    tenant: str              # the namespace id, hex (names are the gateway's to resolve)
    used_bytes: int
    objects: int
    quota_bytes: int         # 0: no quota (only the card's capacity binds it)
    evicted: int             # objects evicted because this namespace was over its quota
    capacity_evicted: int = 0   # objects the card's own LRU evicted (the card past its watermark)


class Tenant:
    """What one namespace holds on a card: bytes on disk, its objects in LRU order."""

    __slots__ = ("used", "lru", "quota", "evicted", "capacity_evicted")

    def __init__(self, quota: int):
        self.used = 0
        self.lru: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()
        self.quota = quota
        self.evicted = 0
        self.capacity_evicted = 0


class TenantBook:
    """The tenants of one card. The card calls it under its own lock: bytes charged to an
    object's namespace (``charge``, also for a write in flight), an object written or used
    (``enter``: last in its namespace's LRU), an object gone (``forget``)."""

    def __init__(self, quotas: Optional[Mapping[bytes, int]] = None):
        self.quotas = dict(quotas or {})
        self._tenants: dict[bytes, Tenant] = {}

    def _get(self, tid: bytes) -> Tenant:
        t = self._tenants.get(tid)
        if t is None:
            t = self._tenants[tid] = Tenant(self.quotas.get(tid, 0))
        return t

    def charge(self, okey: bytes, nbytes: int) -> None:
        """``nbytes`` (negative: fewer) more on disk for the object's namespace."""
        self._get(tenant_of(okey)).used += nbytes

    def enter(self, okey: bytes) -> None:
        """The object is stored and was just written or used: last in its namespace's LRU."""
        lru = self._get(tenant_of(okey)).lru
        lru[okey] = None
        lru.move_to_end(okey)

    def forget(self, okey: bytes, nbytes: int) -> None:
        """The object (``nbytes`` on disk) left the card."""
        t = self._tenants.get(tenant_of(okey))
        if t is not None:
            t.used -= nbytes
            t.lru.pop(okey, None)

    def clear(self) -> None:
        """The card was emptied (quotas and eviction counts stay)."""
        for t in self._tenants.values():
            t.used = 0
            t.lru.clear()

    def over_by(self, tid: bytes, nbytes: int) -> int:
        """How many bytes namespace ``tid`` must free to take ``nbytes`` more (0: none)."""
        quota = self.quotas.get(tid, 0)
        if not quota:
            return 0
        t = self._tenants.get(tid)
        return max(0, (t.used if t is not None else 0) + nbytes - quota)

    def oldest(self, tid: bytes) -> list[bytes]:
        """Namespace ``tid``'s objects, least recently used first."""
        t = self._tenants.get(tid)
        return list(t.lru) if t is not None else []

    def count_eviction(self, tid: bytes, over_quota: bool = True) -> None:
        """One of namespace ``tid``'s objects evicted: for its quota, or by the card's LRU."""
        t = self._get(tid)
        if over_quota:
            t.evicted += 1
        else:
            t.capacity_evicted += 1

    def usage(self) -> list[TenantUsage]:
        """Every namespace the card holds or has a quota for."""
        tids = set(self.quotas) | {tid for tid, t in self._tenants.items()
                                   if t.lru or t.used or t.evicted or t.capacity_evicted}
        out = []
        for tid in tids:
            t = self._tenants.get(tid)
            out.append(TenantUsage(tid.hex(), t.used if t else 0, len(t.lru) if t else 0,
                                   self.quotas.get(tid, 0), t.evicted if t else 0,
                                   t.capacity_evicted if t else 0))
        return sorted(out, key=lambda u: u.tenant)
