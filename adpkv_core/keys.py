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
from typing import Iterable, Sequence, Union

logger = logging.getLogger(__name__)

KEY_VERSION = 1
KEY_BYTES = 28
_HEAD = struct.Struct(">B8s16sHB")

ChunkHash = Union[bytes, bytearray, memoryview, int, str]

# Cache kinds: which cache of a layer an object holds.
KIND_KV = 0          # the layer's (K, V) or latent cache as the engine lays it out


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


MODEL_IDENTITY_FIELDS = ("model", "revision", "kv_dtype", "geometry", "tp_size", "chunk_size", "layout")


def namespace_from_model(**fields) -> str:
    """A namespace derived from a model identity.

    The fields ``model, revision, kv_dtype, geometry, tp_size, chunk_size,
    layout`` are required (extra fields are included too). If any is empty or
    unknown, the result is a fresh random namespace: the deployment gets a cold
    cache rather than a chance of reading another model's objects.
    """
    missing = [f for f in MODEL_IDENTITY_FIELDS if fields.get(f) in (None, "", [], (), {})]
    if missing:
        fresh = "fresh-" + uuid.uuid4().hex
        logger.warning("Model identity lacks %s: using a fresh namespace %s (no hits from earlier runs)",
                       ", ".join(missing), fresh)
        return fresh
    canon = json.dumps({k: _canon(v) for k, v in fields.items()}, sort_keys=True, separators=(",", ":"))
    return "model-" + hashlib.sha256(canon.encode()).hexdigest()[:32]


def _canon(value):
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return str(value)
