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

Here: how keys name their namespace, quotas by namespace id, and what a card reports per
namespace (``TenantUsage``). The per-card ledger itself (bytes, objects, LRU order per
namespace) is the fs card's index (``cards/fs/index.py``), kept under the card's lock.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from adpkv_core.keys import namespace_id

NS_ID = slice(1, 9)    # where a key holds its namespace's id


def tenant_of(key: bytes) -> bytes:
    """The namespace id of an object or fragment key."""
    return key[NS_ID]


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
