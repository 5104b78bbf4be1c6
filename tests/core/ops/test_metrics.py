"""The gateway's metrics (gateway/observe/metrics.py, gateway/observe/status.py): a real gateway process serves
/metrics and writes the status file; both are parsed with prometheus_client's own parser, the
names, labels and values checked against what the test did, and every query of the Grafana
dashboard (deploy/grafana/) checked to use only names that exist."""

from __future__ import annotations

import json
import pathlib
import re
import socket
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from adpkv_core.client import GatewayClient
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control
from adpkv_gateway.config import make_config
from adpkv_gateway.ops.spawn import free_port

from ..rankproc import make_keys

REPO = pathlib.Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "adpkv-gateway.json"
ALERTS = REPO / "deploy" / "prometheus" / "adpkv-alerts.yaml"
OBJ = 8192
P = "adpkv_gateway_"

# family -> (type, label names of its samples); histogram samples add "le" on _bucket
EXPECTED = {
    P + "up": ("gauge", set()),
    P + "updated_timestamp_seconds": ("gauge", set()),
    P + "key_layout_info": ("gauge", {"fingerprint"}),
    P + "key_placement_info": ("gauge", {"placement"}),
    P + "ring_bytes": ("gauge", set()),
    P + "ring_in_use_bytes": ("gauge", set()),
    P + "requests_in_flight": ("gauge", set()),
    P + "pinned_objects": ("gauge", set()),
    P + "sessions": ("gauge", set()),
    P + "engine_attached": ("gauge", set()),
    P + "engine_ranks_attached": ("gauge", set()),
    P + "requests": ("counter", {"kind"}),
    P + "hits": ("counter", {"namespace"}),
    P + "misses": ("counter", {"namespace"}),
    P + "stored": ("counter", {"namespace"}),
    P + "store_failed": ("counter", {"namespace"}),
    P + "restored_bytes": ("counter", {"namespace"}),
    P + "stored_bytes": ("counter", {"namespace"}),
    P + "storage_groups_active": ("gauge", set()),
    P + "storage_group_active": ("gauge", {"group"}),
    P + "storage_used_bytes": ("gauge", {"group"}),
    P + "storage_capacity_bytes": ("gauge", {"group"}),
    P + "storage_objects": ("gauge", {"group"}),
    P + "storage_io_strikes": ("gauge", {"group"}),
    P + "storage_read_bytes": ("counter", {"group"}),
    P + "storage_written_bytes": ("counter", {"group"}),
    P + "storage_ios": ("counter", {"group", "op"}),
    P + "storage_io_errors": ("counter", {"group", "op"}),
    P + "storage_evicted": ("counter", {"group"}),
    P + "worker_oldest_io_age_seconds": ("gauge", set()),
    P + "storage_io_seconds": ("histogram", {"group", "op"}),
    P + "request_seconds": ("histogram", {"op"}),
    P + "namespace_used_bytes": ("gauge", {"namespace"}),
    P + "namespace_objects": ("gauge", {"namespace"}),
    P + "namespace_quota_bytes": ("gauge", {"namespace"}),
    P + "namespace_quota_evicted": ("counter", {"namespace"}),
    P + "namespace_capacity_evicted": ("counter", {"namespace"}),
}


def parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels) -> float:
    """The one sample ``sample_name{labels}`` of the parsed exposition."""
    found = [s.value for f in families.values() for s in f.samples if s.name == sample_name and s.labels == labels]
    assert len(found) == 1, f"{sample_name}{labels}: {len(found)} samples"
    return found[0]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def wait_for(predicate, timeout_s: float = 20.0):
    """Poll ``predicate`` until it returns something true; that value, or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture
def busy_gateway(start_gateway, tmp_path):
    """A gateway with /metrics and a status file; tenant-a stores 40 objects on a card that holds
    about 24 (some are evicted) and reads 50 keys back; the figures the test expects."""
    metrics_port = free_port()
    status = tmp_path / "status.prom"
    gw = start_gateway(status_file=str(status), metrics_port=metrics_port, capacity_bytes=24 * (OBJ + 512),
                       eviction_watermark=0.9, eviction_ratio=0.2, namespace_quotas=f"tenant-a={1 << 30}")
    client = GatewayClient(ClientConfig(port=gw.port, namespace="tenant-a"), "engine-a")
    assert client.enabled
    keys = make_keys(40, namespace="tenant-a")

    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + OBJ] = bytes([(b.first + j) % 251]) * OBJ
    stored = client.put(keys, OBJ, fill).result(timeout=30).stored
    hits = client.get(keys + make_keys(10, namespace="other"), OBJ, lambda b: None).result(timeout=30).hits
    client.close()
    stats = control.request(gw.port, {"op": "STATS"})["stats"]
    # the figures behind the exposition are taken once a second: wait until they show the GET
    shown = f'hits_total{{namespace="tenant-a"}} {float(sum(hits))}'
    wait_for(lambda: shown in scrape(metrics_port) and status.exists() and shown in status.read_text())
    return dict(gw=gw, metrics_port=metrics_port, status=status, stored=sum(stored), hits=sum(hits),
                asked=len(hits), stats=stats)


def test_exposition_names_labels_and_values(busy_gateway):
    b = busy_gateway
    stats, card = b["stats"], b["stats"]["cards"][0]
    assert b["stored"] == 40 and 0 < b["hits"] < 40, "the card was meant to evict some objects"
    for exposition in (b["status"].read_text(), scrape(b["metrics_port"])):
        fam = parse(exposition)
        assert set(EXPECTED) <= set(fam), f"missing: {set(EXPECTED) - set(fam)}"
        for name, (kind, labels) in EXPECTED.items():
            assert fam[name].type == kind, name
            for s in fam[name].samples:
                assert set(s.labels) - {"le"} == labels, (name, s)
        group = card["serial"]
        assert value(fam, P + "up") == 1
        assert value(fam, P + "key_layout_info", fingerprint=stats["fingerprint"]) == 1
        assert value(fam, P + "storage_group_active", group=group) == 1
        assert value(fam, P + "storage_groups_active") == 1
        assert value(fam, P + "hits_total", namespace="tenant-a") == b["hits"]
        assert value(fam, P + "misses_total", namespace="tenant-a") == b["asked"] - b["hits"]
        assert value(fam, P + "stored_total", namespace="tenant-a") == 40
        assert value(fam, P + "restored_bytes_total", namespace="tenant-a") == b["hits"] * OBJ
        assert value(fam, P + "stored_bytes_total", namespace="tenant-a") == 40 * OBJ
        evicted = value(fam, P + "storage_evicted_total", group=group)
        assert evicted == card["evicted"] > 0
        # all of them tenant-a's, by the card's LRU (its quota is far away)
        assert value(fam, P + "namespace_capacity_evicted_total", namespace="tenant-a") == evicted
        assert value(fam, P + "namespace_quota_evicted_total", namespace="tenant-a") == 0
        assert value(fam, P + "storage_capacity_bytes", group=group) == card["capacity_bytes"]
        assert value(fam, P + "ring_bytes") == stats["ring_size"]
        assert value(fam, P + "engine_attached") == 0          # the client closed
        # the latency histogram counts every card I/O, as the I/O counters do
        for op, count in (("read", card["reads"]), ("write", card["writes"])):
            assert value(fam, P + "storage_ios_total", group=group, op=op) == count
            assert value(fam, P + "storage_io_seconds_count", group=group, op=op) == count
            buckets = [s for s in fam[P + "storage_io_seconds"].samples
                       if s.name.endswith("_bucket") and s.labels["op"] == op]
            assert [s.value for s in buckets] == sorted(s.value for s in buckets), "buckets are cumulative"
            assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count
            assert value(fam, P + "storage_io_seconds_sum", group=group, op=op) > 0
        assert card["writes"] >= 40 and card["reads"] >= b["hits"]
        # one PUT and one GET request, each timed from arrival to DONE
        for op in ("get", "put"):
            assert value(fam, P + "request_seconds_count", op=op) == 1
            assert value(fam, P + "request_seconds_bucket", op=op, le="+Inf") == 1
            assert 0 < value(fam, P + "request_seconds_sum", op=op) < 30


def test_metrics_endpoint_is_off_by_default_and_a_busy_port_does_not_stop_the_gateway(start_gateway):
    assert make_config().metrics_port == 0
    quiet = start_gateway()
    assert "Metrics at" not in quiet.log()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        gw = start_gateway(metrics_port=port)
        assert control.request(gw.port, {"op": "PING"})["op"] == "OK"
        assert wait_for(lambda: "Metrics endpoint off: cannot listen on" in gw.log())
    with pytest.raises(ValueError, match="metrics_port"):
        make_config({"metrics_port": 70000})
    with pytest.raises(ValueError, match="metrics_port: must differ from port"):
        make_config({"metrics_port": 5557, "port": 5557})


# ---------------------------------------------------------------- the Grafana dashboard and the alerts
PROMQL_WORDS = {
    # functions and aggregations the dashboard may use, and PromQL keywords
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "clamp_min",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "label_values", "absent", "time",
}


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left after dropping label
    matchers ``{...}``, ranges ``[...]``, grouping clauses ``by (...)``, strings and numbers."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", e)
    idents = set(re.findall(r"(?<![\w.$])[A-Za-z_:][\w:]*", e))
    return {i for i in idents if i not in PROMQL_WORDS and not re.fullmatch(r"\d+(e-?\d+)?", i)}


def grouping_labels_in(expr: str) -> set[str]:
    labels = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    return labels


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def test_the_metric_name_check_catches_a_wrong_name():
    assert metric_names_in('sum by (namespace) (rate(adpkv_gateway_hits_total{instance=~"$instance"}'
                           '[$__rate_interval])) / 1e9') == {"adpkv_gateway_hits_total"}
    assert metric_names_in("histogram_quantile(0.99, sum by (le, op) (rate(adpkv_gateway_nope_bucket[5m])))") \
        == {"adpkv_gateway_nope_bucket"}
    assert metric_names_in("label_values(adpkv_gateway_up, instance)") == {"adpkv_gateway_up", "instance"}


def test_every_dashboard_query_uses_names_that_exist(busy_gateway):
    fam = parse(scrape(busy_gateway["metrics_port"]))
    samples = {s.name: set(s.labels) for f in fam.values() for s in f.samples}
    labels = set().union(*samples.values()) | {"instance", "job"}      # added by Prometheus at scrape
    exprs = dashboard_queries()
    assert len(exprs) >= 20
    used = set()
    for expr in exprs:
        names = metric_names_in(expr)
        assert names, expr
        unknown = {n for n in names if n not in samples and n not in labels}
        assert not unknown, f"{expr}: {unknown} is no metric the gateway exposes"
        assert grouping_labels_in(expr) <= labels, expr
        used |= names
    # the dashboard covers hit rate, restore GB/s, card health, capacity and eviction, tenants
    for needed in ("adpkv_gateway_namespace_used_bytes", "adpkv_gateway_namespace_quota_evicted_total",
                   "adpkv_gateway_namespace_capacity_evicted_total",
                   "adpkv_gateway_request_seconds_bucket","adpkv_gateway_hits_total", "adpkv_gateway_misses_total", "adpkv_gateway_restored_bytes_total",
                   "adpkv_gateway_storage_group_active", "adpkv_gateway_storage_io_seconds_bucket",
                   "adpkv_gateway_storage_used_bytes", "adpkv_gateway_storage_capacity_bytes",
                   "adpkv_gateway_storage_evicted_total", "adpkv_gateway_worker_oldest_io_age_seconds"):
        assert needed in used, needed


def test_latency_buckets_hold_each_io_at_the_first_bound_at_or_above_it():
    """Prometheus buckets are ``le``: an I/O of exactly a bound counts in that bucket."""
    from types import SimpleNamespace

    from adpkv_gateway.observe.latency import IO_LATENCY_BUCKETS
    from adpkv_gateway.observe.metrics import GatewayMetrics
    from adpkv_gateway.store.card_stats import CardStats
    stats = CardStats()
    for seconds in (0.00001, 0.001, 0.001, 0.0011, 99.0):
        stats.record(False, True, 4096, seconds)
    stats.record(True, False, 4096, 0.002)
    card = SimpleNamespace(serial="FS0001", device="/cards/a")     # only its names are read
    fam = parse(GatewayMetrics([card], [stats]).exposition().decode())
    bucket = {s.labels["le"]: s.value for s in fam[P + "storage_io_seconds"].samples
              if s.name.endswith("_bucket") and s.labels["op"] == "read"}
    assert len(bucket) == len(IO_LATENCY_BUCKETS) + 1
    assert bucket["5e-05"] == 1 and bucket["0.0005"] == 1 and bucket["0.001"] == 3 and bucket["0.0025"] == 4
    assert bucket["10.0"] == 4 and bucket["+Inf"] == 5
    assert value(fam, P + "storage_io_seconds_count", group="FS0001", op="read") == 5
    assert value(fam, P + "storage_io_seconds_sum", group="FS0001", op="read") == pytest.approx(99.00311)
    assert value(fam, P + "storage_io_seconds_count", group="FS0001", op="write") == 1


def test_every_alert_rule_is_complete_and_uses_names_that_exist(busy_gateway):
    fam = parse(scrape(busy_gateway["metrics_port"]))
    samples = {s.name for f in fam.values() for s in f.samples}
    labels = set().union(*(set(s.labels) for f in fam.values() for s in f.samples)) | {"instance", "job"}
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"AdpkvCardOutOfService", "AdpkvKeyLayoutMismatch", "AdpkvCardIOStuck",
                                           "AdpkvGatewayDown", "AdpkvGatewayStale"}
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]) and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        names = metric_names_in(rule["expr"])
        assert names and names <= samples, f"{rule['alert']}: {names - samples} is no metric the gateway exposes"
        assert grouping_labels_in(rule["expr"]) <= labels, rule["alert"]
        for used in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
            assert used in labels, f"{rule['alert']}: no label {used}"
