"""Files written past the page cache: the same bytes as a buffered write (a torch.save, and a
stream flushed in the middle of a block), and a file system refusing O_DIRECT: written
through the page cache, the reason logged."""

from __future__ import annotations

import errno
import logging
import pickle
import threading
import zipfile
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from smp_fx.ckpt import direct_io
from smp_fx.ckpt.atomic import atomic_write
from smp_fx.ckpt.commit import torch_writer
from smp_fx.ckpt.snapshot import aligned_like


def _stream(fh: IO[bytes]) -> None:
    fh.write(b"abc")
    fh.flush()  # a partial block written padded, then written again whole
    fh.write(b"x" * 5000)
    fh.flush()
    fh.write(memoryview(bytes(range(256)) * (direct_io.CHUNK // 256 + 7)))


def test_the_same_bytes_as_a_buffered_write(tmp_path: Path) -> None:
    state: dict[str, Any] = {"w": torch.randn(3 * direct_io.CHUNK // 4 + 5),
                             "n": torch.arange(3),
                             "lr": 0.1}
    for name, writer in (("pt", torch_writer(state, pickle, 2)), ("stream", _stream)):
        atomic_write(str(tmp_path / f"buffered.{name}"), writer)
        direct_io.write_direct(str(tmp_path / f"direct.{name}"), writer)
        want = (tmp_path / f"buffered.{name}").read_bytes()
        assert (tmp_path / f"direct.{name}").read_bytes() == want, name
    got = torch.load(tmp_path / "direct.pt", weights_only=True)
    assert torch.equal(got["w"], state["w"]) and got["lr"] == 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "buffered.pt", "buffered.stream", "direct.pt", "direct.stream"]  # no temporaries


def test_a_file_system_refusing_o_direct_is_written_buffered_and_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    real = direct_io.fcntl.fcntl

    def refuse(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == direct_io.fcntl.F_SETFL:
            raise OSError(errno.EINVAL, "Invalid argument (simulated)")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse)
    with caplog.at_level(logging.INFO, logger=direct_io.__name__):
        direct_io.write_direct(str(tmp_path / "f"), _stream)
    atomic_write(str(tmp_path / "g"), _stream)
    assert (tmp_path / "f").read_bytes() == (tmp_path / "g").read_bytes()
    assert "O_DIRECT refused: [Errno 22]" in caplog.text and str(tmp_path) in caplog.text


def test_the_writer_threads_files_load_the_same_and_aligned_tensors_go_straight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lean_serialization`` in a thread: no CRC32, storages on 4096-byte offsets, the
    page-aligned snapshot buffers written from their own memory; the bytes are a buffered
    write's of the same settings, the values the same, and other threads keep torch's
    defaults."""
    source = {"w": torch.randn(direct_io.CHUNK // 4 + 1000), "n": torch.arange(5)}
    state = {k: aligned_like(v).copy_(v) for k, v in source.items()}
    straight: list[int] = []
    real = direct_io.DirectFile._straight

    def counted(self: Any, raw: memoryview, src: Any) -> int:
        straight.append(real(self, raw, src))
        return straight[-1]

    monkeypatch.setattr(direct_io.DirectFile, "_straight", counted)

    def body() -> None:
        direct_io.lean_serialization()
        direct_io.write_direct(str(tmp_path / "direct.pt"), torch_writer(state, pickle, 2))
        atomic_write(str(tmp_path / "buffered.pt"), torch_writer(state, pickle, 2))

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert sum(straight) >= direct_io.CHUNK  # the big tensor's whole blocks, no copy
    assert (tmp_path / "direct.pt").read_bytes() == (tmp_path / "buffered.pt").read_bytes()
    got = torch.load(tmp_path / "direct.pt", weights_only=True)
    for k, v in source.items():
        assert torch.equal(got[k], v), k
    with zipfile.ZipFile(tmp_path / "direct.pt") as z:
        assert {i.CRC for i in z.infolist()} == {0}
    atomic_write(str(tmp_path / "main.pt"), torch_writer(source, pickle, 2))  # this thread
    with zipfile.ZipFile(tmp_path / "main.pt") as z:
        assert all(i.CRC != 0 for i in z.infolist() if i.file_size)
