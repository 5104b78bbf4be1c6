"""SGLang's per-pool hit policies (``batch_exists_v2``), as pure functions of presence flags.

``restorable`` answers SGLang's hit query from which objects are stored: the KV prefix
(the leading run of stored KV pages), and for every auxiliary pool, by its policy
(``sglang.srt.mem_cache.hicache_storage.PoolHitPolicy``):

- ``ALL_PAGES``: every page of the prefix needs the pool's page (DSA indexer, draft);
- ``TRAILING_PAGES``: a prefix of L pages needs the pool's pages L-w .. L-1 only (w = the
  transfer's number of keys: 1 for a Mamba state, the window for SWA), so 5 pages can be
  restorable while 4 are not;
- ``BLOCK_GROUPS``: the pool's keys in groups of ``group_pages``; it reports the pages its
  leading complete groups cover (``block_pages`` each) as its own verdict and never gates
  the KV hit.

The usable prefix is the longest length restorable in every pool (a missing auxiliary page
shrinks it); ``restorable_prefix_pages`` lists every usable length, which SGLang
intersects over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult


@dataclass(frozen=True)
class PoolPresence:
    """Which pages of the queried prefix one auxiliary pool holds."""

    name: str
    policy: PoolHitPolicy
    present: Sequence[bool]          # per page of the queried keys
    window: int = 1                  # TRAILING_PAGES: pages the tail needs
    block_pages: int = 0             # BLOCK_GROUPS
    group_pages: int = 0


def leading_run(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def restorable(kv_present: Sequence[bool], pools: Sequence[PoolPresence]) -> PoolTransferResult:
    kv_pages = leading_run(kv_present)
    hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    usable = set(range(1, kv_pages + 1))
    for p in pools:
        present = list(p.present)[:kv_pages] if p.policy != PoolHitPolicy.BLOCK_GROUPS else list(p.present)
        if p.policy == PoolHitPolicy.ALL_PAGES:
            boundary = leading_run(present)
            usable &= set(range(1, boundary + 1))
        elif p.policy == PoolHitPolicy.TRAILING_PAGES:
            w = max(1, int(p.window))
            # prefix sums: pages [L-w, L) all present <=> count in that range == its length
            run = [0]
            for f in present:
                run.append(run[-1] + (1 if f else 0))
            ok = {length for length in range(1, kv_pages + 1)
                  if run[length] - run[max(0, length - w)] == length - max(0, length - w)}
            boundary = max(ok, default=0)
            usable &= ok
        elif p.policy == PoolHitPolicy.BLOCK_GROUPS:
            g = int(p.group_pages)
            if g <= 0 or p.block_pages <= 0:
                raise ValueError(f"{p.name}: BLOCK_GROUPS needs block_pages and group_pages")
            complete = 0
            while (complete + 1) * g <= len(present) and all(present[complete * g:(complete + 1) * g]):
                complete += 1
            boundary = min(kv_pages, complete * int(p.block_pages))
        else:
            raise ValueError(f"{p.name}: unsupported hit policy {p.policy}")
        if boundary:
            hits[p.name] = boundary
    pages = sorted(usable)
    return PoolTransferResult(pages[-1] if pages else 0, hits, pages)
