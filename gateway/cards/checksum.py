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
        return None, None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    try:
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
    except AttributeError:
        return fn, None
    return fn, lib


_xxh3, _stream_lib = _load()


def xxh3_64(buf) -> int:
    """xxh3-64 (seed 0) of a buffer."""
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if _xxh3 is not None and n >= _GIL_FREE_MIN:
        view = memoryview(buf)
        if not view.readonly and view.c_contiguous:
            return _xxh3(ctypes.addressof(ctypes.c_char.from_buffer(view)), n)
    return xxhash.xxh3_64_intdigest(buf)


class Xxh3Stream:
    """Incremental xxh3-64 (seed 0), GIL-free through ctypes where the symbols exist.

    Lets a reader hash each piece of an object right after reading it, while the
    piece is still in the CPU cache, instead of a second pass over the object.
    """

    def __init__(self):
        self._state = _stream_lib.XXH3_createState() if _stream_lib is not None else None
        self._py = None
        self.reset()

    def reset(self) -> None:
        if self._state is not None:
            _stream_lib.XXH3_64bits_reset(self._state)
        else:
            self._py = xxhash.xxh3_64()

    def update(self, view: memoryview) -> None:
        if self._state is not None and not view.readonly and view.nbytes:
            _stream_lib.XXH3_64bits_update(self._state, ctypes.addressof(ctypes.c_char.from_buffer(view)),
                                           view.nbytes)
        elif self._state is not None:
            _stream_lib.XXH3_64bits_update(self._state, bytes(view), view.nbytes)
        else:
            self._py.update(view)

    def digest(self) -> int:
        if self._state is not None:
            return _stream_lib.XXH3_64bits_digest(self._state)
        return self._py.intdigest()

    def __del__(self):
        if getattr(self, "_state", None) is not None and _stream_lib is not None:
            _stream_lib.XXH3_freeState(self._state)
            self._state = None
