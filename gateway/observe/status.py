"""What the status file says: the gateway's figures (what STATS answers) as Prometheus metric
families (``FAMILIES``; ``gateway/observe/metrics.py`` puts them in the gateway's registry).

The names the gateway specification defines are kept as it spells them (with our prefix
``adpkv_gateway_``): ``storage_group_active{group=<card serial>}``, ``storage_groups_active``,
``key_layout_info{fingerprint}``, ``key_placement_info{placement}``,
``worker_oldest_io_age_seconds``. docs/operations.md lists every metric.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                    Metric)

from adpkv_core.wire.protocol import GatewayStats

from adpkv_gateway.observe.latency import histogram_buckets

PREFIX = "adpkv_gateway_"

OBJECT_COUNTERS = (   # per namespace: (the figure, also the metric's name without _total; help)
    ("hits", "Objects found by GET"),
    ("misses", "Objects not found by GET"),
    ("stored", "Objects stored by PUT (or already there)"),
    ("store_failed", "Objects PUT could not store"),
    ("restored_bytes", "Bytes of objects found by GET (handed to the engine)"),
    ("stored_bytes", "Bytes of objects stored by PUT (or already there)"),
)


def _gauge(name: str, help_: str, value=None, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_, value=value, labels=None if value is not None else list(labels))


def gateway_families(s: GatewayStats) -> Iterable[Metric]:
    """The gateway as a whole: key layout, ring, requests, engine (whether it is up, and when
    these figures were taken: ``metrics.FiguresCollector``)."""
    yield InfoMetricFamily(PREFIX + "key_layout", "Key layout fingerprint", value={"fingerprint": s.fingerprint})
    yield InfoMetricFamily(PREFIX + "key_placement", "Key placement", value={"placement": s.placement})
    yield _gauge("ring_bytes", "Size of the shared-memory ring", s.ring_size)
    yield _gauge("ring_in_use_bytes", "Ring bytes held by transfers", s.ring_in_use)
    yield _gauge("requests_in_flight", "Data requests in flight", s.requests_in_flight)
    yield _gauge("pinned_objects", "Objects pinned by engines' lookups", s.pinned)
    yield _gauge("sessions", "Door sessions open (local processes using the gateway)", s.sessions)
    engine = s.engine
    yield _gauge("engine_attached", "An engine is attached", 0 if engine is None else 1)
    yield _gauge("engine_ranks_attached", "Ranks of the attached engine that are attached",
                 0 if engine is None else len(engine.ranks))
    requests = CounterMetricFamily(PREFIX + "requests", "Requests by kind", labels=["kind"])
    for kind, value in sorted(s.counters.items()):
        requests.add_metric([kind], value)
    yield requests


def request_families(s: GatewayStats) -> Iterable[Metric]:
    """Data requests' latency, from their arrival (every rank's part) to DONE, by op."""
    family = HistogramMetricFamily(PREFIX + "request_seconds", "Data request latency, arrival (every rank's "
                                   "part) to DONE, the ranks' copies included", labels=["op"])
    for op, (counts, seconds) in sorted(s.request_latency.items()):
        family.add_metric([op], histogram_buckets(counts), seconds)
    yield family


def object_families(s: GatewayStats) -> Iterable[Metric]:
    """Hits, misses, stored objects and bytes, by the namespace of the engine that asked."""
    by_namespace = s.objects_by_namespace
    for figure, help_ in OBJECT_COUNTERS:
        family = CounterMetricFamily(PREFIX + figure, help_, labels=["namespace"])
        for namespace, counts in sorted(by_namespace.items()):
            family.add_metric([namespace], counts.get(figure, 0))
        yield family


def card_families(s: GatewayStats) -> Iterable[Metric]:
    """Each card (label ``group``: its serial): health, capacity, I/O, eviction, cluster state."""
    cards = s.cards
    yield _gauge("storage_groups_active", "Cards in service", sum(c.active for c in cards))
    fam: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "active": _gauge("storage_group_active", "Card in service (1) or not (0)", labels=["group"]),
        "used": _gauge("storage_used_bytes", "Bytes stored on the card", labels=["group"]),
        "capacity": _gauge("storage_capacity_bytes", "Capacity of the card", labels=["group"]),
        "objects": _gauge("storage_objects", "Objects (fragments) on the card", labels=["group"]),
        "strikes": _gauge("storage_io_strikes", "Card commands in a row that failed or passed io_timeout_ms "
                          "(io_timeout_strikes of them take the card out)", labels=["group"]),
        "read": CounterMetricFamily(PREFIX + "storage_read_bytes", "Bytes read from the card", labels=["group"]),
        "written": CounterMetricFamily(PREFIX + "storage_written_bytes", "Bytes written to the card",
                                       labels=["group"]),
        "ios": CounterMetricFamily(PREFIX + "storage_ios", "Card I/O commands", labels=["group", "op"]),
        "errors": CounterMetricFamily(PREFIX + "storage_io_errors", "Failed card I/O", labels=["group", "op"]),
        "evicted": CounterMetricFamily(PREFIX + "storage_evicted", "Objects evicted from the card",
                                       labels=["group"]),
    }
    for c in cards:
        g = [c.serial]
        fam["active"].add_metric(g, int(c.active))
        fam["used"].add_metric(g, c.used_bytes)
        fam["capacity"].add_metric(g, c.capacity_bytes)
        fam["objects"].add_metric(g, c.objects)
        fam["strikes"].add_metric(g, c.strikes)
        fam["read"].add_metric(g, c.bytes_read)
        fam["written"].add_metric(g, c.bytes_written)
        fam["ios"].add_metric(g + ["read"], c.reads)
        fam["ios"].add_metric(g + ["write"], c.writes)
        fam["errors"].add_metric(g + ["read"], c.read_errors)
        fam["errors"].add_metric(g + ["write"], c.write_errors)
        fam["evicted"].add_metric(g, c.evicted)
    yield from fam.values()
    yield _gauge("worker_oldest_io_age_seconds", "Age of the oldest card I/O in flight",
                 max([c.oldest_io_age_s for c in cards] or [0.0]))
    clusters = [c for c in cards if c.cluster_state is not None]
    if clusters:
        state = _gauge("cluster_state_ok", "The cluster card's cluster_state is ok (1) or not (0)", labels=["group"])
        nodes = _gauge("cluster_node_up", "A node of the cluster answers the gateway and is not flagged failed",
                       labels=["group", "node", "role"])
        for c in clusters:
            state.add_metric([c.serial], int(c.cluster_state == "ok"))
            for n in c.cluster_nodes or []:
                nodes.add_metric([c.serial, n.node, n.role], int(n.answers and not n.failed))
        yield state
        yield nodes


def tenant_families(s: GatewayStats) -> Iterable[Metric]:
    """Each key namespace on the fs cards (``namespace``: its name where the gateway knows it,
    else ``id:<hex>``): bytes and objects summed over the cards, quota per card, evictions for
    being over it (``namespace_quotas``, docs/gateway.md "Tenant quotas")."""
    used = _gauge("namespace_used_bytes", "Bytes a key namespace holds on the fs cards", labels=["namespace"])
    objects = _gauge("namespace_objects", "Objects a key namespace holds on the fs cards", labels=["namespace"])
    quota = _gauge("namespace_quota_bytes", "Bytes a key namespace may hold per card (0: no quota)",
                   labels=["namespace"])
    evicted = CounterMetricFamily(PREFIX + "namespace_quota_evicted",
                                  "Objects evicted because their namespace was over its quota", labels=["namespace"])
    lru = CounterMetricFamily(PREFIX + "namespace_capacity_evicted",
                              "Objects of the namespace the cards' LRU evicted (a card past its watermark)",
                              labels=["namespace"])
    for t in s.tenants:
        label = [t.namespace or "id:" + t.id]
        used.add_metric(label, t.used_bytes)
        objects.add_metric(label, t.objects)
        quota.add_metric(label, t.quota_bytes)
        evicted.add_metric(label, t.evicted)
        lru.add_metric(label, t.capacity_evicted)
    yield from (used, objects, quota, evicted, lru)


FAMILIES = (gateway_families, request_families, object_families, card_families, tenant_families)
