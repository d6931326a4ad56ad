"""``passes.tensor_parallel.collectives`` on 2 gloo ranks: the sequence-parallel collectives move
what they say forward and backward, and the reduce-scatter gives the same sums with the
backend's own collective and with the all-reduce-and-slice it falls back to; a sequence
that does not divide over the group is refused on every rank before any collective."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_ranks


def _rank_checks() -> dict[str, Any]:
    from cost_model.errors import SMPRuntimeError
    from passes import axis_groups
    from passes.tensor_parallel import collectives as c

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    axis_groups.bind("tp", None, 2, rank)
    x = (torch.arange(24.0).reshape(2, 4, 3) + 100 * rank).requires_grad_()
    out: dict[str, Any] = {}
    native = c._reduce_scatter(x.detach(), 1)
    c._NATIVE_REDUCE_SCATTER[str(dist.get_backend())] = False
    out["same_sums"] = torch.equal(native, c._reduce_scatter(x.detach(), 1))
    c._NATIVE_REDUCE_SCATTER.clear()
    total = torch.arange(24.0).reshape(2, 4, 3) * 2 + 100
    out["reduce_scatter"] = torch.equal(native, total.chunk(2, 1)[rank])
    y = c.tp_seq_gather(x, 1)  # forward: both ranks' chunks; backward: summed, own chunk
    y.backward(torch.ones_like(y) * (rank + 1))
    out["gather_shape"] = tuple(y.shape)
    out["gather_grad"] = torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    z = c.tp_scatter(x, 1)  # forward: own chunk; backward: the chunks' gradients gathered
    z.backward(torch.ones_like(z))
    out["scatter"] = torch.equal(z.detach(), x.detach().chunk(2, 1)[rank])
    out["scatter_grad"] = torch.equal(x.grad, torch.ones_like(x))
    odd = torch.ones(2, 5, 3)  # a length that does not divide over tp 2: refused on each
    out["refused"] = []  # rank before the collective (gloo aborted the process on it)
    for chunk in (c.tp_seq_reduce_scatter, c.tp_scatter):
        try:
            chunk(odd, 1)
        except SMPRuntimeError as exc:
            out["refused"].append("pad_to_multiple_of=2" in str(exc))
    dist.barrier()  # still in step: no collective was left half done
    axis_groups.bind("tp", None, 1, 0)
    return out


@pytest.mark.multiproc
def test_sequence_collectives_and_reduce_scatter_fallback() -> None:
    for res in run_ranks(_rank_checks, 2, timeout=60):
        assert res == {"same_sums": True, "reduce_scatter": True, "gather_shape": (2, 8, 3),
                       "gather_grad": True, "scatter": True, "scatter_grad": True,
                       "refused": [True, True]}
