"""Checkpoint files written past the page cache (``O_DIRECT``), for the asynchronous writer.

A buffered ``write`` of a new file spends its CPU in the kernel, allocating and filling
page-cache pages: 0.30 s per 151 MB on this project's 2-core VM, taken from training. With
``O_DIRECT`` the disk reads the bytes from an aligned user buffer: 0.005 s of CPU, plus
copying the stream into that buffer, which a tensor in page-aligned memory written at an
aligned offset skips (``lean_serialization``). The bytes on disk are the same. Where the
file system refuses ``O_DIRECT`` (tmpfs, some network file systems) the file is written
through the page cache and the reason logged once per folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import torch
import torch.utils

from smp_fx.ckpt.atomic import atomic_write

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT's alignment of buffer, offset and length (a page covers 512 too)
CHUNK = 8 << 20  # the aligned buffer one file streams through
_told: set[str] = set()  # folders whose refusal was logged
_local: list[bool] = []  # whether torch's serialization settings are thread-local


class DirectFile:
    """A write-only stream onto a file descriptor opened with ``O_DIRECT``: bytes gather in an
    aligned buffer written whole; ``flush`` also writes the partial last block, padded, and
    sets the file's size to the bytes written (later writes rewrite that block)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._map = mmap.mmap(-1, CHUNK)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self._done = 0  # bytes in the file as whole chunks
        self._held = 0  # bytes in the buffer after them

    def write(self, data: Any) -> int:
        raw = memoryview(data).cast("B")
        src = np.frombuffer(raw, dtype=np.uint8)
        at = self._straight(raw, src)
        while at < src.size:
            n = min(CHUNK - self._held, src.size - at)
            self._buf[self._held:self._held + n] = src[at:at + n]  # numpy: the GIL released
            self._held += n
            at += n
            if self._held == CHUNK:
                self._put(CHUNK)
                self._done += CHUNK
                self._held = 0
        return int(src.size)

    def _straight(self, raw: memoryview, src: np.ndarray) -> int:
        """Write the whole blocks of ``src`` straight from its memory when it is aligned as
        the file is here (``aligned_storages``), with no copy into the buffer; returns how
        many bytes of ``src`` that wrote."""
        address = src.__array_interface__["data"][0]
        whole = src.size // BLOCK * BLOCK
        if whole < CHUNK or address % BLOCK or self._held % BLOCK:
            return 0
        if self._held:
            self._put(self._held)
            self._done += self._held
            self._held = 0
        put = 0
        while put < whole:
            put += os.pwrite(self._fd, raw[put:whole], self._done + put)
        self._done += whole
        return whole

    def flush(self) -> None:
        if self._held:
            self._put(-(-self._held // BLOCK) * BLOCK)
        os.ftruncate(self._fd, self._done + self._held)

    def _put(self, length: int) -> None:
        view = memoryview(self._map)[:length]
        put = 0
        while put < length:
            put += os.pwrite(self._fd, view[put:], self._done + put)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self._map.close()
        os.close(self._fd)


@contextlib.contextmanager
def direct_stream(fd: int) -> Iterator[IO[bytes]]:
    """``fd`` as a ``DirectFile`` when its file system takes ``O_DIRECT``, else buffered."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        folder = os.path.dirname(os.readlink(f"/proc/self/fd/{fd}"))
        if folder not in _told:
            _told.add(folder)
            log.info("asynchronous checkpoint files in %s go through the page cache (more "
                     "CPU taken from training): O_DIRECT refused: %s", folder, exc)
        with os.fdopen(fd, "wb") as fh:
            yield fh
        return
    out = DirectFile(fd)
    try:
        yield out  # type: ignore[misc]
    finally:
        out.close()


def lean_serialization() -> None:
    """For the calling thread only (torch's serialization settings are thread-local
    overrides): ``skip_crc32`` and ``aligned_storages``. Torch versions without such
    settings keep their defaults (said once)."""
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    if config is None or not _thread_local(config):
        if "config" not in _told:
            _told.add("config")
            log.info("asynchronous checkpoint files are written with torch.save's CRC32 and "
                     "a copy into an aligned buffer (more CPU taken from training): this "
                     "torch has no thread-local serialization settings")
        return
    skip_crc32(config)
    aligned_storages(config)


def skip_crc32(config: Any) -> None:
    """``torch.save`` writes no CRC32 of its records (zip fields 0; ``torch.load`` does not
    read them, ``unzip -t`` reports them): 0.034 of the 0.060 s of CPU a ``torch.save``
    of 151 MB took through a ``DirectFile``."""
    config.save.compute_crc32 = False


def aligned_storages(config: Any) -> None:
    """``torch.save`` puts each tensor's bytes at a file offset that is a multiple of
    ``BLOCK`` (padding before it, recorded in the file; ``torch.load`` reads it): a
    ``DirectFile`` then writes a tensor of an aligned buffer (``Snapshot``'s) straight from
    its memory, without copying it into its own. With ``skip_crc32``, a ``torch.save`` of
    151 MB took 0.039 s of CPU from unaligned tensors and 0.013 s from aligned ones; the
    writer's CPU per save at pp 2 x dp 2 (``benchmarks/async_checkpoint.py``, rank 0):
    0.085 s with neither, 0.050 s without the CRC32, 0.014 s with both."""
    config.save.storage_alignment = BLOCK


def _thread_local(config: Any) -> bool:
    """Whether a setting made in one thread stays in it (torch's config overrides are
    thread-local where they exist; checked once, on a thread of its own, the setting put
    back where it is not)."""
    if not _local:
        before = bool(config.save.compute_crc32)

        def probe() -> None:
            config.save.compute_crc32 = not before

        worker = threading.Thread(target=probe)
        worker.start()
        worker.join()
        _local.append(bool(config.save.compute_crc32) == before)
        config.save.compute_crc32 = before
    return _local[0]


def write_direct(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """``atomic_write`` past the page cache (the module doc): what the asynchronous writer
    writes its files with. Measured at pp 2 x dp 2 (``benchmarks/async_checkpoint.py``):
    the writer's CPU per save 0.29 -> 0.08 s on the rank writing 151 MB, and the steps
    while it writes 1.22-1.54x -> 0.91-1.05x a plain step."""
    if hasattr(os, "O_DIRECT"):
        atomic_write(path, write, stream=direct_stream)
        return
    if "" not in _told:
        _told.add("")
        log.info("asynchronous checkpoint files go through the page cache (more CPU taken "
                 "from training): this platform has no O_DIRECT")
    atomic_write(path, write)
