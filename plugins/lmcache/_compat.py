"""Which LMCache we run against, and the few names whose home moved between releases.

adpkv_lmcache targets the L2 adapter interface of lmcache 0.5.x. What changed
on the way there (see docs/lmcache.md):

- 0.4.1 has no ``plugin`` adapter type, store results are ``dict[id, bool]``
  and there is no usage accounting nor ``cache_salt``;
- 0.4.7 has the plugin type and ``L2StoreResult`` but ``Bitmap`` lives in
  ``lmcache.native_storage_ops`` and a lookup takes only the keys;
- 0.5.0 passes one ``MemoryLayoutDesc`` to a lookup, 0.5.6 a dict of them per
  object group;
- 0.5.7 adds the abstract ``get_memory_tags()`` (``MemoryTags(segment, residency)``, for
  prefetch filtering and L1-L2 affinity) and ``submit_touch(keys)`` to the adapter base:
  an adapter without ``get_memory_tags`` does not instantiate there. Ours has both; on
  0.5.6 (no ``MemoryTags``) nothing calls them.

We accept the second lookup argument in any of these shapes and ignore it, and
refuse any LMCache outside 0.5.x with a clear message rather than misbehave.
"""

from __future__ import annotations

SUPPORTED = ((0, 5), (0, 6))   # [min, max)


def lmcache_version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # pragma: no cover - editable/dev installs without metadata
        try:
            from lmcache._version import __version__

            return str(__version__)
        except Exception:
            return "unknown"


def _parse(v: str) -> tuple[int, int]:
    parts = []
    for piece in v.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


def check_lmcache_version(v: str | None = None) -> str:
    """Raise ImportError unless ``v`` (default: the installed lmcache) is supported."""
    v = v or lmcache_version()
    if v == "unknown":
        return v
    mm = _parse(v)
    if not SUPPORTED[0] <= mm < SUPPORTED[1]:
        raise ImportError(
            f"adpkv_lmcache supports lmcache >=0.5,<0.6 (the 0.5 L2 adapter interface); found lmcache {v}. "
            "Install lmcache 0.5.x (pip install 'adpkv[lmcache]') or use the adpkv release that matches "
            "your LMCache.")
    return v


LMCACHE_VERSION = check_lmcache_version()

try:  # 0.5.x
    from lmcache.lmcache_native import Bitmap  # noqa: F401
except ImportError:  # pragma: no cover - older 0.5 builds
    from lmcache.native_storage_ops import Bitmap  # noqa: F401

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402,F401
from lmcache.v1.distributed.internal_api import L2StoreResult  # noqa: E402,F401
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId  # noqa: E402,F401
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase  # noqa: E402,F401
from lmcache.v1.platform import create_event_notifier  # noqa: E402,F401

try:  # 0.5.7: the memory tags of an L1 manager or L2 adapter
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags
except ImportError:  # 0.5.6: no memory tags; get_memory_tags is never called
    MemoryResidency = MemorySegment = MemoryTags = None


def memory_tags(shared: bool):
    """The ``MemoryTags`` of an adpkv gateway's objects: segment ``STORAGE`` (its cards: files,
    Redis servers), residency ``REMOTE`` when ``shared`` (the adapter spec's ``"shared": true``:
    cards shared with other hosts, LMCache's "a domain shared with other hosts", as its fs adapter
    answers) else ``LOCAL`` (the gateway runs on this host). Only on LMCache >= 0.5.7."""
    if MemoryTags is None:
        raise NotImplementedError(f"lmcache {LMCACHE_VERSION} has no MemoryTags (LMCache >= 0.5.7 asks for them)")
    return MemoryTags(MemorySegment.STORAGE, MemoryResidency.REMOTE if shared else MemoryResidency.LOCAL)
