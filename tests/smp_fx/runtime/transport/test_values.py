"""The output copies: the tuple-of-tensors path and the pytree path give the same copies."""

from __future__ import annotations

import torch

from smp_fx.runtime.transport.values import sent_copy, user_copy


def _outputs() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(3, 4, requires_grad=True)
    return torch.randn(2, 4) @ w.t(), torch.arange(6).view(2, 3)


def test_sent_copy_detaches_and_keeps_requires_grad_on_both_paths() -> None:
    outs = _outputs()
    for copied, originals in ((sent_copy(outs), outs), (sent_copy(([*outs],))[0], outs)):
        for c, o in zip(copied, originals):
            torch.testing.assert_close(c, o.detach())
            assert c.requires_grad == o.requires_grad
            assert c.grad_fn is None
            assert c.data_ptr() != o.data_ptr()


def test_sent_copy_is_immune_to_in_place_changes() -> None:
    outs = _outputs()
    copied = sent_copy(outs)
    with torch.no_grad():
        outs[0].mul_(0)
    assert copied[0].abs().sum() > 0


def test_user_copy_is_tracked_and_distinct_on_both_paths() -> None:
    cut = sent_copy(_outputs())
    for copied in (user_copy(cut), user_copy({"out": cut})["out"]):
        assert isinstance(copied, tuple)
        for c, o in zip(copied, cut):
            torch.testing.assert_close(c, o)
            assert c.data_ptr() != o.data_ptr()
            assert (c.grad_fn is not None) == o.requires_grad
    with torch.no_grad():  # the step function's grad mode does not untrack the copy
        assert user_copy(cut)[0].grad_fn is not None
