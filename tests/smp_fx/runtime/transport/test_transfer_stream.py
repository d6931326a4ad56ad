"""The transfer streams' chooser, switch and fallback; the CPU and one-device paths unchanged.

The stream path itself needs two accelerators: tests/smp_fx/test_cuda.py runs it.
"""

from __future__ import annotations

import logging

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
