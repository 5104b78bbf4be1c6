"""adpkv_core.jobs.JobBook: the one job book of every adapter (issue 39 item 5).

Its contract: submit -> id; a job finishes once all its futures are done; success is every
object of every request moved; each finished job is handed out exactly once; ``wait`` blocks
until jobs finish or its deadline passes. The futures are real ``concurrent.futures`` futures
resolved with the client's own result types (the last test: a real client against a real
gateway); other threads complete them behind barriers and events, never after sleeps.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from concurrent.futures import Future

import pytest

from adpkv_core.client import ClientConfig, GatewayClient, LoadResult, StoreResult
from adpkv_core.jobs import FinishedJob, JobBook

from ..rankproc import make_keys


def done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def test_a_job_finishes_with_its_last_future_and_is_handed_out_once():
    book: JobBook[str] = JobBook()
    a, b = Future(), Future()
    jid = book.submit([a, b], "meta")
    assert (book.running(), book.pending()) == (1, 1)
    a.set_result(LoadResult([True, True]))
    assert book.pop_finished() == [] and book.pop(jid) is None, "one of its two requests is still out"
    b.set_result(StoreResult([True], [False]))
    assert (book.running(), book.pending()) == (0, 1)
    (job,) = book.pop_finished()
    assert job.id == jid and job.meta == "meta" and job.ok and job.seconds >= 0
    assert job.results == (LoadResult([True, True]), StoreResult([True], [False]))
    assert book.pop_finished() == [] and book.pop(jid) is None and book.pending() == 0


def test_pop_by_id_hands_out_that_job_only_once():
    book: JobBook[int] = JobBook()
    first = book.submit([done(LoadResult([True]))], 1)
    second = book.submit([done(LoadResult([True]))], 2)
    assert book.pop(second).meta == 2
    assert book.pop(second) is None
    assert [j.id for j in book.pop_finished()] == [first], "pop_finished hands out only the rest"
    assert book.pop(first) is None


def test_success_needs_every_object_of_every_request_and_no_failure_at_submit():
    book: JobBook[None] = JobBook()
    raised: Future = Future()
    raised.set_exception(RuntimeError("gone"))
    cases = {
        "all read": ([done(LoadResult([True, True])), done(StoreResult([True], [True]))], False, True),
        "one miss": ([done(LoadResult([True, False]))], False, False),
        "not stored": ([done(StoreResult.none(2))], False, False),
        "raised": ([done(LoadResult([True])), raised], False, False),
        "failed at submit": ([done(LoadResult([True]))], True, False),
        "nothing sent, failed": ([], True, False),
        "nothing to send": ([], False, True),
        "EXIST found all": ([done([True, True])], False, True),
        "EXIST missed one": ([done([True, False])], False, False),
        "something else": ([done(None)], False, False),
    }
    ids = {name: book.submit(futs, None, failed=failed) for name, (futs, failed, _) in cases.items()}
    got = {j.id: j for j in book.pop_finished()}
    assert {name: got[i].ok for name, i in ids.items()} == {name: ok for name, (_, _, ok) in cases.items()}
    job = got[ids["raised"]]
    assert job.results[1] is None and job.flags(1, 3) == [False] * 3 and job.flags(0, 1) == [True]
    assert got[ids["one miss"]].flags(0, 2) == [True, False]
    assert got[ids["one miss"]].flags(0, 3) == [False] * 3, "a result of another length describes nothing"
    assert got[ids["not stored"]].flags(0, 2) == [False, False]
    assert got[ids["EXIST missed one"]].flags(0, 2) == [True, False]


def test_wait_returns_at_its_deadline_and_once_the_jobs_finished():
    book: JobBook[None] = JobBook()
    slow, quick = Future(), Future()
    s = book.submit([slow], None)
    q = book.submit([quick], None)
    t0 = time.monotonic()
    assert book.wait([s], timeout=0.2) is False
    assert time.monotonic() - t0 >= 0.19, "wait returned before its deadline"
    quick.set_result(LoadResult([True]))
    assert book.wait([q], timeout=0) is True, "a finished job needs no waiting"
    assert book.wait([12345], timeout=0) is True, "an id the book does not hold counts as finished"
    assert book.wait(timeout=0.05) is False, "every running job: the slow one still runs"
    finisher = threading.Thread(target=slow.set_result, args=(LoadResult([False]),))
    finisher.start()
    assert book.wait(timeout=10) is True
    finisher.join(10)
    assert {j.id: j.ok for j in book.pop_finished()} == {q: True, s: False}, "waiting hands nothing out"


def test_wait_any_wakes_at_the_first_job_that_ends_and_at_its_deadline_otherwise():
    book: JobBook[None] = JobBook()
    assert book.wait_any(10) is True, "nothing runs: no waiting"
    first, second = Future(), Future()
    a = book.submit([first], None)
    book.submit([second], None)
    t0 = time.monotonic()
    assert book.wait_any(0.2) is False
    assert time.monotonic() - t0 >= 0.19, "wait_any returned before its deadline"
    finisher = threading.Timer(0.05, first.set_result, args=(LoadResult([True]),))
    finisher.start()
    assert book.wait_any(10) is True, "the first job's end wakes it, the second still running"
    finisher.join(10)
    assert book.running() == 1
    assert book.wait_any(0) is True, "a finished job not handed out yet: no waiting"
    assert [j.id for j in book.pop_finished()] == [a], "waiting hands nothing out"
    assert book.wait_any(0.05) is False, "the second job runs and nothing waits to be handed out"


def test_wait_without_deadline_wakes_when_another_thread_completes_the_job():
    book: JobBook[None] = JobBook()
    fut: Future = Future()
    jid = book.submit([fut], None)
    waiting = threading.Event()
    returned = threading.Event()

    def waiter():
        waiting.set()
        book.wait({jid})
        returned.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(10)
    assert not returned.wait(0.1), "wait returned while the job still runs"
    fut.set_result(LoadResult([True]))
    assert returned.wait(10)
    t.join(10)


def test_concurrent_completion_hands_each_job_out_exactly_once_after_its_bookkeeping():
    jobs_n, per_job, threads_n = 200, 3, 8
    settled: set[int] = set()
    notified = [0]
    lock = threading.Lock()

    def on_finish(job: FinishedJob[int]) -> None:
        with lock:
            assert job.id not in settled, "bookkeeping ran twice"
            settled.add(job.id)

    def notify() -> None:
        with lock:
            notified[0] += 1

    book: JobBook[int] = JobBook(on_finish, notify)
    futures = [[Future() for _ in range(per_job)] for _ in range(jobs_n)]
    ids = [book.submit(fs, i) for i, fs in enumerate(futures)]
    assert len(set(ids)) == jobs_n
    # every future resolved by one of several threads, interleaved, while two threads pop
    flat = [(j, f) for j, fs in enumerate(futures) for f in fs]
    start = threading.Barrier(threads_n + 2)
    stop = threading.Event()
    popped: list[list[FinishedJob[int]]] = [[], []]
    errors: list[str] = []

    def complete(part):
        start.wait(10)
        for j, f in part:
            f.set_result(LoadResult([j % 7 != 0]))

    def popper(k):
        start.wait(10)
        while not stop.is_set():
            for job in book.pop_finished() if k == 0 else [book.pop(i) for i in ids]:
                if job is None:
                    continue
                with lock:
                    if job.id not in settled:
                        errors.append(f"job {job.id} handed out before its bookkeeping")
                popped[k].append(job)

    workers = [threading.Thread(target=complete, args=(flat[i::threads_n],)) for i in range(threads_n)]
    poppers = [threading.Thread(target=popper, args=(k,)) for k in range(2)]
    for t in workers + poppers:
        t.start()
    for t in workers:
        t.join(30)
    assert book.wait(timeout=30)
    stop.set()
    for t in poppers:
        t.join(30)
    rest = book.pop_finished()
    assert not errors, errors[:3]
    handed = [j.id for j in popped[0] + popped[1] + rest]
    assert sorted(handed) == sorted(ids), "every job handed out exactly once"
    assert len(settled) == jobs_n and notified[0] == jobs_n
    assert all(j.ok == (j.meta % 7 != 0) for j in popped[0] + popped[1] + rest)


def test_a_job_is_handed_out_only_after_its_bookkeeping_and_then_notified():
    in_hook, release, notified = threading.Event(), threading.Event(), threading.Event()
    book: JobBook[None] = JobBook(lambda job: (in_hook.set(), release.wait(10)), notified.set)
    fut: Future = Future()
    jid = book.submit([fut], None)
    finisher = threading.Thread(target=fut.set_result, args=(LoadResult([True]),))
    finisher.start()
    assert in_hook.wait(10)
    assert book.pop(jid) is None and book.pop_finished() == [] and book.running() == 1
    assert book.wait(timeout=0.05) is False and not notified.is_set()
    release.set()
    assert notified.wait(10)
    finisher.join(10)
    assert book.pop(jid).ok


def test_a_job_of_no_futures_finishes_inline_on_the_submitting_thread():
    seen = []
    book: JobBook[str] = JobBook(lambda job: seen.append((job.meta, threading.current_thread())))
    jid = book.submit([], "empty")
    assert seen == [("empty", threading.current_thread())]
    assert book.pop(jid).ok


def test_ids_the_engines_or_fresh_ones_shared_between_books():
    ids = itertools.count(10)
    a: JobBook[None] = JobBook(ids=ids)
    b: JobBook[None] = JobBook(ids=ids)
    assert [a.submit([], None), b.submit([], None), a.submit([], None)] == [10, 11, 12]
    assert b.submit([], None, job_id=7) == 7
    running: Future = Future()
    assert b.submit([running], None, job_id=8) == 8
    with pytest.raises(ValueError):
        b.submit([], None, job_id=8)               # still running
    with pytest.raises(ValueError):
        b.submit([], None, job_id=7)               # finished, not handed out yet
    b.pop(7)
    assert b.submit([], None, job_id=7) == 7, "an id handed out may come again"


def test_close_drops_what_was_not_handed_out_and_later_jobs_still_run_their_bookkeeping():
    settled, notified = [], []
    book: JobBook[str] = JobBook(lambda job: settled.append(job.meta), lambda: notified.append(1))
    book.submit([done(LoadResult([True]))], "before")
    late: Future = Future()
    jid = book.submit([late], "after")
    book.close()
    assert book.pop_finished() == []
    late.set_result(LoadResult([True]))
    assert settled == ["before", "after"] and len(notified) == 1
    assert book.pop(jid) is None and book.pending() == 0 and book.wait(timeout=0)


def test_a_failing_hook_is_logged_and_the_job_kept(caplog):
    def broken(job):
        raise RuntimeError("bookkeeping bug")

    book: JobBook[None] = JobBook(broken, lambda: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="adpkv.jobs"):
        jid = book.submit([done(LoadResult([True]))], None)
    assert book.pop(jid).ok
    assert sum("job %s" % jid in r.getMessage() for r in caplog.records) == 2


def test_jobs_of_a_real_clients_requests(gateway):
    """A real GatewayClient: its futures resolve on its I/O thread, the book reads GETs and PUTs
    one way, and a GET of keys never stored fails its job."""
    client = GatewayClient(ClientConfig(port=gateway.port, timeout_s=10.0), "jobs-engine")
    try:
        assert client.enabled
        obj = 4096
        keys = make_keys(6, namespace="jobs")
        bufs = [(ctypes.c_char * obj).from_buffer_copy(bytes([i + 1]) * obj) for i in range(6)]
        outs = [(ctypes.c_char * obj)() for _ in range(6)]
        ring = client.ring
        assert ring is not None

        def fill(base):             # object i of a request starting at key ``base``
            def copy(b):
                for j in range(b.count):
                    o = b.offset + j * b.stride
                    ring[o:o + obj] = bytes(bufs[base + b.first + j])
            return copy

        def drain(base):
            def copy(b):
                for j in range(b.count):
                    if b.hits[j]:
                        o = b.offset + j * b.stride
                        ctypes.memmove(outs[base + b.first + j], bytes(ring[o:o + obj]), obj)
            return copy

        book: JobBook[str] = JobBook()
        store = book.submit([client.put(keys[:3], obj, fill(0)), client.put(keys[3:4], obj, fill(3))], "store")
        assert book.wait({store}, timeout=30)
        (stored,) = book.pop_finished()
        assert stored.ok and stored.flags(0, 3) == [True] * 3 and stored.flags(1, 1) == [True]
        hit = book.submit([client.get(keys[:4], obj, drain(0))], "load")
        miss = book.submit([client.get(keys[:2], obj, drain(0)), client.get(keys[4:], obj, drain(4))], "partial")
        assert book.wait(timeout=30)
        got = {j.meta: j for j in book.pop_finished()}
        assert got["load"].id == hit and got["load"].ok
        assert [bytes(o) for o in outs[:4]] == [bytes(b) for b in bufs[:4]]
        assert got["partial"].id == miss and not got["partial"].ok
        assert got["partial"].flags(0, 2) == [True, True] and got["partial"].flags(1, 2) == [False, False]
    finally:
        client.close()
