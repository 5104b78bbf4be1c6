"""Taking the door's path at start (``adpkv_core.wire.door``): its directory, its lock, then the door.

Contract:

- ``make_door_dir`` runs first when the door is the default one (no ``control_socket``): it
  makes the door directory of this gateway's user (``/run/adpkv`` for root,
  ``/dev/shm/adpkv-<uid>`` for another user; mode 0755, whatever the umask: the door's own mode
  says who may connect) or checks the one there, and refuses to start, in one line naming the
  path and its owner, when that is not a directory of this gateway's user that no other user may
  write (a symbolic link, another user's, group- or world-writable). Nothing else is created in
  it than the lock and the door, so no other user can take either path first;
- ``claim_door`` runs before anything else at start: it takes the lock beside the door
  (``flock``), so a second gateway on the same port refuses to start (``DoorBusy``) instead
  of touching anything the first one owns. The lock is this gateway's user's, mode 0600 (no
  other user can open it, so none can hold it); a lock owned by another user is never used:
  the gateway refuses to start and names that user's uid. A lock left by our own user is
  reclaimed (its mode reset to 0600). The lock is opened and created without following a
  symlink, and must be a plain file with one name.
- ``bind_door`` then binds the listener at the door's path: a door file left by a dead
  gateway of our user is removed only now that the lock is held; another user's door, or
  anything else at that path, is refused; the door is never open to everyone, not even
  for a moment.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import socket
import stat

from adpkv_core.wire import door as D

logger = logging.getLogger("adpkv.gateway")


class DoorBusy(SystemExit):
    """Another live gateway owns this door (and port)."""


def make_door_dir(path: str) -> None:
    """Make the door directory ``path`` of this gateway's user, or check the one there (see the
    module); ``SystemExit`` with one line naming the path (and its owner) otherwise."""
    try:
        os.mkdir(path, 0o700)
        made = True
    except FileExistsError:
        made = False
    except OSError as exc:
        raise SystemExit(f"cannot make the door directory {path}: {exc.strerror}; refusing to start "
                         "(or set control_socket to a door elsewhere)") from None
    try:
        problem = D.door_dir_problem(path, os.geteuid())
    except OSError as exc:
        problem = f"the door directory {path} cannot be looked at: {exc.strerror}"
    if problem:
        raise SystemExit(f"{problem}; refusing to start. Remove it (as its owner or root), or set "
                         "control_socket to a door elsewhere")
    if made:
        os.chmod(path, 0o755)      # checked ours above: in /run or sticky /dev/shm no one else can swap it
        logger.info("Door directory %s made (mode 0755)", path)


def _held_by_another(path: str, what: str, uid: int) -> SystemExit:
    return SystemExit(f"the {what} {path} is held by {D.user_name(uid)}, not by this gateway's user "
                      f"({D.user_name(os.geteuid())}): another user took this port's door; refusing to start. Have "
                      "that user (or root) remove it, or give this gateway another port or control_socket")


def _open_lock(lock: str) -> int:
    """The lock's descriptor, read-write: an existing lock opened as it is, a missing one
    created 0600 (``O_EXCL``). Never through a symlink. An existing file is opened without
    ``O_CREAT``: fs.protected_regular refuses ``O_CREAT`` on another user's file in a
    sticky directory, which would hide whose it is."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    for _ in range(3):
        for extra in (0, os.O_CREAT | os.O_EXCL):
            try:
                return os.open(lock, flags | extra, 0o600)
            except (FileNotFoundError, FileExistsError):
                continue                  # missing: create it; created meanwhile: open that one
            except OSError as exc:
                try:
                    owner = os.lstat(lock).st_uid
                except OSError:
                    owner = os.geteuid()
                if owner != os.geteuid():
                    raise _held_by_another(lock, "lock", owner) from None
                what = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
                raise SystemExit(f"the lock {lock} {what}; refusing to start (remove it)") from None
    raise SystemExit(f"cannot create the lock {lock}: it keeps appearing and vanishing")


def claim_door(path: str) -> int:
    """Take the lock beside ``path``; the lock's descriptor (held for the gateway's life).
    Raises ``DoorBusy`` when another gateway of our user holds it, ``SystemExit`` naming the
    owner when the lock is another user's, or not a plain file of its own."""
    lock = D.lock_path(path)
    fd = _open_lock(lock)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _held_by_another(lock, "lock", st.st_uid)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise SystemExit(f"the lock {lock} is not a plain file with one name (mode {st.st_mode:o}, "
                             f"{st.st_nlink} links); refusing to start (remove it)")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)          # a lock of ours from an older gateway (0644): no one else may open it
            logger.info("Lock %s: mode %o reset to 0600", lock, stat.S_IMODE(st.st_mode))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DoorBusy(f"another gateway is running on this port (it holds {lock}); refusing to start. "
                       "Stop it first, or give this gateway another port") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def bind_door(listener: socket.socket, path: str, mode: int, group: str) -> None:
    """Bind ``listener`` at ``path`` (``claim_door`` took its lock): a door left by a dead
    gateway of our user is replaced; anything else there, or another user's door, is
    refused (``SystemExit``). The door is created 0600 (umask) and then given ``group``
    and ``mode``."""
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if st.st_uid != me:
            raise _held_by_another(path, "door", st.st_uid)
        if not stat.S_ISSOCK(st.st_mode):
            raise SystemExit(f"{path} exists and is not a socket; refusing to remove it")
        os.unlink(path)        # a dead gateway's door: we hold the lock, so it is not live
    old = os.umask(0o177)      # no window in which the door is open to everyone
    try:
        listener.bind(path)
    except OSError as exc:
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            owner = me
        if owner != me:
            raise _held_by_another(path, "door", owner) from None
        raise SystemExit(f"cannot create the door {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    st = os.lstat(path)        # ours, as bound (in a sticky directory no one else can swap it)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != me:
        raise SystemExit(f"the door {path} changed under this gateway as it was created; refusing to start")
    gid = group_id(group) if group else -1
    os.chown(path, -1, gid, follow_symlinks=False)
    os.chmod(path, mode)


def group_id(name: str) -> int:
    """The gid of a group given by name or number; ``SystemExit`` for an unknown one."""
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise SystemExit(f"unknown group {name!r}") from None

