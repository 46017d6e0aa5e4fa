"""Private files: directories only this user can enter (0700), files only this user can read (0600),
written atomically and never through a link someone planted (docs/security.md).

One place for the rules that the job directory (jobdir.py), the one-node job secret
(comm/secret.py) and checkpoints (checkpoint.py) share. A leaf: it imports nothing of sdp_jupyter.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path


class UnsafePath(PermissionError):
    """A directory or file that others own or can reach: we refuse to trust it."""


def ensure_private_dir(path: str | os.PathLike, *, repair: bool = True) -> Path:
    """Create `path` (and missing parents) as 0700, or check that the existing one is a real
    directory of this user and make it 0700 (`repair=False`: refuse it when it is not 0700 already).
    Raises UnsafePath otherwise."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory (a symbolic link?): refusing to use it")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to user id {st.st_uid}, not to you: refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        if not repair:
            raise UnsafePath(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 0700: refusing to use it")
        os.chmod(path, 0o700)
    return path


@contextlib.contextmanager
def private_writer(path: str | os.PathLike, *, fsync: bool = False):
    """A binary file to write `path`'s new content into: a fresh temporary name opened 0600 with
    O_EXCL|O_NOFOLLOW (never a file or link someone placed there), renamed over `path` when the
    block ends (after an fsync when asked), removed when it raises. For content too large to hold
    twice in memory (a checkpoint); write_private is the one-call form."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_private(path: str | os.PathLike, data: bytes | str, *, fsync: bool = False) -> None:
    """Write `data` to `path` atomically as a 0600 file (see private_writer)."""
    with private_writer(path, fsync=fsync) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def open_private(path: str | os.PathLike, mode: str = "ab", **kwargs):
    """Open a file for appending (logs, metrics), created 0600, never through a link. `kwargs` go to
    the file object (buffering, encoding for a text mode)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), mode, **kwargs)


def open_checked(path: str | os.PathLike, *, mask: int = 0o077):
    """`path` opened for binary reading, never through a link, only when it and its directory
    belong to this user and have none of the mode bits in `mask` (0o077: nobody else may read or
    write them; 0o022: nobody else may write them). Raises UnsafePath otherwise."""
    path = Path(path)
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
    try:
        for what, st in (("file", os.fstat(f.fileno())), ("directory", os.stat(path.parent))):
            if st.st_uid != os.geteuid() or st.st_mode & mask:
                raise UnsafePath(f"refusing to read {path}: its {what} is not yours alone "
                                 f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    except BaseException:
        f.close()
        raise
    return f
