"""The lock of an fs card: one gateway writes a card, unless every gateway on it shares it.

The door's lock (``gateway/door/claim.py``) keeps a second gateway off a port; it cannot see
a second gateway on another port that names the same card directory, whose index would go
stale under the first one's writes and evictions. This lock is the card's own.

Contract:

- ``take`` runs before the card is opened (``open_cards``): it opens the card's directory
  (made, with the card's mode, when missing; without following a symlink; refused unless it is
  the gateway's user's and nobody else may write it, as the card itself checks) and takes
  ``DIR/.adpkv-lock`` with ``flock``: exclusive for a gateway whose cards are not shared,
  shared with ``shared_storage: true`` (several gateways that all say so may write the card;
  the rules of shared cards apply: nobody cleans). A lock held the other way refuses the card:
  ``CardLocked`` (a ``CardError``) names the gateways that hold it (pid, port, and host when
  another), and says what to do. The same directory named twice in ``storage_devices`` is
  refused as that.
- The lock file (``0600``, opened with ``O_NOFOLLOW``, a plain file of the gateway's user)
  records its holders, one JSON line each (pid, port, host, shared): an exclusive holder
  replaces the lines with its own, a shared one adds its line (it replaces them when it holds
  the lock alone at that moment). A refusal names the recorded holders whose process is alive
  (on this host; a holder on another host is named as recorded).
- The lock is held until ``release``, after the card closed; a gateway that dies loses it
  with its descriptors (the kernel releases a ``flock``), so a restart after a crash is never
  refused.
- ``release(undo_new=True)`` (a start that failed) first removes what the start made of a
  card that did not exist before it (no ``adpkv-card.json`` when the lock was taken) and that
  it held alone (an exclusive lock: nobody else wrote there meanwhile): the entries of the
  directory that were not there when the lock was taken (the card's files, its empty database
  directories), then the lock file, then the directory when the start made it. Directories
  are only ever removed empty: nothing stored is removed.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import stat

from adpkv_gateway.cards.base import CardError
from adpkv_gateway.cards.fs.card import CARD_FILE, read_only
from adpkv_gateway.cards.fs.files import DIR_FLAGS, not_own, open_root, own_dir

logger = logging.getLogger("adpkv.gateway.fs")

LOCK_FILE = ".adpkv-lock"
RECORDS_MAX = 1 << 16          # bytes of holder records read (a shared lock's lines of gone holders add up)


class CardLocked(CardError):
    """Another gateway holds the card's lock in a way this one may not share."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who takes the lock: the gateway's control port, and whether its cards are shared."""
    port: int
    shared: bool


class CardLock:
    """The lock of one fs card, held from before the card opens until after it closed."""

    def __init__(self, root: str, root_fd: int, fd: int, shared: bool, before: frozenset[str], made_dir: bool):
        self.root = root
        self.shared = shared
        self.new = CARD_FILE not in before       # this start makes the card
        self._root_fd, self._fd = root_fd, fd
        self._before = before                    # the directory's entries when the lock was taken
        self._made_dir = made_dir

    def release(self, undo_new: bool = False) -> None:
        """Give the lock up; ``undo_new``: a failed start, which first removes the card it made
        (a new card held alone; see the contract)."""
        if self._fd < 0:
            return
        try:
            if undo_new and self.new and not self.shared:
                self._remove_new_card()
        except OSError as exc:
            logger.warning("fs card %s: the failed start could not remove the card it made: %s", self.root, exc)
        finally:
            os.close(self._fd)
            os.close(self._root_fd)
            self._fd = self._root_fd = -1

    def _remove_new_card(self) -> None:
        left = []
        for name in sorted(set(os.listdir(self._root_fd)) - self._before - {LOCK_FILE}):
            try:
                if stat.S_ISDIR(os.lstat(name, dir_fd=self._root_fd).st_mode):
                    _remove_empty_dir(self._root_fd, name)
                else:
                    os.unlink(name, dir_fd=self._root_fd)
            except OSError as exc:
                left.append(f"{name} ({exc.strerror})")
        if left:
            logger.warning("fs card %s: the failed start could not remove what it made: %s", self.root, ", ".join(left))
            return
        if LOCK_FILE not in self._before:
            os.unlink(LOCK_FILE, dir_fd=self._root_fd)
        if self._made_dir:
            try:
                os.rmdir(self.root)
            except OSError as exc:
                logger.warning("fs card %s: the failed start could not remove the directory it made: %s",
                               self.root, exc.strerror)
                return
        logger.info("fs card %s: the failed start removed the card it made", self.root)


def _remove_empty_dir(dir_fd: int, name: str) -> None:
    """Remove directory ``name`` of ``dir_fd`` and its empty subdirectories (a database and its
    object subdirectories); ``OSError`` (ENOTEMPTY) when anything else is in it."""
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        for sub in os.listdir(fd):
            try:
                os.rmdir(sub, dir_fd=fd)
            except OSError:
                pass                       # not empty, or no directory: the rmdir below says so
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def take(root: str, dir_mode: int, holder: Holder) -> CardLock:
    """Open the card's directory and take its lock (see the contract); ``CardLocked`` when
    another gateway holds it, ``CardError`` when the directory or the lock is not ours."""
    made_dir = not os.path.lexists(root)
    try:
        root_fd = open_root(root, dir_mode)
    except OSError as exc:
        raise CardError(f"fs card {root}: cannot create the directory: {exc}") from None
    try:
        if not_own(os.fstat(root_fd), os.geteuid(), directory=True):
            own_dir(root_fd, root, dir_mode, -1)      # refuses it (CardError naming its owner and mode)
        fd, made_lock = _open_lock(root, root_fd)
    except BaseException:
        os.close(root_fd)
        raise
    try:
        _lock(root, fd, holder)
        before = frozenset(os.listdir(root_fd)) - ({LOCK_FILE} if made_lock else set())
    except BaseException:
        os.close(fd)
        os.close(root_fd)
        raise
    return CardLock(root, root_fd, fd, holder.shared, before, made_dir)


def _open_lock(root: str, root_fd: int) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this call created it."""
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        try:
            fd, made = os.open(LOCK_FILE, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=root_fd), True
        except FileExistsError:
            fd, made = os.open(LOCK_FILE, flags, dir_fd=root_fd), False
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise read_only(root) from None
        what = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
        raise CardError(f"fs card {root}: its lock {LOCK_FILE} {what}; refusing the card (remove it)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise CardError(f"fs card {root}: its lock {LOCK_FILE} is not a plain file of uid {os.geteuid()} with one "
                        f"name (owner uid {st.st_uid}, mode {st.st_mode:o}, {st.st_nlink} links); refusing the card "
                        "(remove it)")
    return fd, made


def _lock(root: str, fd: int, holder: Holder) -> None:
    """Take the lock for ``holder`` and record it, or raise naming who holds it."""
    me = json.dumps({"pid": os.getpid(), "port": holder.port, "host": socket.gethostname(),
                     "shared": holder.shared}).encode() + b"\n"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        alone = True
    except BlockingIOError:
        alone = False
    if alone:
        os.ftruncate(fd, 0)
        os.write(fd, me)                       # O_APPEND: at the end, which is the start now
        if holder.shared:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # let other sharers in
            except BlockingIOError:
                raise _refusal(root, fd, holder) from None
        return
    if not holder.shared:
        raise _refusal(root, fd, holder)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(root, fd, holder) from None
    os.write(fd, me)


def _holders(fd: int) -> list[dict]:
    """The recorded holders whose process may still run (a holder on another host is kept)."""
    host = socket.gethostname()
    found = []
    for line in os.pread(fd, RECORDS_MAX, 0).splitlines():
        try:
            rec = json.loads(line)
            pid, port, where = int(rec["pid"]), int(rec["port"]), str(rec["host"])
        except (ValueError, KeyError, TypeError):
            continue
        if where == host and not _alive(pid):
            continue
        found.append({"pid": pid, "port": port, "host": where, "shared": bool(rec.get("shared"))})
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _refusal(root: str, fd: int, holder: Holder) -> CardError:
    host = socket.gethostname()
    holders = _holders(fd)
    if any(h["pid"] == os.getpid() and h["host"] == host for h in holders):
        return CardError(f"fs card {root} is named twice in storage_devices (the same directory); refusing to start: "
                         "name it once")
    named = "; ".join(f"pid {h['pid']}, port {h['port']}" + ("" if h["host"] == host else f", host {h['host']}")
                      for h in holders) or "a process that did not record itself"
    if holder.shared:
        return CardLocked(f"fs card {root} is in use by another gateway ({named}) that does not share it; "
                          "refusing to start: set shared_storage: true on that gateway too, or give this one "
                          "another card")
    sharing = holders and all(h["shared"] for h in holders)
    return CardLocked(f"fs card {root} is in use by another gateway ({named}){' that shares it' if sharing else ''}; "
                      "refusing to start: two gateways writing one card each keep an index the other's writes and "
                      "evictions make stale. Stop that gateway, give this one another card, or set "
                      "shared_storage: true on every gateway of the card to share it")

