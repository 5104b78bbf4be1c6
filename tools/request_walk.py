"""The files one object's save and restore cross, measured: a real gateway (fs card, in a
thread of this process) and a real client, the calls of every project function traced while
one PUT and then one GET of one object run (``sys.setprofile`` on every thread but the
health monitor's), reduced to the sequence of project files control passes through.

Prints, for the save and for the restore: the files crossed (distinct), the steps (moves
from one file to another) and the returns (moves into a file control had already left), the
returns into ``loop/server.py``, and with ``--show`` the sequence itself. docs/internals.md
"A page's walk" records its figures. Usage:

    "$(bash tools/venv.sh core)/bin/python" tools/request_walk.py [--show]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBJ = 64 * 1024


def _project_file(path: str) -> str | None:
    real = os.path.realpath(path)
    for top in ("adpkv_core", "gateway"):
        root = os.path.join(REPO, top) + os.sep
        if real.startswith(root):
            return top + "/" + real[len(root):]
    return None


class Trace:
    """The project files of every Python call and return, in time order, on traced threads."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.on = False
        self._names: dict[str, str | None] = {}

    def _file(self, frame) -> str | None:
        path = frame.f_code.co_filename
        name = self._names.get(path, "")
        if name == "":
            name = self._names[path] = _project_file(path)
        return name

    def __call__(self, frame, event, arg):
        if not self.on or event not in ("call", "return"):
            return
        if threading.current_thread().name == "adpkv-health":
            return
        target = frame if event == "call" else frame.f_back
        if target is None:
            return
        name = self._file(target)
        if name is not None:
            self.events.append(name)

    def take(self) -> list[str]:
        out, self.events = self.events, []
        return out


def walk_figures(events: list[str]) -> dict:
    seq = [f for i, f in enumerate(events) if i == 0 or f != events[i - 1]]
    seen: set[str] = set()
    returns = server_returns = 0
    for f in seq:
        if f in seen:
            returns += 1
            server_returns += f == "gateway/loop/server.py"
        seen.add(f)
    return {"files": len(seen), "steps": max(0, len(seq) - 1), "returns": returns,
            "returns_to_server": server_returns, "sequence": seq}


def one_save_and_restore(trace: Trace, port: int) -> dict[str, dict]:
    """One object saved and restored through a real client, each traced; the figures of each."""
    from adpkv_core.client import ClientConfig, GatewayClient
    from adpkv_core.keys import KeyBuilder

    client = GatewayClient(ClientConfig(port=port, namespace="walk", connect_timeout_s=60.0), engine_id="walk",
                           rank=0, world_size=1, layout={"object_bytes": OBJ})
    assert client.enabled, client.attach_error
    keys = KeyBuilder("walk").keys([b"chunk-0"], layers=[0])
    payload = os.urandom(OBJ)
    got = bytearray()

    def fill(batch):
        client.ring[batch.offset:batch.offset + OBJ] = payload

    def drain(batch):
        if batch.hits[0]:
            got[:] = client.ring[batch.offset:batch.offset + OBJ]

    walks = {}
    for name, run in (("save", lambda: client.put(keys, OBJ, fill).result(timeout=30)),
                      ("restore", lambda: client.get(keys, OBJ, drain).result(timeout=30))):
        trace.on = True
        run()
        trace.on = False
        walks[name] = walk_figures(trace.take())
    client.close()
    assert bytes(got) == payload, "the restore did not return the saved bytes"
    return walks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--show", action="store_true", help="print each walk's sequence of files")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(REPO, ".adpkv-src"))
    from adpkv_gateway import config as cfg
    from adpkv_gateway.loop.server import Gateway
    from adpkv_gateway.ops.spawn import free_port

    trace = Trace()                       # on every thread started from here on (the gateway's, the client's)
    threading.setprofile(trace)
    sys.setprofile(trace)
    card = tempfile.mkdtemp(prefix="adpkv-walk-")
    port = free_port()
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    config = cfg.from_args(parser.parse_args(["--storage-devices", card, "--port", str(port),
                                              "--shared-memory-size", str(64 << 20)]))
    gateway = Gateway(config)
    walks: dict[str, dict] = {}
    failed: list[BaseException] = []

    def walk() -> None:                   # the client's side, while the gateway's loop runs on the main thread
        try:
            walks.update(one_save_and_restore(trace, port))
        except BaseException as exc:      # noqa: BLE001 - reported by main
            failed.append(exc)
        finally:
            gateway.stop()

    threading.Thread(target=walk, name="walk", daemon=True).start()
    gateway.serve_forever()
    sys.setprofile(None)
    threading.setprofile(None)
    if failed:
        raise failed[0]
    for name, w in walks.items():
        print(f"{name}: {w['files']} files crossed, {w['steps']} steps, {w['returns']} returns to a file "
              f"already left ({w['returns_to_server']} of them to loop/server.py)")
        if args.show:
            print("  " + " -> ".join(w["sequence"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
