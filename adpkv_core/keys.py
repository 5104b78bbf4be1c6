"""Object keys and deployment namespaces.

A key names one stored object: one chunk of tokens of one layer (or one page).
It is derived only from the deployment namespace, the engine's own chained
block hash of the chunk, the layer and the cache kind, so a restarted process
finds everything written before. Layout (28 bytes, big endian)::

    version:u8 | namespace id:8 | chunk digest:16 | layer:u16 | kind:u8

Fragment indices are appended by the gateway (see ``fragments``), never by
adapters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import uuid
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

logger = logging.getLogger(__name__)

KEY_VERSION = 1
KEY_BYTES = 28
_HEAD = struct.Struct(">B8s16sHB")

ChunkHash = Union[bytes, bytearray, memoryview, int, str]

# Cache kinds: the last byte of a key, which cache of a layer an object holds. The one
# registry of every adapter's kinds: the values are in the keys already on the cards, so a
# value is never renumbered nor given another meaning (a stored object would read as another).
KIND_KV = 0          # the layer's (K, V) or latent cache as the engine lays it out (LMCache, SGLang's
                     # KV pool, vLLM's offloading spec); also cache group 0 of vLLM's KV connector
KIND_AUX = 1         # SGLang: a page of an auxiliary pool (which pool: in the namespace)
KIND_TIER_ROW = 7    # vLLM's secondary tier: one CPU-tier row (plugins/vllm/tier/tier.py)
# vLLM's KV connector (plugins/vllm/connector/scheduler.py, worker.py): the kind byte is the cache
# group's index (0, 1, ...; ``CacheGroup.index``: group 0 is ``KIND_KV``). The group index is
# not a field of its own: the key is 28 bytes (``KEY_BYTES``: the wire checks it on every
# request, the cards name fragments by it) with no spare byte, and splitting the kind byte or
# widening the key would change the bytes of keys already stored (every stored object a
# miss: ``KEY_VERSION`` 2 and a migration). So a group index may equal a kind above (group 1
# and ``KIND_AUX``): such keys stay apart by their chunk digests (each engine's own chained
# block hash) and, under ``key_namespace_from_model``, by namespace.
KINDS = {KIND_KV: "kv", KIND_AUX: "aux", KIND_TIER_ROW: "tier_row"}


def namespace_id(namespace: str) -> bytes:
    """The 8-byte id of a namespace string as it appears in every key."""
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=8).digest()


def chunk_digest(chunk_hash: ChunkHash) -> bytes:
    """Normalise an engine chunk hash (bytes, int or str) to 16 bytes."""
    if isinstance(chunk_hash, int):
        raw = chunk_hash.to_bytes((chunk_hash.bit_length() + 8) // 8 or 1, "big", signed=True)
    elif isinstance(chunk_hash, str):
        raw = chunk_hash.encode("utf-8")
    else:
        raw = bytes(chunk_hash)
    if len(raw) == 16:
        return raw
    return hashlib.blake2b(raw, digest_size=16).digest()


class KeyBuilder:
    """Builds object keys of one deployment namespace."""

    def __init__(self, namespace: str):
        if not isinstance(namespace, str):
            raise TypeError("namespace must be a str")
        self.namespace = namespace
        self._ns = namespace_id(namespace)

    def key(self, chunk_hash: ChunkHash, layer: int = 0, kind: int = KIND_KV) -> bytes:
        """The key of one chunk of one layer."""
        return _HEAD.pack(KEY_VERSION, self._ns, chunk_digest(chunk_hash), layer, kind)

    def keys(self, chunk_hashes: Iterable[ChunkHash], layers: Sequence[int] = (0,),
             kind: int = KIND_KV) -> list[bytes]:
        """Keys of every chunk for each layer, layer-major."""
        digests = [chunk_digest(h) for h in chunk_hashes]
        pack, ns = _HEAD.pack, self._ns
        return [pack(KEY_VERSION, ns, d, layer, kind) for layer in layers for d in digests]


DEFAULT_NAMESPACE = "default"
MODEL_IDENTITY_FIELDS = ("model", "revision", "kv_dtype", "geometry", "tp_size", "chunk_size", "layout")


def key_namespace(namespace: str = "", identity: Optional[Mapping[str, Any]] = None, *,
                  from_model: bool = False, private_to: str = "") -> str:
    """The namespace of an adapter's keys: the one rule of every adapter.

    ``namespace`` is the deployment namespace (setting ``namespace``), ``from_model``
    the setting ``key_namespace_from_model``, ``identity`` what the adapter knows of
    the model identity (``MODEL_IDENTITY_FIELDS``: model, revision, KV dtype, KV
    geometry, TP size, chunk size, layout) and of the format of its objects (any
    other field the adapter adds, e.g. SGLang's attention kind). ``tp_size`` is the TP
    size of the objects' layout: an adapter whose objects read the same at every TP size
    gives 1 at every size (vLLM's KV connector: ``plugins/vllm/connector/heads.py``).

    - No ``identity`` and not ``from_model``: ``namespace`` exactly as given
      (``default`` when empty). The operator names the deployment and keeps
      deployments that share cards apart.
    - Otherwise ``model-<hash>`` of the identity and, when set, the deployment
      namespace (as the field ``deployment``): the same identity gives the same
      namespace in every process and every run; any field changed gives another.
      The deployment namespace always counts: two deployments never share keys.
    - ``from_model`` requires the whole model identity: every field of
      ``MODEL_IDENTITY_FIELDS``. **Any model-identity field unknown** (absent with
      ``from_model``; ``None``, empty when given) gives a new namespace — a miss,
      never a wrong hit (logged). It is private to ``private_to`` (an id that every
      process of one engine shares, so its scheduler and workers still agree) or,
      without one, random for this call.
    """
    if identity is None and not from_model:
        return namespace or DEFAULT_NAMESPACE
    fields = dict(identity or {})
    if namespace:
        fields.setdefault("deployment", namespace)
    required = MODEL_IDENTITY_FIELDS if from_model else ()
    unknown = [f for f in MODEL_IDENTITY_FIELDS
               if (f in fields and _unknown(fields[f])) or (f in required and f not in fields)]
    if unknown:
        if private_to:
            fresh = "private-" + hashlib.sha256(private_to.encode()).hexdigest()[:32]
        else:
            fresh = "fresh-" + uuid.uuid4().hex
        logger.warning("Model identity lacks %s: using a new namespace %s (no hits from other runs or "
                       "engines; a miss, never a wrong hit)", ", ".join(unknown), fresh)
        return fresh
    canon = json.dumps({k: _canon(v) for k, v in fields.items()}, sort_keys=True, separators=(",", ":"))
    return "model-" + hashlib.sha256(canon.encode()).hexdigest()[:32]


def _unknown(value: Any) -> bool:
    return value is None or value in ("", [], (), {})


def _canon(value):
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return str(value)
