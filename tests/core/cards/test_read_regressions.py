"""Regressions found by the adversarial review of session 5's read paths (real gateways, real
card files): a GET must never take another object's bytes, and a region GET must read the
object's other replica as the ring path does."""
import os

import pytest

from ..rankproc import make_keys
from .test_read_attacks import ShmFile, _client, frag_path, get, pattern, put

pytestmark = pytest.mark.read_attacks


def test_a_get_at_another_object_size_is_a_miss(start_gateway):
    """Objects stored at 1 MiB in 64 KiB fragments: a GET of the same keys at 512 KiB must not
    find them (the head records 1 MiB; its first fragments are not a 512 KiB object), nor a
    GET at 64 KiB (one fragment: the planner's fast path) objects stored at 128 KiB."""
    gw = start_gateway(fragment_size=64 * 1024)
    keys = make_keys(4)
    c = _client(gw.port, "sizes")
    try:
        assert put(c, keys, 1 << 20) == [True] * 4
        assert get(c, keys, 2 << 20) == [False] * 4            # larger: fragments 16.. absent
        hits = get(c, keys, 512 << 10)
        assert hits == [False] * 4, f"a 512 KiB GET found 1 MiB objects (served their first half): {hits}"
        assert get(c, keys, 1 << 20) == [True] * 4             # the objects themselves still read
        two = make_keys(4, salt=b"two")
        assert put(c, two, 128 << 10) == [True] * 4             # two fragments
        hits = get(c, two, 64 << 10)
        assert hits == [False] * 4, f"a 64 KiB GET found 128 KiB objects (served their first half): {hits}"
        assert list(c.exist(two).result(30)) == [True] * 4
    finally:
        c.close()


def test_a_region_get_falls_back_to_the_replica(start_gateway, tmp_path):
    """replicas=2, every file on the first card gone: the ring GET reads the other replica,
    and so does a GET into a region, byte for byte."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    gw = start_gateway(card_dirs=dirs, replicas=2, key_placement="stripe")
    keys, obj = make_keys(8), 64 * 1024
    c = _client(gw.port, "replica-region")
    f = ShmFile(8 * obj)
    try:
        assert put(c, keys, obj) == [True] * 8
        for k in keys:
            os.unlink(frag_path(dirs[0], k))
        rid = c.register_region(f.path, 0, 8 * obj).result(10)
        hits = list(c.get_into(rid, [i * obj for i in range(8)], keys, obj).result(30).hits)
        assert hits == [True] * 8, f"region GET did not fall back to the replica: {hits}"
        wrong = [i for i, k in enumerate(keys) if f.read(i * obj, obj) != pattern(k, 0, obj)]
        assert not wrong, f"wrong bytes in the region for objects {wrong}"
        assert get(c, keys, obj) == [True] * 8                 # the ring path agrees
    finally:
        f.close()
        c.close()
