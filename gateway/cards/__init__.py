"""Cards: the storage backends behind the gateway."""

from __future__ import annotations

from typing import Callable

from .base import Card, CardError, CardUsage
from .fs import FsCard

__all__ = ["Card", "CardError", "CardUsage", "FsCard", "open_cards"]


def open_cards(config, is_pinned: Callable[[bytes], bool]) -> list[Card]:
    """Open every card of ``config.storage_devices``; raises CardError with a clear reason."""
    cards: list[Card] = []
    for device in config.storage_devices:
        if config.storage_backend == "fs":
            card = FsCard(device, num_dbs=config.num_dbs, capacity_bytes=config.capacity_bytes,
                          eviction_watermark=config.eviction_watermark, eviction_ratio=config.eviction_ratio,
                          o_direct=config.o_direct, fsync=config.fsync, is_pinned=is_pinned)
        else:
            raise CardError(f"storage_backend {config.storage_backend!r} is not available in this build")
        card.open()
        cards.append(card)
    serials = [c.serial for c in cards]
    if len(set(serials)) != len(serials):
        raise CardError(f"two storage_devices are the same card (serials {serials})")
    return cards
