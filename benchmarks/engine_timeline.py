"""Where a restore's time goes inside a real vLLM engine (one process: scheduler and worker in it):
the connector's and vLLM's calls timed, and each served prompt's stages in ms after its arrival.

``install()`` wraps the calls once (before or after the engine is made: the lookups are by class);
``stages(t0, t1)`` summarizes the events between a prompt's arrival and its end. Used by
``gpu_engine_phase.py`` (the ``timeline`` key of its spec).

Stages (ms after the prompt was handed to ``LLM.generate``; CPU-side times of the calls, so a
GPU copy is counted where something waits for it):
  lookup      the scheduler's EXIST answered (the hit in tokens)
  alloc       vLLM gave the request its blocks (the tokens to load)
  planned     the load planned into the step's metadata
  issued      the worker sent the layers' GETs (copy-free layers are copied within this call)
  layer0 / layerN   the first and the last layer's GET ended (ring batches copied)
  received    the worker reported the load ended (asynchronous loads)
  next_step   vLLM's first scheduling after the load was reported (asynchronous loads: the step
              that computes the rest) or issued (loads in the pass: the step after it)
  steps       the window's first scheduling steps: (ms, tokens scheduled)
  map_at      the first mapping's start (``DirectMaps.fetch``)
  saves_at    the window's first passes' ends (``wait_for_save`` calls), ms
and counts: ring scatter calls and their CPU ms, copy-free layers and their ms, mappings made
(``DirectMaps.fetch``) and their ms inside the window; on a storing pass the PUTs the forward
pass sent (``put``), the ring copies the client's thread issued for them (``gather``) and the
end-of-pass hook (``wait_for_save``), each with its calls and CPU ms.

``connector_calls()`` gives, and clears, the CPU time of every call into ``AdpKVConnector`` (the
methods vLLM calls on it, scheduler and worker halves) since the last one: what the connector
itself costs a decode step, beside the step count (``steps()``).
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any, Callable, Optional

EVENTS: list[tuple[float, str, float, Any]] = []     # (start, what, call seconds, detail)
_LOCK = threading.Lock()
_INSTALLED = False
CALLS: dict[str, list] = {}                           # AdpKVConnector method -> [calls, seconds]
STEPS_KEPT = 8                                        # a prompt's first scheduling steps kept


def _note(t0: float, what: str, detail: Any = None) -> None:
    with _LOCK:
        EVENTS.append((t0, what, time.perf_counter() - t0, detail))


def _wrap(cls, name: str, what: str, detail: Callable[[Any, tuple], Any]) -> None:
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        result = inner(self, *args, **kwargs)
        d = detail(result, args)
        if d is not None:
            _note(t0, what, d)
        return result

    setattr(cls, name, wrapper)


def _wrap_sum(cls, name: str) -> None:
    inner = cls.__dict__[name]

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            with _LOCK:
                c = CALLS.setdefault(name, [0, 0.0])
                c[0] += 1
                c[1] += dt

    setattr(cls, name, wrapper)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from adpkv_core.direct_map import DirectMaps
    from adpkv_vllm.common.copy import PagedLayer
    from adpkv_vllm.connector import scheduler as sched_role, worker as worker_role
    from adpkv_vllm.connector.connector import AdpKVConnector
    from vllm.v1.core.sched.scheduler import Scheduler

    for name, member in list(AdpKVConnector.__dict__.items()):     # the per-request/per-step calls
        if inspect.isfunction(member) and not name.startswith("_") and not name.endswith("kv_caches") \
                and name != "shutdown":
            _wrap_sum(AdpKVConnector, name)

    _wrap(sched_role.AdpConnectorScheduler, "get_num_new_matched_tokens", "lookup",
          lambda r, a: r[0] if r[0] is not None else None)
    _wrap(sched_role.AdpConnectorScheduler, "update_state_after_alloc", "alloc", lambda r, a: a[2])
    _wrap(sched_role.AdpConnectorScheduler, "build_connector_meta", "planned",
          lambda r, a: len(r.loads) if r.loads else None)
    _wrap(worker_role.AdpConnectorWorker, "start_load_kv", "issued",
          lambda r, a: len(a[0].loads) if getattr(a[0], "loads", None) else None)
    _wrap(worker_role.AdpConnectorWorker, "transfer_results", "received",
          lambda r, a: sorted(r[1]) if r[1] else None)
    _wrap(worker_role.AdpConnectorWorker, "get_finished", "received",
          lambda r, a: sorted(r[1]) if r[1] else None)
    _wrap(worker_role.AdpConnectorWorker, "_load_mapped", "mapped_layer", lambda r, a: 1)
    _wrap(PagedLayer, "scatter", "scatter", lambda r, a: 1)
    # the storing side: PUTs sent from the forward pass, the copies into the ring (the client's
    # thread), and the end-of-pass hook
    _wrap(worker_role.AdpConnectorWorker, "_put", "put", lambda r, a: 1)
    _wrap(PagedLayer, "gather", "gather", lambda r, a: 1)
    _wrap(worker_role.AdpConnectorWorker, "wait_for_save", "wait_for_save", lambda r, a: 1)
    _wrap(DirectMaps, "fetch", "map", lambda r, a: r)
    _wrap(Scheduler, "schedule", "schedule",
          lambda r, a: r.total_num_scheduled_tokens if r.total_num_scheduled_tokens else None)

    # each layer GET's end: a done callback on the future _get_layer returns
    inner = worker_role.AdpConnectorWorker._get_layer

    def get_layer(self, client, ring, name, *args, **kwargs):
        fut = inner(self, client, ring, name, *args, **kwargs)
        t0 = time.perf_counter()
        fut.add_done_callback(lambda f: _note(t0, "layer_done", time.perf_counter()))
        return fut

    worker_role.AdpConnectorWorker._get_layer = get_layer


def stages(t0: float, t1: float) -> dict:
    """The stages of the prompt served between ``t0`` and ``t1`` (see the module)."""
    with _LOCK:
        ev = [e for e in EVENTS if t0 <= e[0] <= t1]
    ms = lambda t: round((t - t0) * 1e3, 1)   # noqa: E731

    def first(what: str, pred: Optional[Callable[[Any], bool]] = None) -> Optional[float]:
        for t, w, _, d in ev:
            if w == what and (pred is None or pred(d)):
                return ms(t)
        return None

    out: dict = {"lookup": first("lookup"), "alloc": first("alloc"), "planned": first("planned"),
                 "issued": first("issued"), "received": first("received")}
    issued = next(((t, s) for t, w, s, _ in ev if w == "issued"), None)
    if issued is not None:
        out["issue_call_ms"] = round(issued[1] * 1e3, 1)
    ends = sorted(d for _, w, _, d in ev if w == "layer_done")
    if ends:
        out["layer0"], out["layerN"], out["layers"] = ms(ends[0]), ms(ends[-1]), len(ends)
    loaded_at = out["received"] if out["received"] is not None else out["issued"]
    if loaded_at is not None:
        out["next_step"] = next((ms(t) for t, w, _, d in ev if w == "schedule" and ms(t) >= loaded_at), None)
    out["steps"] = [(ms(t), d) for t, w, _, d in ev if w == "schedule"][:STEPS_KEPT]
    out["map_at"] = first("map")
    out["saves_at"] = [ms(t) for t, w, _, _ in ev if w == "wait_for_save"][:STEPS_KEPT]
    for what in ("scatter", "mapped_layer", "map", "put", "gather", "wait_for_save"):
        calls = [s for _, w, s, _ in ev if w == what]
        if calls:
            out[f"{what}_calls"], out[f"{what}_ms"] = len(calls), round(sum(calls) * 1e3, 1)
    return out


def clear() -> None:
    with _LOCK:
        EVENTS.clear()
        CALLS.clear()


def steps() -> int:
    """vLLM's scheduling steps that scheduled tokens, since the last ``clear()``."""
    with _LOCK:
        return sum(1 for _, w, _, _ in EVENTS if w == "schedule")


def connector_calls() -> dict[str, tuple[int, float]]:
    """Calls into ``AdpKVConnector`` since the last ``clear()``: method -> (calls, CPU seconds)."""
    with _LOCK:
        return {name: (c[0], c[1]) for name, c in CALLS.items()}
