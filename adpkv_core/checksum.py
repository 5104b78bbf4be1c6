"""xxh3-64 checksums that release the GIL on large buffers.

The ``xxhash`` package computes under the GIL, which serialises the gateway's
I/O threads on the checksum of every object. Its extension module exports the
C function ``XXH3_64bits``; called through ctypes (which drops the GIL) the
checksums of parallel reads run in parallel. Same values as
``xxhash.xxh3_64_intdigest``; falls back to it where the symbol is missing or
the buffer is read-only.
"""

from __future__ import annotations

import ctypes

import xxhash

_GIL_FREE_MIN = 64 * 1024


def _load():
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        fn = lib.XXH3_64bits
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return fn


_xxh3 = _load()


def xxh3_64(buf) -> int:
    """xxh3-64 (seed 0) of a buffer."""
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if _xxh3 is not None and n >= _GIL_FREE_MIN:
        view = memoryview(buf)
        if not view.readonly and view.c_contiguous:
            return _xxh3(ctypes.addressof(ctypes.c_char.from_buffer(view)), n)
    return xxhash.xxh3_64_intdigest(buf)
