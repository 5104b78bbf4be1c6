"""Sleep mode (vLLM 0.33: ``unregister_kv_caches`` before the KV cache's memory is released,
``restore_kv_caches`` after the wake-up) with AdpKVConnector's worker role.

What runs, all real: the connector's worker role on CPU KV tensors under vLLM's own
Scheduler (harness.py), real gateway processes, the gate's threads. The release and the
wake-up are played by the test on those tensors: after ``unregister_kv_caches`` the old
memory is overwritten (what released memory may hold), and the wake-up puts the KV cache
in new storage (``Tensor.set_``: new addresses, the same tensor objects vLLM registered).

What did not run without a GPU: vLLM's sleep-mode backend (``CuMemBackend``: unmapping and
remapping the KV cache's device memory), the GPU worker calling these hooks, CUDA copies.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid

import torch

from adpkv_vllm.connector.kv_gate import KVGate
from harness import Harness

CHUNK = 64


def tokens(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def stored(model_dir, port, toks):
    """A namespace in which one engine stored ``toks``."""
    ns = f"z-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, port, namespace=ns, chunk_size=CHUNK)
    try:
        h.add(toks)
        h.run()
    finally:
        h.close()
    return ns


def test_the_gate_waits_for_running_copies_and_voids_earlier_tickets():
    gate = KVGate()
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()
    before = gate.ticket()

    def copy():
        inside.set()
        assert release.wait(10)

    t = threading.Thread(target=gate.run, args=(before, copy))
    t.start()
    assert inside.wait(10)
    closer = threading.Thread(target=lambda: (gate.close(), closed.set()))
    closer.start()
    assert not closed.wait(0.3), "close returned while a copy was still running"
    release.set()
    assert closed.wait(10)
    t.join(10)
    closer.join(10)
    ran = []
    assert gate.run(gate.ticket(), lambda: ran.append(1)) is False      # closed: nothing runs
    gate.open()
    assert gate.run(before, lambda: ran.append(2)) is False             # a request from before the sleep
    assert gate.run(gate.ticket(), lambda: ran.append(3)) is True
    assert ran == [3]


def test_restore_follows_kv_memory_to_its_new_addresses(gateway, model_dir):
    """After the wake-up the KV tensors live in new storage: a restore writes there (every
    byte checked), not into the memory of before the sleep."""
    toks = tokens(500, 1)
    ns = stored(model_dir, gateway.port, toks)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        h.worker.unregister_kv_caches()
        h.worker.unregister_kv_caches()                      # idempotent
        old = {n: kv.clone() for n, kv in h.kv.items()}
        for kv in h.kv.values():
            kv.set_(torch.zeros(kv.shape, dtype=kv.dtype))   # the wake-up: new addresses
        h.worker.restore_kv_caches()
        h.worker.restore_kv_caches()                         # idempotent
        req = h.add(toks)
        so, meta = h.step()
        assert sum(len(p.block_ids) for p in meta.loads) * h.block_size == 448
        assert so.num_scheduled_tokens[req.request_id] == 500 - 448
        h.check_kv(req, 500)
        assert not any(h.load_errors)
        for n, kv in h.kv.items():
            assert kv.data_ptr() != old[n].data_ptr()
    finally:
        h.close()


def test_a_save_in_flight_at_the_sleep_never_reads_the_released_memory(gateway, model_dir):
    """A PUT sent before the sleep whose ring batch arrives after ``unregister_kv_caches``
    (the gateway held, SIGSTOP, across it): its batch is refused, nothing is stored, also not
    after the wake-up. So the bytes the released memory holds then never reach the card: a
    later engine finds nothing and computes the prompt itself."""
    toks, ns = tokens(300, 2), f"z-{uuid.uuid4().hex[:6]}"
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    pid = gateway.proc.pid
    bind = h.worker.bind_connector_metadata
    held = []

    def hold_gateway_then_bind(meta):       # after this step's lookups, before its saves
        if not held:
            os.kill(pid, signal.SIGSTOP)
            held.append(time.monotonic())
        bind(meta)

    try:
        h.worker.bind_connector_metadata = hold_gateway_then_bind
        req = h.add(toks)
        so, meta = h.step()
        assert so.num_scheduled_tokens[req.request_id] == 300 and meta.saves   # the saves went out
        h.worker.unregister_kv_caches()
        for kv in h.kv.values():
            kv.fill_(-7.0)                   # what the released memory holds now
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - held[0] < 1.5, "held past the client's timeout: not the case tried"
        jobs = [j for js in h.worker.connector_worker._jobs_by_req.values() for j in js]
        assert jobs
        deadline = time.monotonic() + 20
        while not all(j.is_copied() for j in jobs):
            assert time.monotonic() < deadline, "the PUTs never ended"
            time.sleep(0.01)
        h.worker.restore_kv_caches()
    finally:
        os.kill(pid, signal.SIGCONT)
        h.close()
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req = h.add(toks)
        so, meta = h.step()
        assert not meta.loads and so.num_scheduled_tokens[req.request_id] == 300
        h.check_kv(req, 300)
    finally:
        h.close()


def test_asleep_no_load_touches_the_kv_tensors(gateway, model_dir):
    """Between ``unregister_kv_caches`` and ``restore_kv_caches`` a load (were one asked for)
    reads nothing into the blocks: every block of it is a load error, the tensors untouched."""
    toks = tokens(300, 3)
    ns = stored(model_dir, gateway.port, toks)
    h = Harness(model_dir, gateway.port, namespace=ns, chunk_size=CHUNK)
    try:
        req = h.add(toks)
        so = h.scheduler.schedule()
        meta = so.kv_connector_metadata
        assert sum(len(p.block_ids) for p in meta.loads) * h.block_size == 256
        h.worker.unregister_kv_caches()
        before = {n: kv.clone() for n, kv in h.kv.items()}
        w = h.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for name in h.layer_names:
            w.wait_for_layer_load(name)
        w.wait_for_save()
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        assert errors == {b for p in meta.loads for b in p.block_ids}
        assert all(torch.equal(kv, before[n]) for n, kv in h.kv.items())
        assert req.request_id in so.num_scheduled_tokens
    finally:
        h.close()
