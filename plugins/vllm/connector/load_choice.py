"""Whether a hit is loaded or recomputed: ``adpkv.load_choice``.

A restore pays off only where reading the prefix beats computing it. Computing grows faster than
linearly with its length (attention) while a restore grows linearly, so for a given engine and
card there is a crossover length: below it, or on a card whose files have left the page cache, the
load is slower than the prefill it replaces. ``"measured"`` (the default) makes the choice per
request from what this engine measured, in the scheduler; ``"always"`` loads every hit.

What is measured (the scheduler's clock, one sample per request): the time from a request's
allocation to its first token, for the prompt's tokens past vLLM's own prefix-cache hit (its
length here), as a **restore** (the hit loaded, the rest computed) or as a **prefill** (no hit,
or a hit declined: all computed). Samples go into buckets by length (powers of two of tokens), as
seconds per token; a bucket's figure is the median of its last ``KEPT`` samples of each kind.

The rule, for a request of length ``n`` with a hit: decline the hit when some bucket at ``n`` or longer has
both figures, younger than ``STALE_S``, and the restore's is the slower (a restore that loses at a
length loses at every shorter one: its cost per token does not fall faster than the prefill's as
prompts shorten). Everything else is loaded: a length never measured, a figure gone stale. Every
``EXPLORE_EVERY``-th declined hit of a bucket is loaded anyway, so a card that warmed up (or a
lighter load on the engine) is seen again. Declining never costs correctness: vLLM computes the
tokens itself, and the chunks stay stored (they are not written again).

Not thread-safe: the scheduler calls it from vLLM's scheduling thread only.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger("adpkv.vllm")

KEPT = 8                # samples of each kind per bucket
STALE_S = 300.0         # a figure older than this does not decide
EXPLORE_EVERY = 8       # every n-th declined hit of a bucket is loaded (a fresh restore figure)


def bucket_of(tokens: int) -> int:
    """The length bucket of ``tokens`` (> 0): ``k`` for [2**(k-1), 2**k)."""
    return max(1, int(tokens)).bit_length()


@dataclass
class _Bucket:
    restore: collections.deque = field(default_factory=lambda: collections.deque(maxlen=KEPT))  # (t, s/token)
    prefill: collections.deque = field(default_factory=lambda: collections.deque(maxlen=KEPT))
    declined: int = 0
    losing: Optional[bool] = None      # the last verdict logged for it

    @staticmethod
    def figure(samples: collections.deque, now: float) -> Optional[float]:
        fresh = [v for t, v in samples if now - t <= STALE_S]
        return statistics.median(fresh) if fresh else None


@dataclass(frozen=True)
class Verdict:
    """The choice for one hit: ``load``, and the measured figures it was made from (seconds
    per token of the bucket that decided; None: nothing decided, the default is to load)."""
    load: bool
    bucket: Optional[int] = None
    restore_s_per_token: Optional[float] = None
    prefill_s_per_token: Optional[float] = None


class LoadChoice:
    """Per request: load the hit or let vLLM recompute it (see the module)."""

    def __init__(self, mode: str = "measured", clock: Callable[[], float] = time.monotonic):
        """``mode``: ``adpkv.load_choice`` as the settings checked it ("measured" or "always")."""
        self.measured = mode == "measured"
        self._clock = clock
        self._buckets: dict[int, _Bucket] = collections.defaultdict(_Bucket)
        self._open: dict[str, tuple[float, int, bool]] = {}     # req -> (start, tokens, restored)
        self.declined = 0            # hits recomputed by this choice (for logs and tests)

    # ------------------------------------------------------------------ choosing
    def verdict(self, tokens: int) -> Verdict:
        """Whether the hit of a request of length ``tokens`` is worth loading now (see the module's rule)."""
        if not self.measured or tokens <= 0:
            return Verdict(True)
        now = self._clock()
        b = bucket_of(tokens)
        for k in sorted(k for k in self._buckets if k >= b):
            r = _Bucket.figure(self._buckets[k].restore, now)
            p = _Bucket.figure(self._buckets[k].prefill, now)
            if r is not None and p is not None and r > p:
                return Verdict(False, k, r, p)
        return Verdict(True)

    def choose(self, tokens: int) -> bool:
        """``verdict`` with exploration and the log line when a length's choice changes."""
        v = self.verdict(tokens)
        bucket = self._buckets[bucket_of(tokens)]
        if not v.load:
            bucket.declined += 1
            if bucket.declined % EXPLORE_EVERY == 0:
                return True          # measured again now and then
            self.declined += 1
        losing = not v.load
        if bucket.losing != losing and (losing or bucket.losing is not None):
            if losing:
                logger.info("adpkv: hits of prompts of about %d tokens are recomputed, not loaded: a restore took "
                            "%.3g s per 1k tokens here, a prefill %.3g s (measured; adpkv.load_choice=always loads them)",
                            tokens, (v.restore_s_per_token or 0) * 1e3, (v.prefill_s_per_token or 0) * 1e3)
            else:
                logger.info("adpkv: hits of prompts of about %d tokens are loaded again", tokens)
        bucket.losing = losing
        return v.load

    # ------------------------------------------------------------------ measuring
    def started(self, req_id: str, tokens: int, restored: bool) -> None:
        """A request of length ``tokens`` was given its blocks: a restore (``restored``) or a
        prefill; timed until ``first_token``. A request timed already
        stays as it is (vLLM allocates again for a request whose asynchronous load ended)."""
        if self.measured and tokens > 0 and req_id not in self._open:
            self._open[req_id] = (self._clock(), tokens, restored)

    def first_token(self, req_id: str) -> None:
        """The request's first token is out: one sample of its kind."""
        entry = self._open.pop(req_id, None)
        if entry is None:
            return
        start, tokens, restored = entry
        now = self._clock()
        kind = self._buckets[bucket_of(tokens)]
        (kind.restore if restored else kind.prefill).append((now, (now - start) / tokens))

    def forget(self, req_id: str) -> None:
        """No sample from this request (preempted, its load failed, finished without a token)."""
        self._open.pop(req_id, None)

    def timing(self) -> list[str]:
        """Requests timed now (the scheduler checks their first token at each step)."""
        return list(self._open)
