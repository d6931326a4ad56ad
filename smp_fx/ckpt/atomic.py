"""Atomic file writes: a file is replaced whole or not at all, and the replacement is durable.

See docs/checkpoints.md, 'Files, crash safety and formats'.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from typing import IO

Stream = Callable[[int], AbstractContextManager[IO[bytes]]]
"""What an open file descriptor is written through (default: a buffered file)."""


def fsync_dir(directory: str) -> None:
    """Make a rename durable (POSIX); directories cannot be opened on some platforms."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_temp(path: str, write: Callable[[IO[bytes]], object],
               stream: Stream | None = None) -> str:
    """Write a temporary sibling of ``path`` durably and return its name (pid in it: writers
    never collide, a killed one's leftover is recognisable); ``stream``: through what."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory,
                       f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with (stream or _buffered)(fd) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def _buffered(fd: int) -> IO[bytes]:
    return os.fdopen(fd, "wb")


def atomic_write(path: str, write: Callable[[IO[bytes]], object],
                 stream: Stream | None = None) -> None:
    """Replace ``path`` with what ``write`` produces, all or nothing."""
    tmp = write_temp(path, write, stream)
    try:
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
