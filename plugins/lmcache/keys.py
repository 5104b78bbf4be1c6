"""LMCache ObjectKey → adpkv key, and the dialog marks that place a dialog on one card.

An LMCache object is one chunk of one object group (``object_group_id``) of
one KV slice (``kv_rank``) of a model, for one tenant (``cache_salt``). Its
adpkv key is ``KeyBuilder(namespace).key(digest, layer=0)`` where ``digest``
is a 16-byte blake2b over all five fields, length-prefixed so no two field
combinations collide. The salt is inside the digest: tenants never share keys.
Nothing of the writing process enters the key, so a restarted LMCache server
finds what the previous one stored.

Dialog marks: LMCache hands the adapter keys without telling which prompt they
belong to, but a lookup always carries the whole prefix of one request, chunk
0 first (the prefetch controller looks up the full key list). From that list
we compute the marks the way every adpkv adapter does (``dialog_marks`` over
the first ``affinity_chunks`` chunks) and remember them per key (bounded LRU),
so the stores and loads that follow a lookup use the same mark and the gateway
places the dialog on one card. A key we have no mark for gets mark 0 (the
gateway then places it by its chunk digest).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Iterable, Optional, Sequence

from adpkv_core.affinity import dialog_marks
from adpkv_core.keys import KeyBuilder, key_namespace, namespace_id  # noqa: F401

from .config import DEFAULT_NAMESPACE

_PERSON = b"adpkv-lmc-v1"


def _lp(h, data: bytes) -> None:
    h.update(len(data).to_bytes(4, "big"))
    h.update(data)


def object_digest(key) -> bytes:
    """16 bytes naming (model, kv_rank, object group, cache_salt, chunk hash)."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    _lp(h, key.model_name.encode("utf-8"))
    _lp(h, int(key.kv_rank).to_bytes(8, "big", signed=True))
    _lp(h, int(key.object_group_id).to_bytes(8, "big", signed=True))
    _lp(h, key.cache_salt.encode("utf-8"))
    _lp(h, bytes(key.chunk_hash))
    return h.digest()


def anchor_digest(key) -> bytes:
    """What a chunk contributes to a dialog mark: model, tenant and chunk hash.

    kv_rank and object group are left out so every TP slice and every object
    group of a dialog lands on the same card.
    """
    h = hashlib.blake2b(digest_size=16, person=b"adpkv-lmc-anch")
    _lp(h, key.model_name.encode("utf-8"))
    _lp(h, key.cache_salt.encode("utf-8"))
    _lp(h, bytes(key.chunk_hash))
    return h.digest()


def _stream(key) -> tuple:
    return (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)


class KeyMapper:
    """Maps ObjectKeys to adpkv keys (thread-safe, stateless but for the builder).

    The namespace is ``adpkv_core.keys.key_namespace`` of ``namespace`` (empty: the
    default ``lmcache``). ``ObjectKey.model_name`` is inside every key's digest, so two
    models never share a key. LMCache tells the adapter no more of the model identity
    (no revision, KV dtype or geometry): with ``key_namespace_from_model`` that identity is
    unknown, so this adapter gets a new namespace (a cold cache, never a wrong hit).
    """

    def __init__(self, namespace: str = DEFAULT_NAMESPACE, namespace_from_model: bool = False):
        self.namespace_from_model = bool(namespace_from_model)
        self.namespace = key_namespace(namespace or DEFAULT_NAMESPACE, None,
                                       from_model=self.namespace_from_model)
        self._builder = KeyBuilder(self.namespace)

    def key(self, key) -> bytes:
        return self._builder.key(object_digest(key), 0)

    def keys(self, keys: Iterable) -> list[bytes]:
        b = self._builder.key
        return [b(object_digest(k), 0) for k in keys]


class MarkBook:
    """Dialog marks learned from lookups, remembered per adpkv key (LRU-bounded)."""

    def __init__(self, affinity_chunks: int = 1, max_entries: int = 1 << 20):
        self.affinity_chunks = max(1, int(affinity_chunks))
        self.max_entries = max(0, int(max_entries))
        self._marks: "collections.OrderedDict[bytes, int]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def marks_for_lookup(self, obj_keys: Sequence, adp_keys: Sequence[bytes]) -> list[int]:
        """Marks of one request's keys (its whole prefix, chunk 0 first); remembered for later."""
        if not obj_keys:
            return []
        n = self.affinity_chunks
        first = _stream(obj_keys[0])
        anchors = [anchor_digest(k) for k in obj_keys if _stream(k) == first][:n]
        by_pos = dialog_marks(anchors, n)
        pos: dict[tuple, int] = {}
        marks = []
        for k in obj_keys:
            s = _stream(k)
            p = pos.get(s, 0)
            pos[s] = p + 1
            marks.append(by_pos[min(p, len(by_pos) - 1)])
        self.remember(adp_keys, marks)
        return marks

    def remember(self, adp_keys: Sequence[bytes], marks: Sequence[int]) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            book = self._marks
            for k, m in zip(adp_keys, marks):
                book[k] = m
                book.move_to_end(k)
            while len(book) > self.max_entries:
                book.popitem(last=False)

    def marks(self, adp_keys: Sequence[bytes]) -> Optional[list[int]]:
        """Remembered marks (0 where unknown), or None when none is known."""
        with self._lock:
            get = self._marks.get
            out = [get(k, 0) for k in adp_keys]
        return out if any(out) else None

    def __len__(self) -> int:
        return len(self._marks)
