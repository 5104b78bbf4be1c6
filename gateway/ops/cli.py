"""``adpkv``: the operator CLI (status, usage, clean, drain, bench, doctor, demo)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Optional

from adpkv_core import __version__
from adpkv_core.wire import protocol as P
from adpkv_core.settings import parse_size

from adpkv_gateway.ops import control
from adpkv_gateway.observe import progress
from adpkv_gateway.config import RANGES, ConfigError, GatewayConfig, from_yaml, make_config

MiB = 1 << 20
CLEAN_POLL_S = 0.5        # how often adpkv clean asks for the gateway's progress
DRAIN_POLL_S = 0.5        # how often adpkv drain asks for the move's progress
CLEAN_WAIT_S = 24 * 3600  # a clean of a huge card may take long: the gateway answers when done


def _size(text: str) -> int:
    """A size option: bytes, or a number with a unit (512MiB), as in the gateway's YAML."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    """``--port``: a TCP port, as the gateway's ``port`` setting allows."""
    rule = RANGES["port"]
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not rule.allows(port):
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule.text()}")
    return port


def _config(args) -> Optional[GatewayConfig]:
    """The gateway's settings when ``--config`` names its YAML (read and checked once:
    ``ConfigError`` names the file and the setting); None without it."""
    if not args.config:
        return None
    if getattr(args, "settings", None) is None:
        args.settings = from_yaml(args.config)
    return args.settings


def _target(args) -> tuple[str, int]:
    config = _config(args)
    if config is not None:
        return config.bind_address, config.port
    return args.host, args.port


def _door(args) -> Optional[str]:
    """The gateway's door when its YAML names one (``control_socket``); None: from the port."""
    config = _config(args)
    return (config.control_socket or None) if config is not None else None


def _ask(args, op: str) -> dict:
    """One request; exits non-zero unless the gateway answers it: an engine could attach
    (its door and port answer), the meaning of ready for ``adpkv status`` and the probes."""
    host, port = _target(args)
    reply = control.request(port, {"op": op}, host=host, timeout_s=args.timeout, door=_door(args))
    if reply is None:
        message = f"adpkv: no gateway answered on {host}:{port} (is adpkv-gateway running? see --port/--config)"
        if getattr(args, "json", False):      # --json: the answer is JSON, the failure too
            print(json.dumps({"error": "no_gateway", "host": host, "port": port, "message": message}))
            raise SystemExit(1)
        raise SystemExit(message)
    if reply.get("op") == "ERROR":
        raise SystemExit(f"adpkv: the gateway on {host}:{port} refused {op}: {reply.get('code')}: {reply.get('msg')}")
    return reply


def _stats(args) -> tuple[dict, P.GatewayStats]:
    """The STATS reply as the gateway sent it (for ``--json``) and read."""
    raw = _ask(args, "STATS")["stats"]
    try:
        return raw, P.gateway_stats(raw)
    except P.ProtocolError as exc:
        raise SystemExit(f"adpkv: the gateway's STATS reply is not what this adpkv reads ({exc})") from None


def cmd_status(args) -> int:
    raw, stats = _stats(args)
    if args.json:
        print(json.dumps(raw, indent=2))
        return 0
    eng = stats.engine
    print(f"gateway :{stats.port}  up {stats.uptime_s:.0f} s  fingerprint {stats.fingerprint}  "
          f"placement {stats.placement}  slots {stats.storage_slots}  dbs {stats.num_dbs}"
          f"{'  shared' if stats.shared_storage else ''}")
    engine = "none" if eng is None else f"{eng.id} ranks {eng.ranks} of {eng.world}"
    print(f"engine  : {engine}  ring {stats.ring_in_use / MiB:.0f}/{stats.ring_size / MiB:.0f} MiB  "
          f"requests in flight {stats.requests_in_flight}")
    change = stats.layout_change
    if change:
        state = "complete, the previous layout is dropped" if change.complete else \
            f"moving, {change.left_objects} objects known to be left"
        print(f"layout  : change from {change.previous_fingerprint} {state}; moved {change.moved_objects} "
              f"objects, {change.moved_bytes / MiB:.1f} MiB at {change.rate_bytes_per_s / MiB:.1f} MiB/s")
    for w in stats.work:
        print(f"working : {w.what} {w.done}/{w.total} {w.unit} ({w.elapsed_s:.0f} s)")
    o = stats.objects
    hits, misses = o.get("hits", 0), o.get("misses", 0)
    ratio = f"{100.0 * hits / (hits + misses):.1f}%" if hits + misses else "-"
    print(f"objects : hits {hits}  misses {misses}  hit ratio {ratio}  stored {o.get('stored', 0)}  "
          f"store failed {o.get('store_failed', 0)}")
    read = sum(c.bytes_read for c in stats.cards)
    written = sum(c.bytes_written for c in stats.cards)
    print(f"bytes   : read {read / MiB:.1f} MiB  written {written / MiB:.1f} MiB")
    latency = "  ".join(f"{op} {1000.0 * total / sum(counts):.2f} ms mean over {sum(counts)}"
                        for op, (counts, total) in sorted(stats.request_latency.items()) if sum(counts))
    print(f"latency : {latency or 'no requests yet'}")
    for c in stats.cards:
        print(f"card {c.serial}  {c.kind} {c.device}  {'active' if c.active else 'INACTIVE'}  "
              f"{c.used_bytes / MiB:.1f}/{c.capacity_bytes / MiB:.0f} MiB  {c.objects} objects  "
              f"io errors {c.read_errors + c.write_errors}")
        if c.cluster_state is not None:
            print(f"  cluster_state {c.cluster_state}  " + "  ".join(
                f"{n.node} {n.role}{'' if n.answers and not n.failed else ' DOWN'}" for n in c.cluster_nodes or []))
    return 0


def cmd_usage(args) -> int:
    raw, stats = _stats(args)
    used = sum(c.used_bytes for c in stats.cards)
    cap = sum(c.capacity_bytes for c in stats.cards)
    objs = sum(c.objects for c in stats.cards)
    if args.json:
        print(json.dumps({"used_bytes": used, "capacity_bytes": cap, "objects": objs, "cards": len(stats.cards),
                          "namespaces": raw.get("tenants", [])}, indent=2))
        return 0
    print(f"{used / MiB:.1f} MiB used of {cap / MiB:.0f} MiB ({100.0 * used / cap if cap else 0:.2f}%), "
          f"{objs} objects on {len(stats.cards)} card(s)")
    for t in stats.tenants:
        name = f"{t.namespace} (id:{t.id})" if t.namespace else f"id:{t.id}"
        # MiB as status prints sizes, the exact bytes beside them (quotas are set in bytes)
        quota = f"quota {t.quota_bytes / MiB:.2f} MiB ({t.quota_bytes} bytes) per card" if t.quota_bytes \
            else "no quota"
        print(f"namespace {name}: {t.used_bytes / MiB:.2f} MiB ({t.used_bytes} bytes), {t.objects} objects, {quota}, "
              f"{t.evicted} evicted over quota, {t.capacity_evicted} by the card's LRU")
    return 0


def cmd_clean(args) -> int:
    if not args.yes:
        raise SystemExit("adpkv clean deletes every object on the gateway's cards; add --yes to confirm")
    reply = _clean_showing_progress(args)
    if reply["op"] == "ERROR":
        print(f"adpkv clean: {reply['code']}: {reply['msg']}", file=sys.stderr)
        return 1
    print(f"deleted {reply['deleted']} objects")
    return 0


def cmd_drain(args) -> int:
    """DRAIN a card, then its progress until the move is complete (the card can go then)."""
    host, port = _target(args)
    reply = control.request(port, {"op": "DRAIN", "card": args.card}, host=host, timeout_s=args.timeout,
                            door=_door(args))
    if reply is None:
        message = f"adpkv: no gateway answered on {host}:{port} (is adpkv-gateway running? see --port/--config)"
        if getattr(args, "json", False):      # --json: the answer is JSON, the failure too
            print(json.dumps({"error": "no_gateway", "host": host, "port": port, "message": message}))
            raise SystemExit(1)
        raise SystemExit(message)
    if reply["op"] == "ERROR":
        print(f"adpkv drain: {reply['code']}: {reply['msg']}", file=sys.stderr)
        return 1
    serial, fingerprint = reply["serial"], reply["fingerprint"]
    shown = None
    try:
        while True:
            change = _ask(args, "STATS")["stats"]["layout_change"]
            if change is None or change["complete"]:
                break
            total = change["moved_objects"] + change["left_objects"]
            if shown is None and total:
                shown = progress.track(f"draining card {serial}", total, "objects")
            if shown is not None:
                shown.set(change["moved_objects"])
            time.sleep(DRAIN_POLL_S)
    finally:
        if shown is not None:
            shown.close()
    print(f"card {serial} is drained: remove it from storage_devices (key layout fingerprint now {fingerprint})")
    return 0


def _clean_showing_progress(args) -> dict:
    """CLEAN, and while the gateway works on it, its progress (the ``work`` STATS lists) as a
    bar on a terminal or plain lines on stderr. The CLEAN reply is awaited as long as the
    gateway answers STATS."""
    host, port = _target(args)
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(
        reply=control.request(port, {"op": "CLEAN"}, host=host, timeout_s=CLEAN_WAIT_S, door=_door(args))),
        daemon=True)
    thread.start()
    shown: dict[str, progress.Progress] = {}
    try:
        while thread.is_alive():
            thread.join(CLEAN_POLL_S)
            if not thread.is_alive():
                break
            reply = control.request(port, {"op": "STATS"}, host=host, timeout_s=args.timeout, door=_door(args))
            if reply is None or reply.get("op") != "OK":
                break                           # the gateway stopped answering: no CLEAN reply either
            for work in reply["stats"].get("work", []):
                if "cleaning" not in work["what"]:
                    continue
                if work["what"] not in shown:
                    shown[work["what"]] = progress.track(work["what"], work["total"], work["unit"])
                shown[work["what"]].set(work["done"])
    finally:
        for p in shown.values():
            p.close()
    if thread.is_alive() or answer.get("reply") is None:
        raise SystemExit(f"adpkv: no gateway answered on {host}:{port} (is adpkv-gateway running? see --port/--config)")
    return answer["reply"]


def cmd_bench(args) -> int:
    from adpkv_gateway.ops import bench
    try:
        sizes = [_size(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        print(f"adpkv bench: --sizes: {exc}", file=sys.stderr)
        return 2
    regimes = ["cold", "hot"] if args.regime == "both" else [args.regime]
    if args.threads <= 0:
        from adpkv_gateway.config import default_io_threads
        args.threads = default_io_threads()
    port = None
    where = "own gateways on fresh cards under --dir"
    if args.port_given:
        port = _target(args)[1]
        # like with like: the raw baseline does the I/O the live gateway does (o_direct: cold)
        config = _config(args)
        if config is not None:
            regimes = ["cold" if config.o_direct else "hot"]
            why = f"o_direct: {str(config.o_direct).lower()} in {args.config}"
        elif args.regime != "both":
            regimes, why = [args.regime], "--regime"
        else:
            regimes, why = ["hot"], "the default o_direct: false; --regime cold for a gateway with o_direct"
        where = f"the live gateway on port {port}, regime {regimes[0]} ({why}); its objects are deleted after"
    print(f"adpkv bench: {', '.join(f'{s // 1024} KiB' for s in sizes)}; {args.ranks} rank(s); "
          f"{args.total // MiB} MiB per size; regimes {', '.join(regimes)}; {args.threads} I/O threads; "
          f"dir {os.path.abspath(args.dir)}; {where}")
    results = bench.run(args.dir, sizes, regimes, args.total, args.ranks, args.per_request, args.threads, port,
                        args.repeat)
    top = bench.headline(results)
    print(f"store_vs_raw={top.store_vs_raw:.2f} restore_vs_raw={top.restore_vs_raw:.2f} "
          f"({top.regime} {_size_text(top.size)})")
    return 0


def _size_text(size: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if size % mult == 0:
            return f"{size // mult} {unit}"
    return f"{size} B"


def cmd_doctor(args) -> int:
    from adpkv_gateway.ops import doctor
    from adpkv_gateway.ops.doctor_host import Host
    from adpkv_gateway.ops.doctor_report import exit_code, report
    config = _config(args) or make_config({"port": args.port})
    host = _target(args)[0]
    h = Host(config, config_given=bool(args.config), port_given=args.port_given, host=host,
             timeout_s=args.timeout, engine=args.engine,
             hash_algo=args.hash_algo, engine_user=args.engine_user, shm_bytes=args.shm_bytes)
    try:
        findings = doctor.examine(h)
    except ValueError as exc:
        raise SystemExit(f"adpkv doctor: {exc}")
    code = exit_code(findings)
    if args.json:
        print(json.dumps({"exit_code": code, "findings": [dataclasses.asdict(f) for f in findings]}, indent=2))
    else:
        print(report(findings))
    return code


def cmd_demo(args) -> int:
    from adpkv_gateway.ops.demo import run_demo
    return run_demo(args.dir, args.tokens, args.layers)


def _add_gateway_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    def default(value):
        return argparse.SUPPRESS if suppress else value
    parser.add_argument("--config", default=default(None), metavar="YAML",
                        help="the gateway's YAML (its port and bind_address find the gateway)")
    parser.add_argument("--host", default=default("127.0.0.1"), help="gateway host (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=default(None), help="gateway port (default 5557)")
    parser.add_argument("--timeout", type=float, default=default(3.0),
                        help="seconds to wait for the gateway's answer (default 3)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="adpkv", description="Operate an adpkv gateway. The gateway options "
                                "(--config, --host, --port, --timeout) go before or after the subcommand.")
    _add_gateway_options(p, suppress=False)
    p.add_argument("--version", action="version", version=f"adpkv {__version__}")
    # The same options on every subcommand, with SUPPRESS defaults: given after the subcommand
    # they land in the namespace, not given they leave the main parser's value alone.
    shared = argparse.ArgumentParser(add_help=False)
    _add_gateway_options(shared, suppress=True)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", parents=[shared], help="cards, health, fingerprint, usage")
    s.add_argument("--json", action="store_true")
    u = sub.add_parser("usage", parents=[shared], help="bytes and objects stored, per namespace (tenant) too")
    u.add_argument("--json", action="store_true", help="the totals and the namespaces' rows as JSON")
    c = sub.add_parser("clean", parents=[shared], help="delete everything (refused on shared storage)")
    c.add_argument("--yes", action="store_true")
    dn = sub.add_parser("drain", parents=[shared], help="move a card's objects to the others, so it can be removed")
    dn.add_argument("card", help="the card's serial (adpkv status) or its device as in storage_devices")
    b = sub.add_parser("bench", parents=[shared],
                       help="store/restore through a gateway vs raw file I/O on the same disk",
                       description="Store then restore objects through a gateway (every byte checked) and "
                       "write then read the same bytes as plain files in --dir with as many threads: the "
                       "ratio is the gateway's cost over the disk. Without --port/--config it starts its own "
                       "gateway for each regime and size on a fresh card under --dir (removed after). With "
                       "--port or --config it measures that live gateway in its regime (from the YAML's "
                       "o_direct, else --regime, else hot) and deletes every object it stored. The last line: "
                       "store_vs_raw=S restore_vs_raw=R (REGIME SIZE), the cold 1 MiB result when measured, "
                       "else the first.")
    b.add_argument("--sizes", default="128KiB,1MiB,3MiB", help="object sizes, comma-separated (default "
                   "128KiB,1MiB,3MiB)")
    b.add_argument("--regime", choices=["cold", "hot", "both"], default="both",
                   help="cold: the card and the raw files with O_DIRECT (the disk); hot: the page cache; both "
                   "(default; with a live gateway: the one it runs, hot unless its YAML says o_direct)")
    b.add_argument("--ranks", type=int, default=1, help="engine ranks (processes), each a slice of every object, "
                   "as tensor-parallel ranks (default 1)")
    b.add_argument("--total", type=_size, default=512 * MiB, help="bytes per size (default 512MiB)")
    b.add_argument("--per-request", type=int, default=64, help="objects per request (one layer request)")
    b.add_argument("--threads", type=int, default=0,
                   help="I/O threads of the gateway and of the raw baseline (0: the gateway's default)")
    b.add_argument("--repeat", type=int, default=3, help="runs per size, alternating gateway and raw; median")
    b.add_argument("--dir", default="./adpkv-bench", help="where the bench cards and the raw files go (on the "
                   "disk to measure; removed after; default ./adpkv-bench)")
    dr = sub.add_parser("doctor", parents=[shared], help="check this host before the engine starts; exit 0 when all "
                        "is well, 1 on a problem, 2 on warnings only or a --config it cannot read (run it as the engine's user, "
                        "in its environment)")
    dr.add_argument("--engine", choices=["vllm", "sglang", "lmcache"], default="",
                    help="the engine that will use the gateway (checks what its keys rest on)")
    dr.add_argument("--hash-algo", default="", help="its prefix hash setting: vLLM --prefix-caching-hash-algo "
                    "(default sha256), lmcache server --hash-algorithm (default blake3)")
    dr.add_argument("--engine-user", default="", help="the user the engine runs as (default: this one)")
    dr.add_argument("--json", action="store_true", help="the findings as JSON (check, level, found, fix)")
    dr.add_argument("--shm-bytes", type=_size, default=0,
                    help="what the engine itself puts in /dev/shm (LMCache's L1 pool with --shm-name)")
    d = sub.add_parser("demo", parents=[shared], help="start a gateway on ./adpkv-card, store a prompt's KV, restart, restore")
    d.add_argument("--dir", default="./adpkv-card")
    d.add_argument("--tokens", type=int, default=16384)
    d.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    args.port_given = args.port is not None or args.config is not None
    if args.port is None:
        args.port = 5557
    handlers = {"status": cmd_status, "usage": cmd_usage, "clean": cmd_clean, "bench": cmd_bench, "demo": cmd_demo,
                "doctor": cmd_doctor, "drain": cmd_drain}
    try:
        return handlers[args.cmd](args)
    except ConfigError as exc:      # the gateway's YAML (--config): one line, as a usage error
        print(f"adpkv {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
