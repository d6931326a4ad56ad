"""Multi-process checkpoint tests (gloo, real ranks via tests/helpers/dist.py).

File-level: smp.save / smp.load over real model-parallel groups, called by dp_rank 0 only
(the seed's pattern), and loaded at another pipeline degree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cost_model.errors import SMPCheckpointError
from smp_fx.checkpoint import merge_partial_objects
from smp_fx.checkpoint_api import ModelCheckpointMixin, OptimizerCheckpointMixin
from smp_fx.state_dict import ModelLayout, merge_model_state_dicts, merge_optimizer_state_dicts
from tests.helpers.dist import run_ranks
from tests.smp_fx.test_state_dict import STAGES_2, STAGES_3, Tied, assert_same, plain_setup


def _stage_state(pp_rank: int) -> dict[str, Any]:
    return {f"stage{pp_rank}.weight": torch.full((3,), float(pp_rank + 1)),
            "_smp_is_partial": True}


def _save_then_load(prefix: str) -> dict[str, Any]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 2, "ddp": True})
    if smp.dp_rank() == 0:  # only one model replica saves: a collective of its mp group
        smp.save({"model_state_dict": _stage_state(smp.pp_rank()), "step": 3}, prefix)
        smp.save({"full": True, "pp": smp.pp_rank()}, prefix + ".full", partial=False)
    smp.barrier()
    loaded = smp.load(prefix)  # every rank loads its mp rank's file
    full = smp.load(prefix + ".full", partial=False)
    return {"pp": smp.pp_rank(), "keys": sorted(loaded["model_state_dict"]),
            "step": loaded["step"], "full_from": full["pp"]}


def _load_at_pp1(prefix: str) -> list[str]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 1})
    loaded = smp.load(prefix)
    return [k for k in loaded["model_state_dict"] if k != "_smp_is_partial"]


@pytest.mark.multiproc
def test_dp0_saves_partial_every_rank_loads_then_pp1_merges(tmp_path: Path) -> None:
    prefix = str(tmp_path / "checkpoint.pt")
    out = run_ranks(_save_then_load, 4, prefix, timeout=90)
    for res in out:
        assert res["keys"] == ["_smp_is_partial", f"stage{res['pp']}.weight"]
        assert res["step"] == 3 and res["full_from"] == 0  # mp rank 0 wrote the full file
    assert {r["pp"] for r in out} == {0, 1}
    merged = run_ranks(_load_at_pp1, 1, prefix, timeout=60)[0]
    assert merged == ["stage0.weight", "stage1.weight"]


# ---- the checkpoint mixins against a minimal stand-in of the runtime's contract ---------


class FakeModel(ModelCheckpointMixin, nn.Module):
    """The runtime facts the model mixin uses: module, partitioned, local_named_*, hooks."""

    def __init__(self, module: nn.Module, local: set[str] | None = None) -> None:
        super().__init__()
        self.module = module
        self.partitioned = False
        self.local = local
        self.hooks: list[Any] = []
        self.optimizers: list[FakeOptimizer] = []

    def register_post_partition_hook(self, hook: Any) -> None:
        self.hooks.append(hook)

    def partition(self) -> None:
        self.partitioned = True
        for opt in self.optimizers:
            opt.localize(self)
        for hook in self.hooks:
            hook(self)

    def _named(self, items: Any) -> Any:
        return ((n, t) for n, t in items if self.local is None or n in self.local)

    def local_named_parameters(self) -> Any:
        return self._named(self.module.named_parameters())

    def local_named_buffers(self) -> Any:
        return self._named(self.module.named_buffers())


class FakeOptimizer(OptimizerCheckpointMixin):
    """The runtime facts the optimizer mixin uses: optimizer, global_index, _localized."""

    model: FakeModel | None = None

    @staticmethod
    def _smp_current_model() -> Any:
        return FakeOptimizer.model

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        self.global_index = {id(p): i for i, p in enumerate(flat)}
        self._localized = False
        if self.model is not None:
            self.model.optimizers.append(self)

    def localize(self, model: FakeModel) -> None:
        local = {id(p) for _, p in model.local_named_parameters()}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
        self._localized = True


def _wrapped(local: set[str] | None, seed: int) -> tuple[FakeModel, FakeOptimizer]:
    torch.manual_seed(seed)
    net = Tied()
    model = FakeModel(net, local)
    FakeOptimizer.model = model
    named = dict(net.named_parameters())
    g0 = ["emb.weight", "body.0.weight", "body.0.bias"]
    groups = [{"params": [named[n] for n in g0]},
              {"params": [p for n, p in named.items() if n not in g0], "lr": 0.01}]
    return model, FakeOptimizer(torch.optim.Adam(groups, lr=0.1))


BUFFERS = {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}
LOCAL = [STAGES_2[0] | BUFFERS, STAGES_2[1]]


def test_mixins_full_state_equals_plain_and_deferred_loads_apply() -> None:
    plain, plain_opt, _ = plain_setup()
    plain_sd, plain_osd = plain.state_dict(), plain_opt.state_dict()
    stages = [_wrapped(local, seed=1 + i) for i, local in enumerate(LOCAL)]
    for model, opt in stages:  # before partitioning: deferred, as SMP does
        model.load_state_dict(plain_sd)
        opt.load_state_dict(plain_osd)
        assert not torch.equal(model.module.body[0].weight, plain.body[0].weight)  # deferred
        model.partition()
    parts = [m.local_state_dict() for m, _ in stages]
    assert_same(dict(merge_model_state_dicts(parts, ModelLayout.from_module(plain))),
                dict(plain_sd))
    assert_same(merge_optimizer_state_dicts([o.local_state_dict() for _, o in stages]),
                plain_osd)
    # in-process (every stage local): state_dict() is the plain one, no gather needed
    model, opt = _wrapped(None, seed=5)
    model.partition()
    model.load_state_dict(plain_sd)
    opt.load_state_dict(plain_osd)
    assert_same(dict(model.state_dict()), dict(plain_sd))
    assert_same(opt.state_dict(), plain_osd)


def test_mixins_reshard_partial_and_strict_errors() -> None:
    plain, plain_opt, _ = plain_setup()
    src = [_wrapped(local, seed=1) for local in LOCAL]
    for model, opt in src:
        model.partition()
        model.load_state_dict(plain.state_dict())
        opt.load_state_dict(plain_opt.state_dict())
    merged_model = merge_partial_objects([m.local_state_dict() for m, _ in src])
    merged_opt = merge_partial_objects([o.local_state_dict() for _, o in src])
    # load the union of two partials into three stages (a different pipeline degree)
    three = [STAGES_3[0], STAGES_3[1] | BUFFERS, STAGES_3[2]]
    dst = [_wrapped(local, seed=9) for local in three]
    for model, opt in dst:
        model.partition()
        model.load_state_dict(merged_model)
        opt.load_state_dict(merged_opt)
    assert_same(merge_optimizer_state_dicts([o.local_state_dict() for _, o in dst]),
                plain_opt.state_dict())
    full = merge_model_state_dicts([m.local_state_dict() for m, _ in dst])
    assert_same({k: full[k] for k in plain.state_dict()}, dict(plain.state_dict()))
    model, _ = _wrapped(STAGES_3[0], seed=2)
    model.partition()
    with pytest.raises(SMPCheckpointError, match="strict"):
        model.load_state_dict(src[1][0].local_state_dict())  # lacks body.0.weight
    bad = dict(plain.state_dict(), **{"body.0.weight": torch.zeros(3, 3)})
    with pytest.raises(SMPCheckpointError, match="shape"):
        model.load_state_dict(bad)
    with pytest.raises(SMPCheckpointError, match="unexpected"):
        model.load_state_dict(dict(plain.state_dict(), extra=torch.ones(1)))
    with pytest.raises(SMPCheckpointError, match="partitioned"):
        _wrapped(None, seed=3)[0].local_state_dict()
