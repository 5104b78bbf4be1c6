"""The dialog mark: which dialog a key belongs to, for placement on one card."""

from __future__ import annotations

import hashlib
from typing import Sequence

from adpkv_core.keys import ChunkHash, chunk_digest


def dialog_mark(chunk_hashes: Sequence[ChunkHash], affinity_chunks: int = 1) -> int:
    """A u64 hash of the first ``affinity_chunks`` chunk hashes of a prompt.

    All blocks of a dialog carry the same mark, so the gateway places them on
    one card. Engine chunk hashes are chained, so the hash of chunk
    ``affinity_chunks - 1`` already covers the chunks before it.
    """
    if not chunk_hashes:
        return 0
    n = max(1, int(affinity_chunks))
    anchor = chunk_hashes[min(n, len(chunk_hashes)) - 1]
    return int.from_bytes(hashlib.blake2b(chunk_digest(anchor), digest_size=8).digest(), "big")


def dialog_marks(chunk_hashes: Sequence[ChunkHash], affinity_chunks: int = 1) -> list[int]:
    """The mark of every chunk of one prompt.

    Chunks of the common start (index < affinity_chunks) get their own mark, so
    a shared long system prompt does not pin every dialog to one card; the rest
    get the dialog's mark.
    """
    n = max(1, int(affinity_chunks))
    if not chunk_hashes:
        return []
    mark = dialog_mark(chunk_hashes, n)
    marks = []
    for i in range(len(chunk_hashes)):
        marks.append(dialog_mark(chunk_hashes[: i + 1], i + 1) if i < n - 1 else mark)
    return marks
