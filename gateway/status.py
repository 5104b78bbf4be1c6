"""The status file: gateway health and counters in Prometheus text format."""

from __future__ import annotations

import os


def _esc(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def render_status(s: dict) -> str:
    """Prometheus text exposition of the gateway's state (``s``: what STATS answers)."""
    lines = []

    def metric(name, value, help_, labels=None, kind="gauge"):
        if not any(l.startswith(f"# HELP {name} ") for l in lines):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
        lab = "" if not labels else "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}"
        lines.append(f"{name}{lab} {value}")

    p = "adpkv_gateway_"
    metric(p + "up", 1, "The gateway is running")
    metric(p + "key_layout_info", 1, "Key layout fingerprint", {"fingerprint": s["fingerprint"]})
    metric(p + "key_placement_info", 1, "Key placement", {"placement": s["placement"]})
    metric(p + "storage_groups_active", sum(c["active"] for c in s["cards"]), "Cards in service")
    for c in s["cards"]:
        g = {"group": c["serial"]}
        metric(p + "storage_group_active", int(c["active"]), "Card in service (1) or not (0)", g)
        metric(p + "storage_used_bytes", c["used_bytes"], "Bytes stored on the card", g)
        metric(p + "storage_capacity_bytes", c["capacity_bytes"], "Capacity of the card", g)
        metric(p + "storage_objects", c["objects"], "Objects (fragments) on the card", g)
        metric(p + "storage_read_bytes_total", c["bytes_read"], "Bytes read from the card", g, "counter")
        metric(p + "storage_written_bytes_total", c["bytes_written"], "Bytes written to the card", g, "counter")
        metric(p + "storage_io_errors_total", c["read_errors"] + c["write_errors"], "Failed card I/O", g, "counter")
        metric(p + "storage_evicted_total", c["evicted"], "Objects evicted from the card", g, "counter")
        avg = c["io_seconds"] / c["io_count"] if c["io_count"] else 0.0
        metric(p + "storage_io_latency_avg_seconds", f"{avg:.6f}", "Mean card I/O latency", g)
        metric(p + "storage_io_latency_max_seconds", f"{c['io_max_seconds']:.6f}", "Max card I/O latency", g)
    for c in s["cards"]:
        if "cluster_state" not in c:
            continue
        g = {"group": c["serial"]}
        metric(p + "cluster_state_ok", int(c["cluster_state"] == "ok"),
               "The cluster card's cluster_state is ok (1) or not (0)", g)
        for n in c.get("cluster_nodes", []):
            metric(p + "cluster_node_up", int(n["answers"] and not n["failed"]),
                   "A node of the cluster answers the gateway and is not flagged failed",
                   {**g, "node": n["node"], "role": n["role"]})
    metric(p + "worker_oldest_io_age_seconds", f"{max([c['oldest_io_age_s'] for c in s['cards']] or [0]):.3f}",
           "Age of the oldest card I/O in flight")
    o = s["objects"]
    metric(p + "hits_total", o.get("hits", 0), "Objects found by GET", kind="counter")
    metric(p + "misses_total", o.get("misses", 0), "Objects not found by GET", kind="counter")
    metric(p + "stored_total", o.get("stored", 0), "Objects stored by PUT", kind="counter")
    metric(p + "store_failed_total", o.get("store_failed", 0), "Objects PUT could not store", kind="counter")
    for name, value in sorted(s["counters"].items()):
        metric(p + "requests_total", value, "Requests by kind", {"kind": name}, "counter")
    metric(p + "ring_bytes", s["ring_size"], "Size of the shared-memory ring")
    metric(p + "ring_in_use_bytes", s["ring_in_use"], "Ring bytes held by transfers")
    metric(p + "requests_in_flight", s["requests_in_flight"], "Data requests in flight")
    metric(p + "engine_attached", 0 if s["engine"] is None else 1, "An engine is attached")
    return "\n".join(lines) + "\n"


def write_status_file(path: str, text: str) -> None:
    """Replace the status file atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
