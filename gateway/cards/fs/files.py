"""File safety of the fs card: every file and directory of a card is reached relative to a
directory descriptor the card opened and checked, never by a path that could be redirected.

Threat: another local user who can create entries somewhere in the card's path (a card
directory it made before the gateway's first start, a ``dbNNN`` it swapped for a symlink or
its own directory, a symlink at a temporary name) must not make the gateway read, write,
chmod or delete anything outside the card, nor serve bytes it placed there. So:

- A directory of the card is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to its
  parent's descriptor, and ``own_dir`` refuses it (``CardError`` naming the path, its
  owner and mode) unless the gateway's user owns it and neither its group nor others may
  write to it; then it gets the card's mode (0700, or 0750 with ``card_group``: the group
  reads, never writes) on its descriptor.
- A file is opened, created (``O_EXCL``: a name someone else placed makes the create fail),
  renamed and unlinked relative to its directory's descriptor with ``O_NOFOLLOW``; its mode
  and group are set with ``fchmod``/``fchown`` on the open descriptor. A symlink at a
  file's name fails the open (``ELOOP``: ``Read.FOREIGN``) and is removed as a link, never
  followed.
- Object files are spread over ``SUBDIRS`` subdirectories of each ``dbNNN`` (``subdir_of``:
  two hex digits, byte ``SUBDIR_BYTE`` of the object key, the first of its chunk digest), so
  no directory holds more than about 30 M / (16 x 256) = 7,300 entries at 30 M objects. The
  card checks every subdirectory present at open (``own_dir``, opened with ``O_NOFOLLOW``),
  and makes a missing one (mode as the databases') at the first write into it, checked the
  same way before the write's file is created in it (a new card serves at once, without
  making 4,096 directories first): no file in a subdirectory is used before the subdirectory
  was checked; a file is then
  reached as ``object_name(fkey)`` ("ab/<hex>") relative to its database's checked
  descriptor. The subdirectory component is resolved by the kernel, yet it cannot be
  redirected: the database directory is the gateway's own and nobody else may write it
  (checked first), so no other user can put a symlink or another directory at "ab" once
  "ab" was checked. (Holding a descriptor per subdirectory instead would cost 4,096
  descriptors per card, more than a service's common soft limit of 1,024.)
- A failed open or read says what it knows (``verdict_of``): only ``ENOENT`` (and what the
  name holds being no file of ours) is evidence about the object; a lack of descriptors or
  memory, an interrupted call, a permission refused are transient; EIO is an I/O error.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Iterable, NamedTuple

from adpkv_gateway.cards.base import CardError, Read

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

SUBDIRS = 256          # object subdirectories of each database: "00" .. "ff"
SUBDIR_BYTE = 9        # the byte of the object key naming its subdirectory (adpkv_core.keys: the chunk digest's first)
SUBDIR_NAMES = tuple(f"{i:02x}" for i in range(SUBDIRS))

_IO_ERRORS = frozenset((errno.EIO, errno.ENXIO, errno.EUCLEAN, errno.EBADMSG, errno.ESTALE, errno.ENODEV))
_FOREIGN = frozenset((errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EMLINK))


class FileRef(NamedTuple):
    """One file of the card: its directory's descriptor (held by the card) and its name."""

    dir_fd: int
    name: str


def subdir_of(key: bytes) -> str:
    """The subdirectory (of its database) of an object's files, from its object or fragment key."""
    return SUBDIR_NAMES[key[SUBDIR_BYTE]]


def object_name(fkey: bytes) -> str:
    """A fragment's file relative to its database's directory: "<subdirectory>/<key hex>"."""
    return f"{SUBDIR_NAMES[fkey[SUBDIR_BYTE]]}/{fkey.hex()}"


def verdict_of(exc: OSError) -> Read:
    """What a failed open or read of an object file says about the object."""
    if exc.errno == errno.ENOENT:
        return Read.ABSENT
    if exc.errno in _FOREIGN:
        return Read.FOREIGN          # a symlink (O_NOFOLLOW), a directory: nothing the card wrote
    if exc.errno in _IO_ERRORS:
        return Read.IO_ERROR
    return Read.TRANSIENT            # EMFILE, ENFILE, ENOMEM, EAGAIN, EINTR, EACCES, EPERM, ...


def describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def not_own(st: os.stat_result, uid: int, directory: bool) -> str:
    """Why an entry of a card (as ``os.lstat`` saw it) is not one the card accepts from a
    gateway running as ``uid``: a symlink, another user's, writable by its group or others;
    "" when it is fine. The same rule as ``own_dir`` and ``check_file`` (the doctor uses it)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not the gateway's uid {uid}"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def own_dir(fd: int, path: str, dir_mode: int, gid: int) -> None:
    """Make sure a directory of the card is the gateway's own, then give it the card's mode
    (``fchmod``) and group (``fchown``; ``gid`` -1: keep it). ``CardError`` naming the path,
    its owner and mode when another user owns it, or when its group or others may write to
    it (whatever they may have placed in it is not to be trusted): a directory only
    readable by others is only tightened."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise CardError(f"fs card directory {path} is not the gateway's own ({describe(st)}; the gateway runs "
                        f"as uid {os.geteuid()}): another user owns it or may write to it, and could swap its "
                        f"files; remove it, or give it to uid {os.geteuid()} with mode {dir_mode:04o}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o777 != dir_mode:
        os.fchmod(fd, dir_mode | (mode & 0o7000 & ~stat.S_ISGID) | (mode & stat.S_ISGID if gid >= 0 else 0))
    if gid >= 0 and st.st_gid != gid:
        os.fchown(fd, -1, gid)


def check_file(fd: int, path: str) -> None:
    """Refuse (``CardError``) a file of the card (``adpkv-card.json``) that another user owns
    or may write to."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise CardError(f"fs card file {path} is not the gateway's own ({describe(st)}): refused")


def open_dir(dir_fd: int, name: str, path: str, mode: int, create: bool) -> int:
    """Open (``create``: make it first, mode ``mode``, if missing) directory ``name`` under
    ``dir_fd`` without following a symlink; ``CardError`` when it is a symlink or no
    directory. The caller checks it (``own_dir``)."""
    if create:
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CardError(f"fs card directory {path} is a symlink or not a directory: refused "
                            "(the card follows no link)") from None
        raise


def open_root(path: str, mode: int) -> int:
    """Open the card's own directory (made with ``mode`` if missing; its parents as given)
    without following a symlink at its last component."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_dir(pfd, name, path, mode, create=True)
    finally:
        os.close(pfd)


def unlink_all(refs: Iterable[FileRef]) -> None:
    """Remove files (a symlink as a link), ignoring those already gone."""
    for dir_fd, name in refs:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
