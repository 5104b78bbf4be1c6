"""The gateway lends no privilege (issue 13): a gateway running as root, an unprivileged
local user (uid/gid 65534, "nobody") trying what it could not do alone.

The unprivileged side runs in a forked child of the test that drops to uid 65534 with
``os.setuid`` after the imports (so it needs no read access to the checkout or the venv);
it reports what happened through a pipe.
"""

from __future__ import annotations

import os
import stat
import uuid

import pytest

from adpkv_core.wire import protocol as P
from adpkv_core.client import GatewayClient
from adpkv_core.wire.door import DoorSession
from adpkv_core.settings import ClientConfig
from adpkv_gateway.ops import control

from ..adversary import NOBODY, OBJ, as_nobody, ring_fill
from ..rankproc import gateway_door, make_keys, pattern

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, "
                                 "the attacker as uid 65534"),
              pytest.mark.security]


# ---------------------------------------------------------------- the door and the control port
def _try_everything_without_a_session(port):
    seen = {}
    try:
        DoorSession(gateway_door(port), 3.0)
        seen["door"] = "opened"
    except PermissionError:
        seen["door"] = "EACCES"
    client = GatewayClient(ClientConfig(port=port, connect_timeout_s=2.0, busy_wait_s=0), "intruder")
    seen["client_enabled"] = client.enabled
    client.close()
    # straight to the TCP port, with no session (a token cannot be had without the door)
    for op in ("STATS", "CLEAN"):
        reply = control.request(port, {"op": op})
        seen[op] = None if reply is None else reply.get("code", reply.get("op"))
    return seen


def test_the_default_door_lets_no_other_user_in(start_gateway):
    gw = start_gateway()                      # default: 0660, the gateway's own group (root)
    mode = stat.S_IMODE(os.stat(gateway_door(gw.port)).st_mode)
    assert mode == 0o660
    keys = make_keys(3)
    owner = GatewayClient(ClientConfig(port=gw.port), "root-engine")
    assert owner.put(keys, OBJ, ring_fill(owner, keys)).result(10).stored == [True] * 3
    seen = as_nobody(_try_everything_without_a_session, gw.port)
    assert seen["door"] == "EACCES" and seen["client_enabled"] is False
    assert seen["STATS"] == P.FORBIDDEN and seen["CLEAN"] == P.FORBIDDEN
    assert owner.exist(keys).result(5) == [True] * 3          # nothing changed
    owner.close()


def _attack_another_users_engine(port, engine_id, keys):
    seen = {}
    stats = control.request(port, {"op": "STATS"})
    seen["stats_engine"] = stats["stats"]["engine"]
    seen["stats_by_namespace"] = stats["stats"]["objects_by_namespace"]
    peer = GatewayClient(ClientConfig(port=port, busy_wait_s=0), engine_id, rank=None)
    seen["lookup_enabled"] = peer.enabled
    seen["lookup_error"] = peer.attach_error
    seen["deleted"] = peer.delete(keys).result(5)
    peer.close()
    seen["clean"] = control.request(port, {"op": "CLEAN"})["code"]
    return seen


def test_another_user_cannot_act_on_an_engine_or_clean(root_engine):
    gw, rank, keys = root_engine
    seen = as_nobody(_attack_another_users_engine, gw.port, "root-engine-7f3a", keys)
    assert "root-engine-7f3a" not in repr(seen["stats_engine"])      # STATS does not show it
    assert seen["stats_by_namespace"] == {}                           # nor its namespace's counters
    assert seen["lookup_enabled"] is False and seen["lookup_error"].startswith(P.FORBIDDEN)
    assert seen["deleted"] == 0
    assert seen["clean"] == P.FORBIDDEN
    assert rank.exist(keys).result(5) == [True] * 4                  # all still there
    own = control.request(gw.port, {"op": "STATS"})["stats"]
    assert "root-engine-7f3a" in repr(own["engine"])
    assert [c["stored"] for c in own["objects_by_namespace"].values()] == [4]


# ---------------------------------------------------------------- regions
def _region_attempts(port, secret_path, own_path):
    seen = {}
    client = GatewayClient(ClientConfig(port=port, busy_wait_s=0), "nobody-engine")
    seen["enabled"] = client.enabled
    seen["secret_region"] = client.register_region(secret_path, 0, 4096).result(5)
    # a descriptor it can get is its own file's; the ring it was handed is refused
    seen["ring_region"] = DoorSession(gateway_door(port), 3.0).register_region(client._ring.fd, 0, 4096).code
    region = client.register_region(own_path, 0, 1 << 20).result(5)
    seen["own_region"] = region
    keys = make_keys(2, namespace="nobody")
    with open(own_path, "r+b") as fh:
        fh.write(pattern(keys[0], 0, OBJ) + pattern(keys[1], 0, OBJ))
    seen["stored"] = client.put_from(region, [0, OBJ], keys, OBJ).result(10).stored
    client.close()
    return seen


def test_regions_reach_only_what_the_client_could_open(start_gateway):
    """Before: REGION took a path and the root gateway opened it with its own rights — an
    unprivileged process read and overwrote a root-only /dev/shm file through it."""
    gw = start_gateway(control_socket_mode="0666")
    secret = f"/dev/shm/adpkv-test-secret-{uuid.uuid4().hex[:8]}"
    own = f"/dev/shm/adpkv-test-nobody-{uuid.uuid4().hex[:8]}"
    try:
        with open(secret, "wb") as fh:
            fh.write(b"root only" * 1000)
        os.chmod(secret, 0o600)
        fd = os.open(own, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        os.fchown(fd, NOBODY, NOBODY)
        os.close(fd)
        seen = as_nobody(_region_attempts, gw.port, secret, own)
        assert seen["enabled"] is True
        assert seen["secret_region"] is None                 # it could not open the file: no region
        assert seen["ring_region"] == P.BAD_REGION
        assert seen["own_region"] == 0 and seen["stored"] == [True, True]
        with open(secret, "rb") as fh:
            assert fh.read() == b"root only" * 1000
    finally:
        for path in (secret, own):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------- files on the card
def _read_card(card_dir):
    seen = {"listed": None, "read": 0, "denied": 0}
    try:
        entries = os.listdir(card_dir)
        seen["listed"] = len(entries)
    except PermissionError:
        seen["listed"] = "EACCES"
        return seen
    for root, _, files in os.walk(card_dir):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as fh:
                    fh.read(1)
                seen["read"] += 1
            except PermissionError:
                seen["denied"] += 1
    return seen


def test_card_files_are_not_readable_by_other_users(root_engine):
    gw, rank, keys = root_engine
    card = gw.card_dirs[0]
    assert sum(len(f) for _, _, f in os.walk(card)) >= 5        # the objects and the card's metadata
    seen = as_nobody(_read_card, card)
    assert seen["listed"] == "EACCES" or seen["read"] == 0, seen
