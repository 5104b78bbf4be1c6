"""Cards: the storage backends behind the gateway and the object format they share (see
``adpkv_gateway``): ``open_cards`` opens a configuration's cards, an fs card (``cards.fs``) for a
directory, a resp or cluster card (``cards.resp``) for a Redis URL. Imports ``observe``."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from adpkv_gateway.cards.quotas import quotas_by_id
from adpkv_gateway.cards.base import Card, CardError, CardIOError, CardUnavailable, CardUsage, NodeIOError
from adpkv_gateway.cards.fs import lock as fs_lock
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.cards.fs.lock import CardLock, CardLocked
from adpkv_gateway.cards.resp.card import RespCard
from adpkv_gateway.cards.resp.cluster import SCHEMES as CLUSTER_SCHEMES, ClusterCard

__all__ = ["Card", "CardError", "CardIOError", "CardLock", "CardLocked", "CardUnavailable", "CardUsage", "ClusterCard",
           "FsCard", "NodeIOError", "RespCard", "close_cards", "open_cards"]


def open_cards(config, is_pinned: Callable[[bytes], bool]) -> tuple[list[Card], list[CardLock]]:
    """Open every card of ``config.storage_devices``, and the locks of its fs cards.

    A ``redis://`` device is a resp card, a ``redis+cluster://`` device a cluster card
    (a whole Redis Cluster), anything else a directory (fs card), so the kinds can be
    mixed. A card that does not answer yet is returned without a
    serial (the health monitor lets it join later); a misconfigured one raises
    CardError with a clear reason. An fs card is opened under its lock (``fs_lock``:
    another gateway on it that does not share it refuses it, naming that gateway), held
    until ``close_cards``. When any card is refused, those opened before it are closed
    again and any card this start made is removed.
    """
    cards: list[Card] = []
    locks: list[CardLock] = []
    quotas = quotas_by_id(getattr(config, "namespace_quotas", {}))
    try:
        for device in config.storage_devices:
            timeout_s = config.io_timeout_ms / 1000.0 if config.io_timeout_ms else None
            if quotas and str(device).startswith(CLUSTER_SCHEMES + ("redis://", "tcp://")):
                logging.getLogger("adpkv.gateway").warning(
                    "namespace_quotas do not apply to %s: a Redis-protocol server evicts by its own maxmemory "
                    "policy and the gateway keeps no index of it (quotas bind fs cards only)", device)
            if str(device).startswith(CLUSTER_SCHEMES):
                card: Card = ClusterCard(device, io_timeout_s=timeout_s, wait_ms=getattr(config, "resp_wait_ms", 0))
            elif str(device).startswith(("redis://", "tcp://")):
                card = RespCard(device, io_timeout_s=timeout_s)
            elif config.storage_backend == "resp":
                raise CardError(f"storage_backend resp needs redis://host:port or redis+cluster://host:port[,...] "
                                f"devices, not {device!r}")
            else:
                card = FsCard(device, num_dbs=config.num_dbs, capacity_bytes=config.capacity_bytes,
                              eviction_watermark=config.eviction_watermark, eviction_ratio=config.eviction_ratio,
                              o_direct=config.o_direct, fsync=config.fsync, is_pinned=is_pinned,
                              card_group=getattr(config, "card_group", ""), quotas=quotas)
                lock = fs_lock.take(card.root, card.dir_mode, fs_lock.Holder(config.port, config.shared_storage))
                try:
                    card.open()
                except BaseException:
                    lock.release(undo_new=True)
                    raise
                locks.append(lock)
                cards.append(card)
                continue
            try:
                card.open()
            except CardUnavailable as exc:
                logging.getLogger("adpkv.gateway").warning("%s", exc)
            cards.append(card)
        serials = [c.serial for c in cards if c.serial]
        if len(set(serials)) != len(serials):
            raise CardError(f"two storage_devices are the same card (serials {serials})")
    except BaseException:
        close_cards(cards, locks, undo_new=True)
        raise
    return cards, locks


def close_cards(cards: Sequence[Card], locks: Sequence[CardLock], undo_new: bool = False) -> None:
    """Close every card, then give the fs cards' locks up (``undo_new``: a start that failed,
    which removes the cards it made: ``CardLock.release``)."""
    for card in cards:
        card.close()
    for lock in locks:
        lock.release(undo_new=undo_new)
