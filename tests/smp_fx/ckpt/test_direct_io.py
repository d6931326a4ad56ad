"""Files written past the page cache: the same bytes as a buffered write (a torch.save, and a
stream flushed in the middle of a block), and a file system refusing O_DIRECT: written
through the page cache, the reason logged."""

from __future__ import annotations

import errno
import logging
import pickle
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from smp_fx.ckpt import direct_io
from smp_fx.ckpt.atomic import atomic_write
from smp_fx.ckpt.commit import torch_writer


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
