"""The transfer streams' chooser, switch and fallback; the CPU and one-device paths unchanged;
the order of the stream path's calls, on stand-ins (running it needs two accelerators:
tests/smp_fx/test_cuda.py does).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from cost_model.errors import SMPConfigError
from smp_fx.runtime.transport import transfer_stream as ts
from smp_fx.runtime.transport.transport import InProcessTransport

cpu, meta = torch.device("cpu"), torch.device("meta")
cuda0, cuda1, cuda = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda")


@pytest.mark.parametrize(("src", "dst", "wanted"), [
    (cuda0, cuda1, True), (cuda1, cuda0, True),
    (torch.device("xpu", 0), torch.device("xpu", 1), True),
    (cuda0, cuda0, False),  # one device: handed over by reference
    (cuda0, cuda, False),  # no index: not known to be another device
    (cpu, cpu, False), (cpu, cuda0, False), (cuda0, cpu, False), (cpu, meta, False),
    (cuda0, torch.device("xpu", 1), False),
])
def test_only_two_devices_of_one_accelerator_type_take_the_streams(
        src: torch.device, dst: torch.device, wanted: bool) -> None:
    assert ts.wants_transfer_stream(src, dst) is wanted
    assert ts.TransferStreams(env={}).usable(src, dst) is wanted


def test_the_switch_reads_0_and_1_and_rejects_the_rest() -> None:
    assert ts.switched_on({}) and ts.switched_on({ts.ENV: "1"}) and ts.switched_on({ts.ENV: ""})
    assert not ts.switched_on({ts.ENV: "0"})
    with pytest.raises(SMPConfigError, match=f"{ts.ENV} must be 0 or 1.*'yes'.*{ts.ENV}=0"):
        ts.switched_on({ts.ENV: "yes"})


def test_this_torch_has_the_device_generic_apis() -> None:
    assert ts.missing_api() is None, torch.__version__


@pytest.mark.parametrize("why", ["switch", "api"])
def test_a_refusal_keeps_the_plain_copy_and_says_why_once(
        why: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ts, "_said", set())
    if why == "api":
        monkeypatch.setattr(ts, "missing_api", lambda: "torch.Event")
    streams = ts.TransferStreams(env={ts.ENV: "0"} if why == "switch" else {})
    caplog.set_level(logging.WARNING, "smp_fx.transport")
    assert not streams.usable(cuda0, cuda1) and not streams.usable(cuda1, cuda0)
    reason = f"{ts.ENV}=0" if why == "switch" else "lacks torch.Event"
    assert [r.getMessage().count(reason) for r in caplog.records] == [1]
    assert "stay on the current stream" in caplog.text
    assert not streams.usable(cpu, cpu) and len(caplog.records) == 1  # no copy, nothing said


def test_a_same_device_message_is_the_sent_storage_and_a_cross_device_one_a_plain_copy(
        ) -> None:
    tr = InProcessTransport({0: cpu, 1: cpu, 2: meta})
    a = torch.ones(3, requires_grad=True) * 2
    tr.send((a,), 0, 1, "act", 0)
    (got,) = tr.recv(0, 1, "act", 0)
    assert got.data_ptr() == a.data_ptr() and got.is_leaf and got.requires_grad
    tr.send((a,), 1, 2, "act", 0)  # another device with no streams: the plain copy
    (moved,) = tr.recv(1, 2, "act", 0)
    assert moved.device == meta and moved.requires_grad and moved.is_leaf
    assert tr.streams.copies == 0


class _Log:
    """Stand-ins for streams, events and tensors that write what is done to them, in order
    (no accelerator here: the order of the calls is what can be checked)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def stream(self, name: str) -> _Stream:
        return _Stream(name, self)


class _Stream:
    def __init__(self, name: str, log: _Log) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.calls.append(f"{self.name} waits {other.name}")

    def wait_event(self, event: str) -> None:
        self.log.calls.append(f"{self.name} waits {event}")

    def record_event(self) -> str:
        self.log.calls.append(f"event on {self.name}")
        return f"event({self.name})"

    def __enter__(self) -> None:
        self.log.calls.append(f"enter {self.name}")

    def __exit__(self, *exc: object) -> None:
        self.log.calls.append(f"exit {self.name}")


class _Tensor:
    def __init__(self, name: str, device: torch.device, log: _Log) -> None:
        self.name, self.device, self.log = name, device, log

    def to(self, device: torch.device, non_blocking: bool = False) -> _Tensor:
        self.log.calls.append(f"copy {self.name} to {device} non_blocking={non_blocking}")
        return _Tensor("copy", device, self.log)

    def record_stream(self, stream: _Stream) -> None:
        self.log.calls.append(f"{self.name} kept for {stream.name}")


def test_the_copy_waits_for_the_producer_and_the_consumer_waits_for_the_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = _Log()
    compute = {cuda0: log.stream("compute0"), cuda1: log.stream("compute1")}
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda d: compute[d])
    streams = ts.TransferStreams(env={})
    monkeypatch.setattr(streams, "stream", lambda d: log.stream(f"side{d.index}"))
    act: Any = _Tensor("act", cuda0, log)
    out, done = ts.copy_on_transfer_streams(act, cuda1, streams)
    assert log.calls == ["side0 waits compute0", "enter side0", "enter side1",
                         "copy act to cuda:1 non_blocking=True", "event on side1",
                         "exit side1", "exit side0", "act kept for side0"]
    assert streams.copies == 1
    log.calls.clear()
    ts.consume([(out, done)], cuda1)
    assert log.calls == ["compute1 waits event(side1)", "copy kept for compute1"]
