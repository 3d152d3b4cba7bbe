"""The one way this package replaces a file: whole or not at all, and durable once it returns.

The new content goes to a temporary file beside the target (``.<name>.<random>.tmp``, so that a reader
listing ``*.json`` never picks it up), is fsynced, renamed over the target, and the directory is fsynced so
that the rename itself survives a power loss. Readers see the old file or the new one, never a part.
On any failure the temporary file is removed and the error raised.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def temp_prefix(path: str | os.PathLike[str]) -> str:
    """The prefix of the temporary files write_atomic makes for path (for scanners that skip them)."""
    return f".{Path(path).name}."


def write_atomic(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o644) -> None:
    """Replace path with data (str is written as UTF-8), with permissions mode whatever the umask."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=TEMP_SUFFIX)
    try:
        try:
            os.fchmod(fd, mode)  # mkstemp makes it 0600
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)  # the bytes are on disk before the rename makes them the file
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never leave a temporary file behind (a full disk)
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def make_dirs(path: str | os.PathLike[str], mode: int) -> list[Path]:
    """Create path and its missing parents (mkdir -p) with exactly mode whatever the umask; the folders made.

    For files another process reads (under another uid): mkdir(parents=True) applies the umask, so under
    umask 077 the folders it made kept every other user out. A folder that appears meanwhile is left as it is.
    """
    missing = []
    folder = Path(path)
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs
        os.chmod(folder, mode)
        made.append(folder)
    return made


def remove_stale_temps(path: str | os.PathLike[str]) -> int:
    """Remove the temporary files a killed writer of path left behind; for a file with one writer only."""
    path = Path(path)
    removed = 0
    for stale in path.parent.glob(f"{glob_escape(temp_prefix(path))}*{TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()
            removed += 1
    return removed


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or create in directory durable. Filesystems that cannot sync a directory are let be."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)
