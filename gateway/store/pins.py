"""The keys pinned now (a GET with ``lock``): made before the cards (an fs card's eviction
passes pinned objects over, from its first scan on), handed to the store, asked by the
mover (a pinned object is not moved away)."""

from __future__ import annotations

import collections
import threading
from typing import Sequence


class Pins:
    """Counted pins: a key stays pinned until every pin on it is dropped. Thread-safe."""

    def __init__(self) -> None:
        self._pins: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def pin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                n = self._pins.get(key, 0)
                if n <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] = n - 1

    def holds(self, key: bytes) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._pins)
