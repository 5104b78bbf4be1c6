"""Large fs cards built fast: object files written straight into a card's databases with the
card's own writer (``objfile.write_object_file``), as a gateway would have left them, without
a gateway or the card's index (a PUT costs a round trip and an index commit each)."""

from __future__ import annotations

import os
import time

from adpkv_core.keys import KeyBuilder
from adpkv_gateway.ops import control
from adpkv_gateway.cards.fs.card import FsCard
from adpkv_gateway.cards.fs.files import object_name
from adpkv_gateway.cards.objfile import Scratch, write_object_file
from adpkv_gateway.cards.fragments import fragment_db, fragment_key


def payload_of(key: bytes, size: int) -> bytes:
    """The bytes stored under ``key``: its own key repeated (a hit of another key is seen)."""
    return (key * (size // len(key) + 1))[:size]


def card_keys(n: int, namespace: str = "scale", start: int = 0) -> list[bytes]:
    return KeyBuilder(namespace).keys([i.to_bytes(8, "big") for i in range(start, start + n)])


def build_card(root: str, keys: list[bytes], size: int = 1024, num_dbs: int = 16) -> None:
    """A card at ``root`` (made by ``FsCard.open``) holding one single-fragment object of
    ``size`` bytes per key, in the database a gateway with ``num_dbs`` puts it."""
    card = FsCard(root, num_dbs=num_dbs)
    card.open()
    card.close()
    os.unlink(os.path.join(root, ".adpkv-index"))   # the empty card's snapshot: older than what follows
    scratch = Scratch()
    made: set[str] = set()
    for key in keys:
        fkey = fragment_key(key, 0)
        path = os.path.join(root, f"db{fragment_db(key, 0, num_dbs):03d}", object_name(fkey))
        where = os.path.dirname(path)
        if where not in made:                       # as the card makes it at the first write into it
            os.makedirs(where, 0o700, exist_ok=True)
            made.add(where)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_object_file(fd, fkey, memoryview(payload_of(key, size)), size, False, scratch)
        finally:
            os.close(fd)


def object_dirs(root: str) -> list[str]:
    """The directories of a card that hold object files: every database's subdirectories."""
    return [os.path.join(root, d, s) for d in sorted(os.listdir(root)) if d.startswith("db")
            for s in sorted(os.listdir(os.path.join(root, d)))]


def object_paths(root: str, hidden: bool = False) -> list[str]:
    """The path of every object file of a card (``hidden``: temporary files too)."""
    return [os.path.join(d, n) for d in object_dirs(root) for n in sorted(os.listdir(d))
            if hidden or not n.startswith(".")]


def files_on_disk(root: str) -> tuple[int, int]:
    """(bytes, files) of the object files under a card's databases."""
    nbytes = files = 0
    for d in object_dirs(root):
        for entry in os.scandir(d):
            if not entry.name.startswith("."):
                nbytes += entry.stat().st_size
                files += 1
    return nbytes, files


def gateway_stats(port: int, timeout_s: float = 10.0) -> dict:
    """The gateway's STATS (a failure when it does not answer within ``timeout_s``)."""
    reply = control.request(port, {"op": "STATS"}, timeout_s=timeout_s)
    assert reply is not None, "the gateway did not answer STATS"
    return reply["stats"]


def settled_card(port: int, timeout_s: float = 120.0, stats_timeout_s: float = 10.0) -> dict:
    """The first card's STATS figures once the card's background work at start (the index
    scan, its check and trim: STATS ``work``) has ended: until then the index is still catching
    up with the disk, by design. A failure when that work outlasts ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = gateway_stats(port, stats_timeout_s)
        busy = [w.get("what", "") for w in figures.get("work", [])
                if any(k in w.get("what", "") for k in ("indexing", "checking", "trimming"))]
        if not busy:
            return figures["cards"][0]
        assert time.monotonic() < deadline, f"the card's start-up work did not end in {timeout_s} s: {busy}"
        time.sleep(0.05)
