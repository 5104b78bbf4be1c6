"""Which shared-memory file backs a buffer of this process.

An engine whose host KV buffer is a mapping of a file in ``/dev/shm`` (LMCache's
L1 pool, for one) can register it with the gateway as a *region*
(``GatewayClient.register_region``, which hands the gateway an open descriptor of
it); the gateway then moves objects between the cards and that buffer itself,
with no copy on the engine side. This module finds the file and the offset from
the buffer's address, using ``/proc/self/maps``.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

SHM_DIR = "/dev/shm"     # where shared-memory buffers live (and the doors of users but root)



class SharedFile(NamedTuple):
    path: str
    offset: int       # of the buffer's first byte in the file


def shared_file_of(address: int, size: int, maps: str = "/proc/self/maps") -> Optional[SharedFile]:
    """The ``/dev/shm`` file whose shared mapping holds ``[address, address+size)``, or None
    (anonymous or private memory, several mappings, or no /proc)."""
    if size <= 0:
        return None
    try:
        with open(maps, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if not start <= address < end:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            return None
        if address + size > end or parts[1][3] != "s" or os.path.dirname(path) != SHM_DIR:
            return None
        return SharedFile(path, int(parts[2], 16) + address - start)
    return None
