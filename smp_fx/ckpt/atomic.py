"""Atomic file writes: a file is replaced whole or not at all, and the replacement is durable.

Every checkpoint file smp-fx writes goes through here (``smp.save``, ``smp.save_checkpoint``,
``smp-fx checkpoint merge``): the bytes go to a temporary sibling, which is flushed and
fsynced, then renamed over the target, and the directory is fsynced so the rename survives
a power loss. A process killed mid-write leaves the old file (or none) plus a temporary
whose name says whose it was.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import IO


def fsync_dir(directory: str) -> None:
    """Make a rename durable (POSIX); directories cannot be opened on some platforms."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_temp(path: str, write: Callable[[IO[bytes]], object]) -> str:
    """Write a temporary sibling of ``path`` durably and return its name.

    The name starts with ``.`` and contains the pid so concurrent writers never collide
    and a leftover from a killed process is recognisable (``.NAME.PID.HEX.tmp``).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory,
                       f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """Replace ``path`` with what ``write`` produces, all or nothing."""
    tmp = write_temp(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
