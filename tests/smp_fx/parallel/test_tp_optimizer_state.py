"""The full optimizer ``state_dict()`` at tensor_parallel_degree 2, on 2 gloo ranks.

The GPT-2-style example with a vocabulary of 63 (the tied wte / lm_head padded to 64
rows, 32 per rank; c_attn strided by q/k/v; the MLP pairs), ``prescaled_batch`` false,
3 Adam steps: ``DistributedOptimizer.state_dict()`` gathers each sharded parameter's
moments over the tp group and merges them like the parameter (strides, padding dropped),
so it equals the plain Adam's ``state_dict()`` after the same steps on one process (same
integer ids, fields, shapes, param groups). Loaded back at tp=2 (the plain optimizer's
full state: cut to this rank's shards, padded), one more step equals the plain one's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.reference import train_plain
from tests.smp_fx.parallel.test_tensor_parallel import (
    ADAM_EPS,
    GLOBAL_BATCH,
    _batches,
    _build,
    _loss,
    trainable,
)

KIND = "gpt63"
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _flat(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A torch optimizer state dict as ``{"<id>.<field>": tensor}`` (param groups apart)."""
    return {f"{i}.{k}": torch.as_tensor(v) for i, entry in sd["state"].items()
            for k, v in entry.items()}


def _plain() -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    model = _build(KIND)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    train_plain(model, opt, _batches(KIND), lambda m, b: _loss(KIND, m(b[0]), b[1]))
    return opt.state_dict(), model, opt


def _body() -> dict[str, Any]:
    import smp_fx as smp

    want, plain, plain_opt = _plain()
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": False, "microbatches": 1})
    model, opt, train_step = trainable(KIND)

    share = GLOBAL_BATCH // 2
    lo = smp.tp_rank() * share
    batches = _batches(KIND)
    for x, y in batches:
        train_step(model, x[lo:lo + share], y[lo:lo + share])
        opt.step()
        opt.zero_grad()
    got = opt.state_dict()
    bad = [f"state {n}" for n in mismatched(_flat(got), _flat(want), **TOL)]
    if got["param_groups"] != want["param_groups"]:
        bad.append("param_groups")
    if sorted(got["state"]) != sorted(want["state"]):
        bad.append(f"state ids {sorted(got['state'])}")
    # the plain optimizer's full state loads at tp=2 (cut to shards, padded); one more
    # step (the first batch again) then equals the plain model's
    opt.load_state_dict(copy.deepcopy(want))  # as from a file: plain_opt steps ``want``
    model.load_state_dict(plain.state_dict())
    x, y = batches[0]
    train_step(model, x[lo:lo + share], y[lo:lo + share])
    opt.step()
    _loss(KIND, plain(x), y).backward()
    plain_opt.step()
    bad += [f"after load {n}" for n in mismatched(model.state_dict(), plain.state_dict(),
                                                  atol=1e-4, rtol=1e-4)]
    bad += [f"state after load {n}" for n in mismatched(_flat(opt.state_dict()),
                                                        _flat(plain_opt.state_dict()), **TOL)]
    return {"bad": bad, "sharded": len(model.tp_plan.sharded)}


@pytest.mark.multiproc
def test_full_optimizer_state_dict_at_tp2_equals_the_plain_optimizers() -> None:
    results = run_ranks(_body, 2, timeout=180, env={"SMP_FX_DEVICE_SPEC": "a100"})
    for rank, res in enumerate(results):
        assert isinstance(res, dict), f"rank {rank}: {res}"
        assert res["bad"] == [], f"rank {rank}: {res['bad']}"
        assert res["sharded"] > 10  # wte/lm_head, every block's attention and MLP
