"""The door under a hostile local user (issue 25, items 1, 5 (the door's half), 7 and 9;
issue 38, item 7).

A real gateway runs as root; the adversary is a forked child of the test that drops to
uid/gid 65534 after the imports (it cannot read the venv under /root, so it never execs
python: an impostor *gateway* is ``adpkv_gateway.loop.server.Gateway`` run in that child, the
real class on a card of its own). Root's side is a real ``GatewayClient``.

What is shown:

- the door and its lock are where only the gateway's user may create entries: root's in
  /run/adpkv, another user's in its own /dev/shm/adpkv-<uid> (``adpkv_core.wire.door``). A user
  that creates every path it can for a port's door (the old /dev/shm/adpkv-<port>.sock and its
  lock, /dev/shm/adpkv-0, ...) does not stop root's gateway, and cannot create anything in
  /run/adpkv; a door directory that is not its user's own (another user's, writable by others,
  a symbolic link, a file) is refused in one line naming it and its owner, and a client passes
  over it to find root's gateway;
- a client attaches only to a gateway run by a user it trusts (root, its own user,
  ``gateway_users``) and looks for a door only in those users' door directories: an impostor
  gateway of another user is not even found, and one at a door the client is told to use
  gets nothing, with one clear line naming its uid; one that holds only the control port (the
  real door beside it) cannot answer HELLO with the session's proof;
- the lock beside the door is 0600 and the gateway's own: after a clean stop nobody else
  can take it, and root's gateway starts again; at a door path a setting names
  (``control_socket``), a lock or door another user put there is refused, naming that user's
  uid;
- idle connections, connections that never ask for a session and a user holding more
  connections than the descriptors allow do not keep root's engine out, and the gateway
  neither spins nor floods its log; it raises its soft open-files limit at start;
- an engine that attaches the moment the control port answers gets the cache.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import pwd
import random
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

from adpkv_core.wire import protocol as P
from adpkv_core.client import GatewayClient, gateway_answers
from adpkv_core.wire.door import SHM_DIR, DoorSession, door_dir, door_path, lock_path
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
def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    assert os.geteuid() == uid


class Nobody:
    """A forked child running ``fn(report, *args)`` as uid 65534 (or ``uid``) until ``stop()``
    (SIGTERM). ``report(value)`` sends a value to the test (``expect()`` returns the next one);
    an exception in the child comes back as AssertionError with its traceback."""

    def __init__(self, fn, *args, uid: int = NOBODY):
        ctx = mp.get_context("fork")
        self._q = ctx.Queue()

        def child():
            try:
                _drop_to(uid)
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


def as_nobody(fn, *args, timeout: float = 60.0, uid: int = NOBODY):
    """``fn(*args)`` as uid 65534 (or ``uid``) in a forked child; its return value."""
    child = Nobody(lambda report, *a: report(fn(*a)), *args, uid=uid)
    try:
        return child.expect(timeout)
    finally:
        child.stop()


def _gateway_here(port: int, card: str, **settings) -> Gateway:
    """The real gateway class, in this process (door mode 0666, its own card)."""
    return Gateway(make_config({"port": port, "storage_devices": [card], "control_socket_mode": "0666",
                                "shared_memory_size": 16 << 20, "thread_pool_size": 2, **settings}))


def _impostor_gateway(report, port: int, card: str, log_path: str) -> None:
    """Run the real gateway class as uid 65534 on ``port`` (door mode 0666, its own card)."""
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        gateway = _gateway_here(port, card)
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


def _old_door(port: int) -> str:
    """Where every gateway's door was before the door directories: /dev/shm/adpkv-<port>.sock."""
    return os.path.join(SHM_DIR, f"adpkv-{port}.sock")


@pytest.fixture
def port_cleanup():
    """Ports whose doors and locks this test may leave behind (another user's files): root's,
    uid 65534's and the old ones in /dev/shm."""
    ports: list[int] = []
    yield ports
    for port in ports:
        for door in (door_path(port, 0), door_path(port, NOBODY), _old_door(port)):
            for path in (door, lock_path(door)):
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
def _client_lines(config: ClientConfig, caplog) -> tuple[GatewayClient, list[str]]:
    """A client of root's engine made with ``config``, and the lines its attachment logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adpkv.client"):
        client = GatewayClient(config, "root-engine")
    return client, [r.getMessage() for r in caplog.records if r.name == "adpkv.client"]


def test_an_impostor_gateway_on_the_port_gets_nothing_from_roots_engine(open_dir, port_cleanup, caplog):
    port = free_port()
    port_cleanup.append(port)
    card, log = os.path.join(open_dir, "card"), os.path.join(open_dir, "impostor.log")
    impostor = Nobody(_impostor_gateway, port, card, log)
    try:
        assert impostor.expect() == ("up", None)
        door = door_path(port, NOBODY)              # its own door directory, made by it
        st, home = os.stat(door), os.lstat(door_dir(NOBODY))
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o666
        assert home.st_uid == NOBODY and stat.S_IMODE(home.st_mode) == 0o755
        keys = make_keys(4, namespace="root-adv")
        # root's client looks only in the door directories of users it trusts: nothing found
        config = ClientConfig(port=port, connect_timeout_s=2.0, busy_wait_s=0)
        assert not gateway_answers(config), "the re-attach probe must not count an untrusted gateway"
        client, lines = _client_lines(config, caplog)
        try:
            assert not client.enabled
            assert len(lines) == 1 and f"no gateway's door for port {port} in {door_dir(0)}" in lines[0], lines
            assert client.put(keys, OBJ, _fill(client, keys)).result(5).stored == [False] * 4
        finally:
            client.close()
        # told to use that door: refused on connect, in one line naming the impostor's uid
        config = ClientConfig(port=port, socket=door, connect_timeout_s=2.0, busy_wait_s=0)
        assert not gateway_answers(config)
        client, lines = _client_lines(config, caplog)
        try:
            assert not client.enabled
            lines = [line for line in lines if "uid 65534" in line]
            assert len(lines) == 1 and "not a user this client trusts" in lines[0], lines
        finally:
            client.close()
        with open(log) as fh:
            seen = fh.read()
        assert "Engine root-engine" not in seen, seen
        # the setting that names the impostor's user opens exactly that (its door directory too)
        trusting = GatewayClient(ClientConfig(port=port, connect_timeout_s=2.0, busy_wait_s=0,
                                              gateway_users=pwd.getpwuid(NOBODY).pw_name), "root-engine")
        assert trusting.enabled
        trusting.close()
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
def _create(path: str, kind: str) -> str:
    """Try to create ``path`` as ``kind`` (file, socket, dir, symlink); "made" or the errno's name."""
    try:
        if kind == "file":
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666))
            os.chmod(path, 0o666)
        elif kind == "socket":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.bind(path)                # the socket file stays once it is closed
            finally:
                s.close()
        elif kind == "dir":
            os.mkdir(path)
            os.chmod(path, 0o777)
        else:
            os.symlink("/tmp", path)
        return "made"
    except OSError as exc:
        return errno.errorcode[exc.errno]


def _take_the_lock_and_port(port: int, card: str) -> dict:
    seen = {}
    door = door_path(port, 0)
    try:
        os.close(os.open(lock_path(door), os.O_RDONLY))
        seen["open"] = "opened"
    except PermissionError:
        seen["open"] = "EACCES"
    seen["create"] = _create(os.path.join(door_dir(0), "mine"), "file")
    try:
        _gateway_here(port, card, control_socket=door)          # root's door, by name
        seen["gateway"] = "started"
    except SystemExit as exc:
        seen["gateway"] = str(exc)
    return seen


def test_after_a_clean_stop_the_lock_is_nobody_elses_and_root_restarts(start_gateway, open_dir, port_cleanup):
    gw = start_gateway(control_socket_mode="0666")
    port_cleanup.append(gw.port)
    lock = lock_path(door_path(gw.port, 0))
    gw.proc.send_signal(signal.SIGTERM)     # a clean stop that leaves the lock (GatewayProcess.stop removes it)
    assert gw.proc.wait(30) == 0
    gw.proc = None
    st = os.stat(lock)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert not os.path.exists(door_path(gw.port, 0))
    seen = as_nobody(_take_the_lock_and_port, gw.port, os.path.join(open_dir, "card"))
    assert seen["open"] == "EACCES" and seen["create"] == "EACCES", seen
    assert "held by uid 0" in seen["gateway"], seen
    assert not os.path.exists(door_path(gw.port, 0)), "the refused impostor must leave no door"
    gw.start(timeout_s=20)                  # root's gateway reclaims its own lock
    _root_engine_works(gw.port)


@pytest.fixture
def sticky_dir():
    """A directory like /dev/shm (1777: everyone creates entries, only their owner removes them)."""
    path = tempfile.mkdtemp(prefix="adpkv-doors-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("kind", ["lock", "door"])
def test_at_a_named_door_a_squatted_lock_or_door_is_refused_naming_its_user(open_dir, sticky_dir, kind):
    """``control_socket`` names a door in a directory every user may write: the gateway's
    checks of the lock and the door are the same as ever."""
    door = os.path.join(sticky_dir, "door.sock")
    squatted = lock_path(door) if kind == "lock" else door
    assert as_nobody(_create, squatted, "file" if kind == "lock" else "socket") == "made"
    gw = GatewayProcess(os.path.join(open_dir, "card"), log_path=os.path.join(open_dir, "gw.log"),
                        control_socket=door)
    with pytest.raises(RuntimeError) as exc:
        gw.start(timeout_s=20)
    text = str(exc.value)
    assert "exit code 2" in text, text
    assert f"the {kind} {squatted} is held by uid 65534" in text, text
    assert "another gateway is running" not in text
    assert "Gateway listening" not in text


# ---------------------------------------------------------------- issue 38, 7: squatting the door's paths
def _paths_of_a_port(port: int) -> dict[str, str]:
    """Every path a door of ``port`` was or is at, and its lock, with what to squat it with:
    the old /dev/shm door, root's door directory and its door, a /dev/shm directory of root's
    name and a door in it."""
    decoy = os.path.join(SHM_DIR, "adpkv-0")
    paths = {door_dir(0): "dir", decoy: "dir"}
    for door in (_old_door(port), door_path(port, 0), os.path.join(decoy, f"adpkv-{port}.sock")):
        paths[door] = "socket"
        paths[lock_path(door)] = "file"
    return paths


def _squat_everything(port: int) -> dict[str, str]:
    """As the squatting user: create every path of ``_paths_of_a_port`` it can."""
    return {path: _create(path, kind) for path, kind in _paths_of_a_port(port).items()}


def _fill_roots_directory(port: int) -> dict[str, str]:
    """As the squatting user, once root's gateway serves: every kind of entry, in root's door
    directory, at the lock's path, the door's and a name of its own."""
    door = door_path(port, 0)
    names = (lock_path(door) + ".new", door + ".new", os.path.join(door_dir(0), "mine"))
    kinds = ("file", "socket", "dir", "symlink")
    return {f"{name} {kind}": _create(name, kind) for name in names for kind in kinds}


def test_a_user_who_squats_every_path_of_a_ports_door_does_not_stop_roots_gateway(open_dir, port_cleanup):
    """Before: the first user to create /dev/shm/adpkv-<port>.sock(.lock) kept root's gateway
    on that port from starting (it refused, naming that user), so any local user could keep
    the cache off."""
    port = free_port()
    port_cleanup.append(port)
    decoy = os.path.join(SHM_DIR, "adpkv-0")
    decoy_was_there = os.path.lexists(decoy)
    try:
        squatted = as_nobody(_squat_everything, port)
        made = sorted(path for path, got in squatted.items() if got == "made")
        assert _old_door(port) in made and lock_path(_old_door(port)) in made, squatted   # what it took before
        assert not any(path.startswith(door_dir(0)) for path in made), squatted          # nothing of root's
        gw = GatewayProcess(os.path.join(open_dir, "card"), port=port, log_path=os.path.join(open_dir, "gw.log"),
                            control_socket_mode="0666", shared_memory_size=16 << 20)
        gw.start(timeout_s=20)
        try:
            home, door = os.lstat(door_dir(0)), os.lstat(door_path(port, 0))
            assert stat.S_ISDIR(home.st_mode) and home.st_uid == 0 and not home.st_mode & 0o022
            assert stat.S_ISSOCK(door.st_mode) and door.st_uid == 0
            _root_engine_works(port)
            later = as_nobody(_fill_roots_directory, port)
            assert set(later.values()) == {"EACCES"}, later
            _root_engine_works(port)
        finally:
            gw.stop()
    finally:
        if not decoy_was_there:
            shutil.rmtree(decoy, ignore_errors=True)


@pytest.fixture
def stranger():
    """A uid of no user, whose door directory only this test touches (the others use 65534's)."""
    uid = random.randrange(200000, 300000)
    yield uid
    home = door_dir(uid)
    if os.path.islink(home) or os.path.isfile(home):
        os.unlink(home)
    else:
        shutil.rmtree(home, ignore_errors=True)


def _start_and_attach(port: int, card: str, root_port: int) -> dict:
    """As the stranger: start a gateway on ``port`` (refused, or started and closed), then
    attach to root's gateway on ``root_port`` with the default settings and store and read."""
    seen = {}
    try:
        _gateway_here(port, card).close()
        seen["gateway"] = "started"
    except SystemExit as exc:
        seen["gateway"] = str(exc)
    keys = make_keys(2, namespace="stranger", salt=os.urandom(4))
    client = GatewayClient(ClientConfig(port=root_port, connect_timeout_s=5.0, busy_wait_s=0), "stranger-engine")
    try:
        seen["attached"] = client.enabled
        seen["stored"] = client.put(keys, OBJ, _fill(client, keys)).result(20).stored if client.enabled else None
        seen["read"] = get_checked(client, keys, OBJ) if client.enabled else None
    finally:
        client.close()
    return seen


@pytest.mark.parametrize("hostile", ["owner", "mode", "symlink", "file"])
def test_a_hostile_door_directory_is_refused_naming_it_and_its_owner(start_gateway, open_dir, stranger, hostile):
    """The stranger's door directory is another user's (root stands in for any user: anyone may
    create /dev/shm/adpkv-<uid> before that uid does), writable by others, a symbolic link, or a
    file: the stranger's gateway refuses to start, in one line naming the directory and its
    owner, and changes nothing there; its client passes over it and finds root's gateway."""
    home = door_dir(stranger)
    target = os.path.join(open_dir, "elsewhere")
    os.mkdir(target)
    os.chown(target, stranger, stranger)
    if hostile == "owner":
        os.mkdir(home, 0o755)
    elif hostile == "mode":
        os.mkdir(home)
        os.chown(home, stranger, stranger)
        os.chmod(home, 0o777)
    elif hostile == "symlink":
        os.symlink(target, home)
    else:
        os.close(os.open(home, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    before = os.lstat(home)
    roots = start_gateway(control_socket_mode="0666")
    port = free_port()
    seen = as_nobody(_start_and_attach, port, os.path.join(open_dir, "card"), roots.port, uid=stranger)
    owner = f"uid {stranger}" if hostile == "mode" else "uid 0 (root)"
    what = {"owner": f"is not uid {stranger}'s", "mode": "may be written by users other than its owner",
            "symlink": "is a symbolic link", "file": "is not a directory"}[hostile]
    line = seen["gateway"]
    assert line.startswith(f"the door directory {home} (owner {owner}, mode ") and what in line, line
    assert "\n" not in line and "refusing to start" in line, line
    after = os.lstat(home)
    assert (after.st_mode, after.st_uid, after.st_ino) == (before.st_mode, before.st_uid, before.st_ino)
    assert not os.listdir(target), "nothing may be made through the symbolic link"
    if stat.S_ISDIR(after.st_mode):
        assert not os.listdir(home), "the refused gateway must leave nothing in the directory"
    assert seen["attached"] is True and seen["stored"] == [True, True] and seen["read"] == [True, True], seen


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
    hog = Nobody(_hold_connections, door_path(gw.port, 0), 4200)
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
    seen = as_nobody(_silent_connections, door_path(gw.port, 0))
    for name, (closed, after_s) in seen.items():
        assert closed and 0.9 <= after_s < 4.0, (name, closed, after_s)
    _root_engine_works(gw.port)             # a client that uses its session at once is not cut


# ---------------------------------------------------------------- 5: descriptors
def test_a_user_with_more_connections_than_descriptors_neither_spins_the_door_nor_keeps_root_out(start_gateway):
    gw = start_gateway(control_socket_mode="0666", door_connections_per_user=5000)
    pid = gw.proc.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (1024, 1024))     # a common service default
    hog = Nobody(_hold_connections, door_path(gw.port, 0), 1100)
    try:
        assert hog.expect(120) == 1100
        _root_engine_works(gw.port)
        sessions = _gateway_stats(gw.port)["sessions"]
        assert sessions <= 1024 - 256 + 2, sessions
        assert "Door: users other than root" in gw.log(), "the 1100 connections did not reach the door's budget"
        # now run the gateway out of descriptors outright: EMFILE on every accept
        open_now = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_now, 1024))
        more = Nobody(_hold_connections, door_path(gw.port, 0), 400)
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
        assert not os.path.exists(door_path(port, 0)), "the door of a gateway that did not start is left behind"
        os.unlink(lock_path(door_path(port, 0)))



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
