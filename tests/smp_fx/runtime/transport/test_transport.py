"""The in-process transport: values cut from autograd, flags kept, strays reported."""

from __future__ import annotations

import pytest
import torch

from smp_fx.runtime.transport.transport import InProcessTransport


def test_in_process_cuts_autograd_and_keeps_flags() -> None:
    tr = InProcessTransport()
    a = torch.ones(2, requires_grad=True) * 2
    tr.send((a, {"n": 3, "b": torch.zeros(1)}), 0, 1, "act", 0)
    got, extra = tr.recv(0, 1, "act", 0)
    assert got.requires_grad and got.is_leaf and got.grad_fn is None
    assert extra["n"] == 3 and not extra["b"].requires_grad
    with pytest.raises(Exception, match="no matching send"):
        tr.recv(0, 1, "act", 0)
    tr.send(1, 0, 1, "act", 1)
    with pytest.raises(Exception, match="never received"):
        tr.finish()
