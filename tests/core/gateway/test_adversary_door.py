"""The door under a hostile local user (issue 25, items 1, 5 (the door's half), 7 and 9).

A real gateway runs as root; the adversary is a forked child of the test that drops to
uid/gid 65534 after the imports (it cannot read the venv under /root, so it never execs
python: an impostor *gateway* is ``adpkv_gateway.loop.server.Gateway`` run in that child, the
real class on a card of its own). Root's side is a real ``GatewayClient``.

What is shown:

- a client attaches only to a gateway run by a user it trusts (root, its own user,
  ``gateway_users``): an impostor that holds the door and the port gets nothing, with one
  clear line naming its uid; one that holds only the control port (the real door beside
  it) cannot answer HELLO with the session's proof;
- the lock beside the door is 0600 and the gateway's own: after a clean stop nobody else
  can take it, and root's gateway starts again; a lock or door another user put there is
  refused, naming that user's uid;
- idle connections, connections that never ask for a session and a user holding more
  connections than the descriptors allow do not keep root's engine out, and the gateway
  neither spins nor floods its log; it raises its soft open-files limit at start;
- an engine that attaches the moment the control port answers gets the cache.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pwd
import resource
import shutil
import signal
import socket
import stat
import tempfile
import time
import traceback

import msgspec
import pytest
import zmq

from adpkv_core import protocol as P
from adpkv_core.client import GatewayClient, gateway_answers
from adpkv_core.door import DoorSession, door_path, lock_path
from adpkv_core.settings import ClientConfig
from adpkv_gateway.config import make_config
from adpkv_gateway.loop.server import Gateway
from adpkv_gateway.ops.spawn import GatewayProcess, free_port

from ..rankproc import get_checked, make_keys, pattern

NOBODY = 65534
OBJ = 8192

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway runs as root, the "
                                 "adversary as uid 65534"),
              pytest.mark.timeout(180), pytest.mark.security]


# ---------------------------------------------------------------- the unprivileged side
def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    assert os.geteuid() == NOBODY


class Nobody:
    """A forked child running ``fn(report, *args)`` as uid 65534 until ``stop()`` (SIGTERM).
    ``report(value)`` sends a value to the test (``expect()`` returns the next one); an
    exception in the child comes back as AssertionError with its traceback."""

    def __init__(self, fn, *args):
        ctx = mp.get_context("fork")
        self._q = ctx.Queue()

        def child():
            try:
                _drop_to_nobody()
                fn(lambda value: self._q.put(("ok", value)), *args)
            except BaseException:
                self._q.put(("error", traceback.format_exc()))

        self.proc = ctx.Process(target=child, daemon=True)
        self.proc.start()

    def expect(self, timeout: float = 60.0):
        kind, value = self._q.get(timeout=timeout)
        if kind == "error":
            raise AssertionError("in the unprivileged child:\n" + value)
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def as_nobody(fn, *args, timeout: float = 60.0):
    """``fn(*args)`` as uid 65534 in a forked child; its return value."""
    child = Nobody(lambda report, *a: report(fn(*a)), *args)
    try:
        return child.expect(timeout)
    finally:
        child.stop()


def _impostor_gateway(report, port: int, card: str, log_path: str) -> None:
    """Run the real gateway class as uid 65534 on ``port`` (door mode 0666, its own card)."""
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        gateway = Gateway(make_config({"port": port, "storage_devices": [card], "control_socket_mode": "0666",
                                       "shared_memory_size": 16 << 20, "thread_pool_size": 2}))
    except SystemExit as exc:
        report(("refused", str(exc)))
        return
    report(("up", None))
    gateway.serve_forever()


@pytest.fixture
def open_dir():
    """A directory uid 65534 may write (its card and log go there)."""
    path = tempfile.mkdtemp(prefix="adpkv-adv-", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def port_cleanup():
    """Ports whose door and lock this test may leave in /dev/shm (another user's files)."""
    ports: list[int] = []
    yield ports
    for port in ports:
        for path in (door_path(port), lock_path(door_path(port))):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _fill(client, keys):
    def fill(b):
        for j in range(b.count):
            o = b.offset + j * b.stride
            client.ring[o:o + OBJ] = pattern(keys[b.first + j], 0, OBJ)
    return fill


def _root_engine_works(port: int, **settings) -> None:
    """Root's engine attaches and stores and reads its objects byte-exact."""
    keys = make_keys(4, namespace="root-adv", salt=os.urandom(4))
    client = GatewayClient(ClientConfig(port=port, connect_timeout_s=5.0, busy_wait_s=0, **settings), "root-engine")
    try:
        assert client.enabled, "root's engine could not attach"
        assert client.put(keys, OBJ, _fill(client, keys)).result(20).stored == [True] * 4
        assert get_checked(client, keys, OBJ) == [True] * 4
    finally:
        client.close()


def _door_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "Door:" in line or "accept failed" in line]


# ---------------------------------------------------------------- 1: impostor gateways
def test_an_impostor_gateway_on_the_port_gets_nothing_from_roots_engine(open_dir, port_cleanup, caplog):
    port = free_port()
    port_cleanup.append(port)
    card, log = os.path.join(open_dir, "card"), os.path.join(open_dir, "impostor.log")
    impostor = Nobody(_impostor_gateway, port, card, log)
    try:
        assert impostor.expect() == ("up", None)
        st = os.stat(door_path(port))
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o666
        keys = make_keys(4, namespace="root-adv")
        config = ClientConfig(port=port, connect_timeout_s=2.0, busy_wait_s=0)
        assert not gateway_answers(config), "the re-attach probe must not count an untrusted gateway"
        with caplog.at_level(logging.WARNING, logger="adpkv.client"):
            client = GatewayClient(config, "root-engine")
        try:
            assert not client.enabled
            lines = [r.getMessage() for r in caplog.records if "uid 65534" in r.getMessage()]
            assert len(lines) == 1 and "not a user this client trusts" in lines[0], lines
            assert client.put(keys, OBJ, _fill(client, keys)).result(5).stored == [False] * 4
        finally:
            client.close()
        with open(log) as fh:
            seen = fh.read()
        assert "Engine root-engine" not in seen, seen
        # the setting that names the impostor's user opens exactly that
        trusting = GatewayClient(ClientConfig(port=port, connect_timeout_s=2.0, busy_wait_s=0,
                                              gateway_users=pwd.getpwuid(NOBODY).pw_name), "root-engine")
        assert trusting.enabled
        trusting.close()
        # root's own gateway on that port refuses to start, naming who holds it
        refused = GatewayProcess(os.path.join(open_dir, "root-card"), port=port,
                                 log_path=os.path.join(open_dir, "root.log"))
        with pytest.raises(RuntimeError) as exc:
            refused.start(timeout_s=20)
        assert "is held by uid 65534" in str(exc.value) and "another gateway is running" not in str(exc.value)
    finally:
        impostor.stop()


def _fake_control_port(report, port: int, door: str) -> None:
    """Hold ``port`` and answer every request OK, HELLO with the proof of a session of our
    own at the real door (the best a process without the door's secrets can forge)."""
    own = DoorSession(door, 3.0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    report("up")
    seen = []
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        ident, frame = sock.recv_multipart()
        msg = msgspec.msgpack.decode(frame)
        seen.append(msg.get("op"))
        sock.send_multipart([ident, P.encode(P.HelloOk(id=msg.get("id"), proof=own.proof))])


def test_a_process_on_the_control_port_is_not_taken_for_the_doors_gateway(start_gateway, open_dir):
    door = os.path.join(open_dir, "door.sock")
    start_gateway(control_socket=door, control_socket_mode="0666")
    port = free_port()
    fake = Nobody(_fake_control_port, port, door)
    try:
        assert fake.expect() == "up"
        logger = logging.getLogger("adpkv.client")
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())
        logger.addHandler(handler)
        try:
            client = GatewayClient(ClientConfig(port=port, socket=door, connect_timeout_s=3.0, busy_wait_s=0),
                                   "root-engine")
        finally:
            logger.removeHandler(handler)
        try:
            assert not client.enabled
            assert any("is not the gateway of the door" in r for r in records), records
        finally:
            client.close()
    finally:
        fake.stop()


def test_gateway_users_names_the_users_a_client_also_trusts():
    config = ClientConfig.from_settings({"adpkv.gateway_users": f"{pwd.getpwuid(NOBODY).pw_name}, 1234"},
                                        prefix="adpkv.")
    assert config.trusted_gateway_uids() == {0, os.geteuid(), NOBODY, 1234}
    with pytest.raises(ValueError, match="gateway_users: no user 'no-such-user-x'"):
        ClientConfig.from_settings({"gateway_users": "no-such-user-x"})


# ---------------------------------------------------------------- 1: the lock and the door
def _take_the_lock_and_port(port: int, card: str) -> dict:
    seen = {}
    lock = lock_path(door_path(port))
    try:
        os.close(os.open(lock, os.O_RDONLY))
        seen["open"] = "opened"
    except PermissionError:
        seen["open"] = "EACCES"
    try:
        Gateway(make_config({"port": port, "storage_devices": [card], "control_socket_mode": "0666",
                             "shared_memory_size": 16 << 20, "thread_pool_size": 2}))
        seen["gateway"] = "started"
    except SystemExit as exc:
        seen["gateway"] = str(exc)
    return seen


def test_after_a_clean_stop_the_lock_is_nobody_elses_and_root_restarts(start_gateway, open_dir, port_cleanup):
    gw = start_gateway(control_socket_mode="0666")
    port_cleanup.append(gw.port)
    lock = lock_path(door_path(gw.port))
    gw.proc.send_signal(signal.SIGTERM)     # a clean stop that leaves the lock (GatewayProcess.stop removes it)
    assert gw.proc.wait(30) == 0
    gw.proc = None
    st = os.stat(lock)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert not os.path.exists(door_path(gw.port))
    seen = as_nobody(_take_the_lock_and_port, gw.port, os.path.join(open_dir, "card"))
    assert seen["open"] == "EACCES"
    assert "held by uid 0" in seen["gateway"], seen
    assert not os.path.exists(door_path(gw.port)), "the refused impostor must leave no door"
    gw.start(timeout_s=20)                  # root's gateway reclaims its own lock
    _root_engine_works(gw.port)


def _squat(path: str, kind: str) -> None:
    if kind == "lock":
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666))
        os.chmod(path, 0o666)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(path)
        s.close()                           # the socket file stays


@pytest.mark.parametrize("kind", ["lock", "door"])
def test_a_squatted_lock_or_door_is_refused_naming_its_user(open_dir, port_cleanup, kind):
    port = free_port()
    port_cleanup.append(port)
    door = door_path(port)
    as_nobody(_squat, lock_path(door) if kind == "lock" else door, kind)
    gw = GatewayProcess(os.path.join(open_dir, "card"), port=port, log_path=os.path.join(open_dir, "gw.log"))
    with pytest.raises(RuntimeError) as exc:
        gw.start(timeout_s=20)
    text = str(exc.value)
    assert f"the {kind} {lock_path(door) if kind == 'lock' else door} is held by uid 65534" in text, text
    assert "another gateway is running" not in text
    assert "Gateway listening" not in text


# ---------------------------------------------------------------- 7: idle connections
def _hold_connections(report, door: str, n: int) -> None:
    """Open ``n`` door connections (retrying while the door's backlog is full), send nothing,
    hold them; report how many connected."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    held = []
    deadline = time.monotonic() + 60
    while len(held) < n and time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(door)
            held.append(s)
        except BlockingIOError:          # the backlog is full: the gateway has not accepted yet
            s.close()
            time.sleep(0.001)
    report(len(held))
    signal.pause()


def _gateway_stats(port: int) -> dict:
    from adpkv_gateway.ops import control
    return control.request(port, {"op": "STATS"})["stats"]


def test_idle_connections_of_another_user_do_not_lock_out_roots_engine(start_gateway):
    gw = start_gateway(control_socket_mode="0666")
    hog = Nobody(_hold_connections, door_path(gw.port), 4200)
    try:
        assert hog.expect(120) == 4200
        _root_engine_works(gw.port)
        sessions = _gateway_stats(gw.port)["sessions"]
        assert sessions <= 256 + 2, f"{sessions} door sessions open: the per-user cap did not hold"
        lines = _door_lines(gw.log())
        assert len(lines) <= 6, lines
    finally:
        hog.stop()


def _silent_connections(door: str) -> dict:
    out = {}
    for name, ask in (("no SESSION", False), ("SESSION, token never used", True)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(15.0)
        s.connect(door)
        t0 = time.monotonic()
        if ask:
            s.send(P.encode(P.SessionRequest(id=1)))
            data, fds, _, _ = socket.recv_fds(s, 1 << 16, 1)
            for fd in fds:
                os.close(fd)
        try:
            closed = s.recv(1 << 16) == b""
        except TimeoutError:
            closed = False
        out[name] = (closed, time.monotonic() - t0)
        s.close()
    return out


def test_connections_that_do_not_complete_a_session_are_closed_by_the_deadline(start_gateway):
    gw = start_gateway(control_socket_mode="0666", door_handshake_s=1.0)
    seen = as_nobody(_silent_connections, door_path(gw.port))
    for name, (closed, after_s) in seen.items():
        assert closed and 0.9 <= after_s < 4.0, (name, closed, after_s)
    _root_engine_works(gw.port)             # a client that uses its session at once is not cut


# ---------------------------------------------------------------- 5: descriptors
def test_a_user_with_more_connections_than_descriptors_neither_spins_the_door_nor_keeps_root_out(start_gateway):
    gw = start_gateway(control_socket_mode="0666", door_connections_per_user=5000)
    pid = gw.proc.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (1024, 1024))     # a common service default
    hog = Nobody(_hold_connections, door_path(gw.port), 1100)
    try:
        assert hog.expect(120) == 1100
        _root_engine_works(gw.port)
        sessions = _gateway_stats(gw.port)["sessions"]
        assert sessions <= 1024 - 256 + 2, sessions
        assert "Door: users other than root" in gw.log(), "the 1100 connections did not reach the door's budget"
        # now run the gateway out of descriptors outright: EMFILE on every accept
        open_now = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_now, 1024))
        more = Nobody(_hold_connections, door_path(gw.port), 400)
        try:
            more.expect(120)
            client = GatewayClient(ClientConfig(port=gw.port, connect_timeout_s=5.0, busy_wait_s=0), "root-engine")
            try:
                assert client.enabled, "root's engine could not attach with the gateway out of descriptors"
            finally:
                client.close()
        finally:
            more.stop()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (1024, 1024))
        assert gw.alive()
        lines = _door_lines(gw.log())
        assert len(lines) <= 12, f"{len(lines)} door lines:\n" + "\n".join(lines[:20])
    finally:
        hog.stop()


class _LimitedGateway(GatewayProcess):
    """A gateway started with soft/hard open-files limits 1024/4096 (as a service might be)."""

    def command(self) -> list[str]:
        return ["prlimit", "--nofile=1024:4096", "--"] + super().command()


def test_the_gateway_raises_its_soft_open_files_limit_to_the_hard_one(tmp_path):
    gw = _LimitedGateway(str(tmp_path / "card"), log_path=str(tmp_path / "gw.log"), shared_memory_size=16 << 20)
    gw.start(timeout_s=30)
    try:
        with open(f"/proc/{gw.proc.pid}/limits") as fh:
            line = next(l for l in fh if l.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line
        assert "soft limit raised from 1024 to 4096" in gw.log()
    finally:
        gw.stop()


# ---------------------------------------------------------------- 9: ready means usable
def test_a_gateway_that_cannot_have_its_port_leaves_no_door(tmp_path):
    """The port is bound last; when that fails, everything before it is undone."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        gw = GatewayProcess(str(tmp_path / "card"), port=port, log_path=str(tmp_path / "gw.log"),
                            shared_memory_size=16 << 20)
        gw.start(wait=False)
        assert gw.proc.wait(30) == 2
        gw.proc = None
        assert "cannot listen on 127.0.0.1:%d" % port in gw.log()
        assert not os.path.exists(door_path(port)), "the door of a gateway that did not start is left behind"
        os.unlink(lock_path(door_path(port)))



def test_an_engine_attaching_the_moment_the_port_answers_gets_the_cache(tmp_path):
    gw = GatewayProcess(str(tmp_path / "card"), log_path=str(tmp_path / "gw.log"), shared_memory_size=16 << 20)
    gw.start(wait=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline and gw.proc.poll() is None, gw.log()
            try:
                socket.create_connection(("127.0.0.1", gw.port), timeout=0.05).close()
                break
            except OSError:
                continue
        _root_engine_works(gw.port)
    finally:
        gw.stop()
