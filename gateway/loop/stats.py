"""What STATS answers (and the status file shows), built in two parts: the gateway loop's
own state, taken on the loop (``loop_snapshot``: consistent, cheap), and the cards' usage,
taken on the I/O pool (``card_usages``: on a Redis-protocol card a network round trip, so
never on the loop); ``merge`` puts them together into the typed reply,
``adpkv_core.wire.protocol.GatewayStats``."""

from __future__ import annotations

import collections
import time

import msgspec

from adpkv_core import __version__
from adpkv_core.wire import protocol as P
from adpkv_core.keys import DEFAULT_NAMESPACE, namespace_id

from adpkv_gateway.observe import progress
from adpkv_gateway.cards import CardUsage
from adpkv_gateway.cards.quotas import ID_PREFIX, TenantUsage
from adpkv_gateway.store.object_store import ObjectStore


def loop_snapshot(gateway) -> dict:
    """Everything STATS shows but the cards' usage. Runs on the loop's thread."""
    store = gateway.store
    cards = []
    for card, st, active, strikes in zip(store.cards, store.stats, store.service.active, gateway.card_health.strikes):
        cards.append({"serial": card.serial or card.device, "device": card.device, "kind": card.kind,
                      "active": bool(active), "strikes": strikes, "oldest_io_age_s": st.oldest_io_age(),
                      "reads": st.reads, "writes": st.writes, "bytes_read": st.bytes_read,
                      "bytes_written": st.bytes_written, "read_errors": st.read_errors,
                      "write_errors": st.write_errors, "io_seconds": st.io_seconds,
                      "io_count": st.io_count, "io_max_seconds": st.io_max_s,
                      "evicted": getattr(card, "evicted", 0), **card.details()})
    config, engine = gateway.config, gateway.engines.engine
    return {
        "port": config.port, "uptime_s": time.time() - gateway.started,
        "fingerprint": store.placement.fingerprint, "placement": config.key_placement,
        "storage_slots": config.storage_slots, "num_dbs": config.num_dbs,
        "shared_storage": bool(config.shared_storage), "replicas": store.placement.replicas,
        "ring_size": gateway.transfers.ring_size, "ring_in_use": gateway.transfers.ring_in_use(),
        "requests_in_flight": len(gateway.transfers.jobs), "pinned": len(store.pins),
        "regions": sum(len(s.regions) for s in gateway.door.sessions.values()),
        "sessions": len(gateway.door.sessions),
        "engine": None if engine is None else {"id": engine.engine_id, "world": engine.world,
                                               "ranks": sorted(engine.ranks), "namespace": engine.namespace},
        "counters": dict(gateway.counters), "objects": dict(sum(store.counters.values(), collections.Counter())),
        "objects_by_namespace": {ns: dict(c) for ns, c in store.counters.items()}, "cards": cards,
        "namespace_names": namespace_names(config.namespace_quotas, engine), "version": __version__,
        "work": progress.running(), "layout_change": gateway.layout_change.figures(),
        "request_latency": {op.lower(): b.copy() for op, b in gateway.transfers.request_latency.items()},
    }


def card_usages(store: ObjectStore) -> list[tuple[CardUsage, list[TenantUsage]]]:
    """Each card's usage (bytes, capacity, objects) and its namespaces' (fs cards); runs on
    the I/O pool."""
    return [(card.usage(), card.tenant_usage()) if active else (CardUsage(0, 0, 0), [])
            for card, active in zip(store.cards, store.service.active)]


def merge(snapshot: dict, usages: list[tuple[CardUsage, list[TenantUsage]]]) -> P.GatewayStats:
    """The snapshot with each card's usage, and ``tenants``: each namespace's bytes, objects,
    quota evictions and the cards' LRU evictions summed over the cards (``quota_bytes`` is per card), by id, with its name
    where the gateway knows it (a configured quota, the attached engine's namespace)."""
    names = snapshot["namespace_names"]
    tenants: dict[str, dict] = {}
    for c, (u, per_namespace) in zip(snapshot["cards"], usages):
        c.update(used_bytes=u.used_bytes, capacity_bytes=u.capacity_bytes, objects=u.objects)
        for t in per_namespace:
            row = tenants.setdefault(t.tenant, {"id": t.tenant, "namespace": names.get(t.tenant, ""),
                                                "used_bytes": 0, "objects": 0, "quota_bytes": t.quota_bytes,
                                                "evicted": 0, "capacity_evicted": 0})
            row["used_bytes"] += t.used_bytes
            row["objects"] += t.objects
            row["evicted"] += t.evicted
            row["capacity_evicted"] += t.capacity_evicted
    snapshot["tenants"] = sorted(tenants.values(), key=lambda r: (-r["used_bytes"], r["id"]))
    return msgspec.convert(snapshot, P.GatewayStats)


def namespace_names(quotas: dict, engine) -> dict[str, str]:
    """Namespace id (hex) -> name, for the namespaces the gateway knows by name: ``default``
    (an adapter's namespace when none is set), the quotas', the attached engine's."""
    names = {namespace_id(n).hex(): n for n in [DEFAULT_NAMESPACE, *quotas] if not n.startswith(ID_PREFIX)}
    if engine is not None and engine.namespace:
        names[namespace_id(engine.namespace).hex()] = engine.namespace
    return names
