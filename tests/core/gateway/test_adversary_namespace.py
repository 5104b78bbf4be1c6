"""A key namespace belongs to its owner (issue 25, item 4), and bad list lengths are bad
messages (item 8).

A real gateway as root with a door every local user may open (``control_socket_mode`` 0666);
the other user is a forked child of the test that drops to uid 65534 after the imports
(``as_nobody``, tests/core/adversary.py). It attaches an engine of its own while root's is
detached (a gateway serves one engine: while root's is attached it cannot even do that) and
sends every request that names keys with keys built for root's namespace, through its own
control connection (``Raw``: the client would turn each error into a miss, the test wants
each code). Before this change it read root's objects, deleted them and stored poison under
keys root had not stored yet.
"""

from __future__ import annotations

import os
import shutil

import pytest

from adpkv_core.wire import protocol as P
from adpkv_core.client import GatewayClient
from adpkv_core.keys import namespace_id
from adpkv_core.settings import ClientConfig
from adpkv_gateway.cards import ClusterCard, FsCard, RespCard
from adpkv_gateway.config import make_config

from ..adversary import NOBODY, OBJ, Raw, answer, as_nobody, read_back, store_own
from ..rankproc import make_keys, pattern

pytestmark = pytest.mark.security

ROOT_NS, NOBODY_NS, OTHER_NS = "root-tenant", "nobody-tenant", "nobody-other"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, the other "
                                "user is uid 65534")


# ---------------------------------------------------------------- in the uid 65534 child
def _attack(port: int, theirs: list, fresh: list, mine: list, other: list) -> dict:
    """Every request that names keys, with root's keys (``theirs``: stored; ``fresh``: not yet
    stored), alone and mixed with keys of its own namespace (``mine``) or of one nobody has
    claimed (``other``); then its own namespace, which must work. What each answered."""
    raw = Raw(port, "nobody-engine")
    seen = {"hello": answer(raw.hello)}
    if seen["hello"] != "OK":          # root's engine is attached: the gateway is not free
        for op, fields in (("EXIST", {}), ("DELETE", {}), ("GET", {"obj": OBJ})):
            seen[op] = answer(raw.ask(op, keys=theirs, **fields))
        raw.close()
        return seen
    at = [i * OBJ for i in range(len(theirs))]
    for i in range(len(fresh)):
        raw.write(i * OBJ, b"poison!!" * (OBJ // 8))
    asks = {
        "exist": ("EXIST", dict(keys=theirs)),
        "exist_fresh": ("EXIST", dict(keys=fresh)),
        "exist_lock": ("EXIST", dict(keys=theirs, lock=True)),
        "exist_marks": ("EXIST", dict(keys=theirs, marks=[7] * len(theirs))),
        "exist_mixed": ("EXIST", dict(keys=mine[:1] + theirs[:1])),
        "get": ("GET", dict(keys=theirs, obj=OBJ)),
        "get_unlock": ("GET", dict(keys=theirs, obj=OBJ, unlock=True)),
        "get_region": ("GET", dict(keys=theirs, obj=OBJ, region=0, at=at)),
        "get_mixed": ("GET", dict(keys=theirs[:1] + mine[:1], obj=OBJ, region=0, at=at[:2])),
        "unlock": ("UNLOCK", dict(keys=theirs)),
        "delete": ("DELETE", dict(keys=theirs[:1])),
        "delete_mixed": ("DELETE", dict(keys=mine[:1] + theirs[1:2])),
        "put_ring": ("PUT", dict(keys=fresh, obj=OBJ)),
        "put_region": ("PUT", dict(keys=fresh, obj=OBJ, region=0, at=at[:len(fresh)])),
        "put_tagged": ("PUT", dict(keys=fresh, obj=OBJ, tag="t")),
        "put_mixed": ("PUT", dict(keys=other[:1] + fresh[:1], obj=OBJ, region=0, at=at[:2])),
    }
    replies = {name: raw.ask(op, **fields) for name, (op, fields) in asks.items()}
    seen.update({name: answer(r) for name, r in replies.items()})
    said = [{f: replies[name].get(f) for f in ("op", "code", "msg")} for name in ("exist", "exist_fresh")]
    seen["same_message"] = said[0] == said[1]
    # its own namespace works: stored, found, byte-exact (and the mixed requests left none of it)
    for i, key in enumerate(mine):
        raw.write(i * OBJ, pattern(key, 0, OBJ))
    own_at = [i * OBJ for i in range(len(mine))]
    put = raw.ask("PUT", keys=mine, obj=OBJ, region=0, at=own_at)
    seen["own_put"] = [a or b for a, b in zip(put.get("stored", b""), put.get("existed", b""))]
    raw.write(0, bytes(len(mine) * OBJ))
    seen["own_get"] = list(raw.ask("GET", keys=mine, obj=OBJ, region=0, at=own_at).get("hits", b""))
    seen["own_exact"] = [raw.read(a, OBJ) == pattern(k, 0, OBJ) for k, a in zip(mine, own_at)]
    raw.close()
    return seen


# ---------------------------------------------------------------- root's side
def _fill(client, keys):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
    return fill


def _exact(client, keys) -> list[bool]:
    """GET as root; for each key, whether it came back as root's own bytes."""
    exact = [False] * len(keys)

    def check(b):
        for j in range(b.count):
            if b.hits[j]:
                o = b.offset + j * b.stride
                exact[b.first + j] = bytes(client.ring[o:o + OBJ]) == pattern(keys[b.first + j], 0, OBJ)
    hits = client.get(keys, OBJ, check).result(10).hits
    return [h and e for h, e in zip(hits, exact)]


def _root(port: int) -> GatewayClient:
    client = GatewayClient(ClientConfig(port=port), "root-engine")
    assert client.enabled, client.attach_error
    return client


REFUSED = ["exist", "exist_fresh", "exist_lock", "exist_marks", "exist_mixed", "get", "get_unlock", "get_region",
           "get_mixed", "unlock", "delete", "delete_mixed", "put_ring", "put_region", "put_tagged", "put_mixed"]


def _assert_refused(seen: dict) -> None:
    assert seen["hello"] == "OK", seen
    assert {name: seen[name] for name in REFUSED} == {name: P.FORBIDDEN for name in REFUSED}, seen
    assert seen["same_message"], "a stored and an unstored key of root's namespace must be refused alike"
    assert seen["own_put"] == [True] * 3 and seen["own_get"] == [1] * 3 and seen["own_exact"] == [True] * 3, seen


@needs_root
@pytest.mark.parametrize("card", ["fs", "resp", "cluster"])
def test_another_user_cannot_read_delete_lock_or_store_into_roots_namespace(card, start_gateway, open_dir,
                                                                           redis_servers, redis_cluster):
    """Root's engine attached or not, before and after a restart of the gateway: uid 65534 gets
    FORBIDDEN for every request naming a key of root's namespace (stored or not, alone or mixed
    with its own), learns nothing, changes nothing; its own namespace works; root's objects stay
    byte-exact and root stores what 65534 tried to poison."""
    if card == "fs":
        settings = dict(card_dirs=[os.path.join(open_dir, "card")])
    elif card == "resp":
        settings = dict(card_dirs=[redis_servers(1)[0].url], storage_backend="resp")
    else:
        settings = dict(card_dirs=[redis_cluster(replicas=0).url], storage_backend="resp")
    gw = start_gateway(control_socket_mode="0666", **settings)
    theirs, fresh = make_keys(4, namespace=ROOT_NS), make_keys(2, namespace=ROOT_NS, salt=b"fresh")
    mine, other = make_keys(3, namespace=NOBODY_NS), make_keys(1, namespace=OTHER_NS)
    root = _root(gw.port)
    assert root.put(theirs, OBJ, _fill(root, theirs)).result(10).stored == [True] * 4

    # root's engine attached: the other user cannot even attach an engine
    seen = as_nobody(_attack, gw.port, theirs, fresh, mine, other)
    assert seen == {"hello": P.ENGINE_BUSY, "EXIST": P.NOT_ATTACHED, "DELETE": P.NOT_ATTACHED,
                    "GET": P.NOT_ATTACHED}, seen
    root.close()

    # detached: it attaches its own engine and names root's keys
    _assert_refused(as_nobody(_attack, gw.port, theirs, fresh, mine, other))
    # after a restart, before root's engine comes back: the claim is on the card
    gw.restart()
    _assert_refused(as_nobody(_attack, gw.port, theirs, fresh, mine, other))

    root = _root(gw.port)
    assert _exact(root, theirs) == [True] * 4                  # all there, root's own bytes
    assert root.exist(fresh).result(10) == [False, False]      # no poison
    result = root.put(fresh, OBJ, _fill(root, fresh)).result(10)
    assert result.stored == [True, True] and result.existed == [False, False]
    assert _exact(root, fresh) == [True, True]
    assert root.exist(mine).result(10) == [False] * 3          # and root cannot see 65534's (FORBIDDEN)
    log = gw.log()
    assert "belongs to another user" in log and "internal error" not in log.lower()
    # the claims: root's namespace and 65534's; none (and no object) for the namespace of the
    # refused mixed PUT
    if card == "fs":
        claims = os.path.join(settings["card_dirs"][0], "namespaces")
        assert oct(os.stat(claims).st_mode & 0o777) == "0o700"
        with open(os.path.join(claims, namespace_id(ROOT_NS).hex()), "rb") as fh:
            assert fh.read() == b"0\n"
        with open(os.path.join(claims, namespace_id(NOBODY_NS).hex()), "rb") as fh:
            assert fh.read() == b"%d\n" % NOBODY
        assert not os.path.exists(os.path.join(claims, namespace_id(OTHER_NS).hex()))
    else:
        url = settings["card_dirs"][0]
        probe = RespCard(url) if card == "resp" else ClusterCard(url)
        probe.open()
        try:
            owners = {ns: probe.namespace_owner(namespace_id(ns)) for ns in (ROOT_NS, NOBODY_NS, OTHER_NS)}
        finally:
            probe.close()
        assert owners == {ROOT_NS: 0, NOBODY_NS: NOBODY, OTHER_NS: None}
    assert root.exist(other).result(10) == [False]
    root.close()


@needs_root
def test_configured_owners_share_a_namespace_and_bind_root_too(start_gateway, open_dir):
    """``namespace_owners``: root and 65534 share ``shared``, each reads the other's objects;
    ``theirs`` is 65534's alone, root included (no bypass for data); across a restart."""
    gw = start_gateway(card_dirs=[os.path.join(open_dir, "card")], control_socket_mode="0666",
                       namespace_owners=f"shared=root+{NOBODY},id:{namespace_id('theirs').hex()}={NOBODY}")
    shared_root, shared_nobody = make_keys(2, namespace="shared"), make_keys(2, namespace="shared", salt=b"n")
    theirs = make_keys(2, namespace="theirs")
    root = _root(gw.port)
    assert root.put(shared_root, OBJ, _fill(root, shared_root)).result(10).stored == [True, True]
    root.close()
    assert as_nobody(store_own, gw.port, shared_nobody) == {"hello": "OK", "put": "DONE", "stored": [1, 1]}
    assert as_nobody(store_own, gw.port, theirs) == {"hello": "OK", "put": "DONE", "stored": [1, 1]}
    gw.restart()
    assert as_nobody(read_back, gw.port, shared_root, 0) == {"hello": "OK", "get": "DONE", "hits": [1, 1],
                                                         "exact": [True, True]}
    with Raw(gw.port, "root-engine") as raw:
        got = raw.ask("GET", keys=shared_nobody, obj=OBJ, region=0, at=[0, OBJ])
        assert answer(got) == "DONE" and list(got["hits"]) == [1, 1]
        assert [raw.read(i * OBJ, OBJ) == pattern(k, 1, OBJ) for i, k in enumerate(shared_nobody)] == [True, True]
        assert answer(raw.ask("EXIST", keys=theirs)) == P.FORBIDDEN          # root too
        assert answer(raw.ask("GET", keys=theirs, obj=OBJ)) == P.FORBIDDEN
        assert answer(raw.ask("DELETE", keys=theirs)) == P.FORBIDDEN
    assert as_nobody(read_back, gw.port, theirs, 1)["exact"] == [True, True]   # still there, untouched
    # configured namespaces are not claimed on the card
    claims = os.path.join(open_dir, "card", "namespaces")
    assert not os.path.exists(claims) or os.listdir(claims) == []


@needs_root
def test_cards_that_disagree_about_an_owner_refuse_the_namespace_to_everyone(start_gateway, open_dir):
    """Two fs cards whose claims name different owners (two gateways raced, or a card was
    swapped in): the namespace is nobody's, FORBIDDEN for both users, logged; the others work."""
    cards = [os.path.join(open_dir, "a"), os.path.join(open_dir, "b")]
    gw = start_gateway(card_dirs=cards, control_socket_mode="0666")
    keys, others = make_keys(2, namespace="contested"), make_keys(2, namespace="fine")
    root = _root(gw.port)
    assert root.put(keys + others, OBJ, _fill(root, keys + others)).result(10).stored == [True] * 4
    root.close()
    gw.stop()
    name = namespace_id("contested").hex()
    os.makedirs(os.path.join(cards[1], "namespaces"), mode=0o700, exist_ok=True)
    with open(os.path.join(cards[1], "namespaces", name), "wb") as fh:     # card b now says 65534
        fh.write(b"%d\n" % NOBODY)
    gw.start()
    with Raw(gw.port, "root-engine") as raw:
        assert answer(raw.ask("EXIST", keys=keys)) == P.FORBIDDEN
        assert answer(raw.ask("GET", keys=keys, obj=OBJ)) == P.FORBIDDEN
        assert list(raw.ask("EXIST", keys=others)["hits"]) == [1, 1]
    assert as_nobody(read_back, gw.port, keys, 0)["get"] == P.FORBIDDEN
    assert "record different owners" in gw.log()


@needs_root
def test_a_namespace_with_objects_from_before_claims_goes_to_its_first_user(start_gateway, open_dir):
    """Objects stored before namespaces were claimed (no claim recorded): the first user to
    name the namespace claims it (here root, by reading); 65534 is refused from then on."""
    card = os.path.join(open_dir, "card")
    gw = start_gateway(card_dirs=[card], control_socket_mode="0666")
    keys = make_keys(3, namespace="legacy")
    root = _root(gw.port)
    assert root.put(keys, OBJ, _fill(root, keys)).result(10).stored == [True] * 3
    root.close()
    gw.stop()
    shutil.rmtree(os.path.join(card, "namespaces"), ignore_errors=True)   # as a card written before claims
    assert not os.path.exists(os.path.join(card, "namespaces"))
    gw.start()
    root = _root(gw.port)
    assert _exact(root, keys) == [True] * 3
    root.close()
    assert as_nobody(read_back, gw.port, keys, 0)["get"] == P.FORBIDDEN


# ---------------------------------------------------------------- item 8
def test_lists_of_the_wrong_length_are_bad_messages(start_gateway):
    """An EXIST whose marks are fewer than its keys answered CARD_ERROR (an IndexError on the
    I/O pool); every list that holds one entry per key is checked where the message is decoded:
    BAD_MESSAGE, nothing changed."""
    gw = start_gateway()
    keys = make_keys(3, namespace="lengths")
    root = _root(gw.port)
    assert root.put(keys, OBJ, _fill(root, keys)).result(10).stored == [True] * 3
    root.close()
    cases = {
        "EXIST marks short": ("EXIST", dict(keys=keys, marks=[1])),
        "EXIST marks long": ("EXIST", dict(keys=keys[:1], marks=[1, 2])),
        "EXIST lock marks short": ("EXIST", dict(keys=keys, marks=[0, 0], lock=True)),
        "DELETE marks short": ("DELETE", dict(keys=keys, marks=[1])),
        "GET marks short": ("GET", dict(keys=keys, obj=OBJ, marks=[1, 2])),
        "PUT marks long": ("PUT", dict(keys=keys, obj=OBJ, marks=[1, 2, 3, 4])),
        "GET at short": ("GET", dict(keys=keys, obj=OBJ, region=0, at=[0])),
        "PUT at long": ("PUT", dict(keys=keys, obj=OBJ, region=0, at=[0, OBJ, 2 * OBJ, 3 * OBJ])),
        "GET at without a region": ("GET", dict(keys=keys, obj=OBJ, at=[0, OBJ, 2 * OBJ])),
        "GET pieces at short": ("GET", dict(keys=keys, obj=OBJ, pieces=[[0, OBJ // 2], [0, OBJ // 2]],
                                            at=[0, 1, 2, 3, 4])),
    }
    with Raw(gw.port, "lengths-engine") as raw:
        got = {name: answer(raw.ask(op, **fields)) for name, (op, fields) in cases.items()}
    assert got == {name: P.BAD_MESSAGE for name in cases}, got
    root = _root(gw.port)
    assert _exact(root, keys) == [True] * 3
    root.close()
    assert "did not answer" not in gw.log() and "list index" not in gw.log()


def test_namespace_owners_setting_is_checked():
    assert make_config({"namespace_owners": "a=0+1,id:0011223344556677=root"}).namespace_owners == \
        {"a": [0, 1], "id:0011223344556677": [0]}
    assert make_config({"namespace_owners": {"a": ["root", 7], "b": 3}}).namespace_owners == {"a": [0, 7], "b": [3]}
    for bad, why in [("a", "NAME=USER"), ("a=no-such-user-adpkv", "no user"), ("id:12=0", "16 hex"),
                     ({"a": []}, "list of users"), ({"a": [True]}, "not a user"), ({"a": [-1]}, "out of range"),
                     (["a"], "must map")]:
        with pytest.raises(ValueError, match=why):
            make_config({"namespace_owners": bad})


def _claim_in_a_process(device: str, uid: int, start, out) -> None:
    card = RespCard(device) if device.startswith("redis://") else FsCard(device, num_dbs=2)
    card.open()
    start.wait(10)
    out.put((uid, card.claim_namespace(namespace_id("raced"), uid)))
    card.close()


@pytest.mark.parametrize("kind", ["fs", "resp"])
def test_gateways_claiming_one_namespace_at_once_agree(kind, tmp_path, redis_servers):
    """Six processes (as gateways sharing a card would) claim one namespace at the same moment,
    each for another uid: every one is told the same owner, and that is what the card records."""
    import multiprocessing as mp
    device = str(tmp_path / "card") if kind == "fs" else redis_servers(1)[0].url
    probe = RespCard(device) if kind == "resp" else FsCard(device, num_dbs=2)
    probe.open()                                       # the card exists before the race
    assert probe.namespace_owner(namespace_id("raced")) is None
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_a_process, args=(device, 1000 + i, start, out)) for i in range(6)]
    for p in procs:
        p.start()
    start.set()
    told = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    assert len(told) == 6 and len(set(told.values())) == 1, told
    owner = probe.namespace_owner(namespace_id("raced"))
    assert owner in told and set(told.values()) == {owner}
    assert probe.claim_namespace(namespace_id("raced"), 7) == owner          # never replaced
    probe.close()
    if kind == "fs":
        assert sorted(os.listdir(tmp_path / "card" / "namespaces")) == [namespace_id("raced").hex()]
