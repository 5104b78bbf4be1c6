"""``datapath.writing.Writing``: which lookups wait for which card writes (the gateway's
loop uses it for a GET's lookup stage; the real-gateway test is
test_gateway_data.py::test_a_prompt_back_before_its_writes_landed_is_answered_at_once_and_restored_whole)."""

from __future__ import annotations

from adpkv_gateway.datapath.writing import Writing


def test_a_lookup_waits_for_the_writes_of_its_keys_then_runs_once():
    w, ran = Writing(), []
    w.begin(1, [b"a", b"b"])
    w.begin(2, [b"c"])
    w.after([b"a", b"c", b"x"], lambda: ran.append("ac"))
    w.after([b"x", b"y"], lambda: ran.append("other"))       # nobody writes these: at once
    assert ran == ["other"]
    w.end(1, [b"a", b"b"])
    assert ran == ["other"]                                   # c still being written
    w.end(2, [b"c"])
    assert ran == ["other", "ac"]
    w.begin(3, [b"a"])
    w.end(3, [b"a"])
    assert ran == ["other", "ac"]                             # run once, not again


def test_later_writes_of_the_same_key_never_hold_a_waiting_lookup():
    w, ran = Writing(), []
    w.begin(1, [b"k"])
    w.after([b"k"], lambda: ran.append(1))
    w.begin(2, [b"k"])                                        # a later store of the same key
    w.end(1, [b"k"])
    assert ran == [1]
    w.after([b"k"], lambda: ran.append(2))                    # batch 2 still writes k
    assert ran == [1]
    w.end(2, [b"k"])
    assert ran == [1, 2]
    w.after([b"k"], lambda: ran.append(3))                    # nothing in flight any more
    assert ran == [1, 2, 3]


def test_a_batch_naming_a_key_twice_ends_cleanly():
    """A PUT may name one key twice (the control-port fuzzer found the gateway's loop stopped
    by it: the second ``end`` of the key raised)."""
    w, ran = Writing(), []
    w.begin(1, [b"k", b"j", b"k"])
    w.after([b"k"], lambda: ran.append(1))
    w.end(1, [b"k", b"j", b"k"])
    assert ran == [1]
    w.after([b"k", b"j"], lambda: ran.append(2))
    assert ran == [1, 2]
