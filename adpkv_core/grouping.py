"""Objects of one engine call that differ in size go out as one request per size.

A data request (``GatewayClient.get``/``put``/``get_into``/``put_from``) carries one
``object_bytes`` for all its keys, while an engine call may mix sizes (LMCache
MemoryObjs of a task, SGLang's generic ``batch_get``/``batch_set`` targets). Pure
helper shared by the adapters; no I/O.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["group_by_size"]


def group_by_size(sizes: Iterable[int]) -> dict[int, list[int]]:
    """``{size: [indices of the objects of that size]}``, sizes in first-seen order,
    indices ascending."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    return groups
