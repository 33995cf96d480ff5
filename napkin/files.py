"""Writing files so that no reader sees half of one.

Generated modules, the autotune cache and the local kernels of the
distributed wrappers are read by other processes while napkin writes them
(an import, a launch, another rank of the same job): each is written to a
temporary file beside its target and renamed over it, which POSIX makes
atomic.  The autotune cache, which several processes also change, takes a
lock around its read-change-write (``locked``).  Pictures and reports go the
same way, so a failed write (a full disk) leaves the file that was there.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path


def write_atomic(target: Path, text: str | bytes) -> None:
    """Write ``text`` (UTF-8, newlines as given; bytes as they are: a PNG)
    to ``target`` through a temporary file and a rename.  A new file gets
    the mode the umask gives an ordinary file (mkstemp's would be 0600); a
    file that was there keeps its mode, and one its owner may not write
    (read-only) is refused, as open(..., "w") would.  A symbolic link is
    written through: the file it points to changes (renamed over, the link
    became a plain file and its target stayed stale).  OSError when it cannot."""
    target = Path(target)
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    mode = None
    if target.exists() and not target.is_dir():
        if not os.access(target, os.W_OK):
            raise PermissionError(errno.EACCES, "it is read-only", str(target))
        mode = stat.S_IMODE(target.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(target.name), suffix=_SUFFIX, dir=str(target.parent))
    try:
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        if hasattr(os, "fchmod"):   # not on Windows before Python 3.13, whose files carry no such mode
            os.fchmod(fd, mode)
        if isinstance(text, bytes):
            with os.fdopen(fd, "wb") as f:
                f.write(text)
        else:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# mkstemp's random part (tempfile._RandomNameSequence) and the suffix write_atomic gives
_RANDOM, _SUFFIX = 8, ".tmp"


def _temp_prefix(name: str) -> str:
    """``.NAME.`` for the temporary file beside NAME, NAME cut so that the
    whole temporary name (with mkstemp's random part and .tmp) is no longer
    in bytes than NAME itself, or than 32 for a short one: a name the file
    system takes has a temporary name it takes too.  The whole ``.NAME.``
    was 14 bytes longer: a 240-character diagram name failed with "File name
    too long" for a module name Linux allows (names2 hunt)."""
    def size(s: str) -> int:
        return len(os.fsencode(s))
    room = max(size(name), 32) - size("..") - _RANDOM - len(_SUFFIX)
    while size(name) > room:
        name = name[:-1]
    return f".{name}."


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive lock on ``path`` (created if missing; a file that
    stays, beside what it guards) for the block.  fcntl's advisory lock: on
    a system without fcntl, or a file system that refuses locks (some NFS,
    FUSE or Lustre mounts: ENOLCK, EOPNOTSUPP), the block runs unlocked, as
    it did before there was a lock.  OSError when the lock file cannot be
    created."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def why_not(err: OSError, target: Path) -> str:
    """Why writing ``target`` failed, in words: a folder on its way that is a
    file is named (the system says only "File exists" or "Not a directory"),
    and so is another file the write needed (a lock beside the target: its
    "Is a directory" read as if the target were a folder)."""
    target = Path(target)
    for parent in reversed(target.parents):
        if parent.exists() and not parent.is_dir():
            return f"{parent} is a file, not a folder"
    what = err.strerror or str(err)
    other = err.filename
    if isinstance(other, (str, os.PathLike)) and not _is_target(Path(other), target):
        return f"{other} is a folder" if isinstance(err, IsADirectoryError) else f"{what}: {other}"
    return what


def _is_target(path: Path, target: Path) -> bool:
    """Whether ``path`` is the target or write_atomic's temporary file beside it (the write's own)."""
    # absolute both: mkstemp names its file absolutely beside a relative target
    path, target = Path(os.path.abspath(path)), Path(os.path.abspath(target))
    return path == target or (path.parent == target.parent and path.name.startswith(".")
                              and path.name.endswith(_SUFFIX))
