"""Checkpoints across pipeline stages: on real ranks, and the mixins against stand-ins.

* On real ranks (gloo processes via tests/helpers/dist.py, ``multiproc``): smp.save /
  smp.load over real model-parallel groups, called by dp_rank 0 only (the pattern of SMP's
  documentation) and loaded at another pipeline degree; the runtime's DistributedModel and
  DistributedOptimizer trained, saved, resumed and resharded.
* In one process, no ranks: the checkpoint mixins against ``FakeModel`` and
  ``FakeOptimizer``, stand-ins that hold only what the mixins read. What they fake: the
  stages (a set of local names per "stage" instead of a partitioned program) and the
  optimizer's binding to the model at partitioning (``FakeOptimizer.localize`` keeps the
  local parameters in the param groups, as the runtime's binding does). The runtime's own
  binding is what the real-rank tests above and tests/smp_fx/test_optimizer.py exercise.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.files import merge_partial_objects
from smp_fx.ckpt.layout import read_index
from smp_fx.ckpt.mixins import ModelCheckpointMixin, OptimizerCheckpointMixin
from smp_fx.ckpt.state_dict import (
    ModelLayout,
    merge_model_state_dicts,
    merge_optimizer_state_dicts,
)
from smp_fx.ckpt.view import CheckpointView, Ranks
from tests.helpers.ckpt import STAGES_2, STAGES_3, Tied, assert_same, plain_setup
from tests.helpers.dist import run_ranks
from tests.helpers.models import example


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
    # the runtime with two model replicas: full state dicts gathered on dp_rank 0 only
    model, opt, run = _fresh(*_runtime_classes())
    run(range(1))
    n_keys = n_state = -1
    if smp.dp_rank() == 0:
        n_keys, n_state = len(model.state_dict()), len(opt.state_dict()["state"])
    smp.barrier()
    return {"pp": smp.pp_rank(), "dp": smp.dp_rank(), "keys": sorted(loaded["model_state_dict"]),
            "step": loaded["step"], "full_from": full["pp"], "full": (n_keys, n_state)}


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
        expected = (2 * (MLP_KW["num_blocks"] + 1),) * 2 if res["dp"] == 0 else (-1, -1)
        assert res["full"] == expected
    assert {r["pp"] for r in out} == {0, 1}
    merged = run_ranks(_load_at_pp1, 1, prefix, timeout=60)[0]
    assert merged == ["stage0.weight", "stage1.weight"]


# ---- the checkpoint mixins against stand-ins of the runtime's contract (one process) -----


class FakeModel(ModelCheckpointMixin, nn.Module):
    """The runtime facts the model mixin uses: module, partitioned, local_named_*, hooks."""

    def __init__(self, module: nn.Module, local: set[str] | None = None) -> None:
        super().__init__()
        self.module = module
        self.partitioned = False
        self.local = local
        self.hooks: list[Any] = []
        self.optimizers: list[FakeOptimizer] = []

    def get_module(self) -> nn.Module:
        return self.module

    def checkpoint_view(self) -> CheckpointView:
        return CheckpointView(Ranks(), ModelLayout.from_module(self.module))

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

    def local_unread_state(self) -> dict[str, torch.Tensor]:
        return {}


class FakeOptimizer(OptimizerCheckpointMixin):
    """The runtime facts the optimizer mixin uses: optimizer (also its torch_optimizer),
    global_index, _localized.

    Faked: the binding to the model. ``localize`` (called by ``FakeModel.partition``) drops
    the parameters the stage does not hold from the param groups, the effect of the
    runtime's binding, without its mapping of re-created parameters by name."""

    model: FakeModel | None = None

    @staticmethod
    def _smp_current_model() -> Any:
        return FakeOptimizer.model

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = self.torch_optimizer = optimizer
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


# ---- with the runtime: train 3 steps, save, fresh processes load, train 3 more ----------

MLP_KW = {"in_features": 8, "hidden": 16, "num_classes": 4, "num_blocks": 4}


def _runtime_classes() -> tuple[type, type]:
    """DistributedModel/Optimizer with the checkpoint mixins (composed here until the
    runtime classes inherit them; then they are used as they are)."""
    from smp_fx.model import DistributedModel
    from smp_fx.optimizer import DistributedOptimizer

    model_cls = DistributedModel if issubclass(DistributedModel, ModelCheckpointMixin) else \
        type("DistributedModel", (ModelCheckpointMixin, DistributedModel), {})
    opt_cls = DistributedOptimizer if issubclass(DistributedOptimizer, OptimizerCheckpointMixin) \
        else type("DistributedOptimizer", (OptimizerCheckpointMixin, DistributedOptimizer), {})
    return model_cls, opt_cls


def _batch(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        return torch.randint(0, 7, (8,), generator=g), torch.randint(0, 7, (8,), generator=g)
    return (torch.randn(8, MLP_KW["in_features"], generator=g),
            torch.randint(0, MLP_KW["num_classes"], (8,), generator=g))


def _fresh(model_cls: type, opt_cls: type, kind: str = "mlp") -> tuple[Any, Any, Any]:
    """A DistributedModel + Adam: the MLP example, or ``tied`` (embedding tied to the head,
    replicated on two stages at pp=2)."""
    import smp_fx as smp

    mlp = example("mlp")
    torch.manual_seed(0)
    model = model_cls(Tied() if kind == "tied" else mlp.build_model(**MLP_KW))
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    def run(steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            train_step(model, *_batch(step, kind))
            opt.step()

    return model, opt, run


def _plain_state(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, list[list[str]]]:
    """A plainly trained model and Adam state (tied: two param groups), seeded."""
    if kind == "tied":
        return plain_setup()
    torch.manual_seed(0)
    net = example("mlp").build_model(**MLP_KW)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(_batch(step, kind)[0]), _batch(step, kind)[1]) \
            .backward()
        opt.step()
    return net, opt, [[n for n, _ in net.named_parameters()]]


def _plain_round_trip(model_cls: type, opt_cls: type, kind: str, delayed: bool) -> list[str]:
    """Plain model + plain Adam state -> DistributedModel/Optimizer (loaded before
    partitioning) -> full state_dict(): must equal the plain ones exactly. The tied model
    must give back both tied names; ``delayed`` builds the model on the meta device
    (smp.delay_param_initialization). Returns the mismatches (none expected)."""
    import smp_fx as smp

    plain, plain_opt, full = _plain_state(kind)
    plain_sd, plain_osd = plain.state_dict(), plain_opt.state_dict()
    torch.manual_seed(7)
    with smp.delay_param_initialization(enabled=delayed):
        net = Tied() if kind == "tied" else example("mlp").build_model(**MLP_KW)
    model = model_cls(net)
    named = dict(net.named_parameters())
    groups = [{"params": [named[n] for n in g]} for g in full]
    if len(groups) > 1:
        groups[1]["lr"] = 0.01  # as plain_setup's second group
    opt = opt_cls(torch.optim.Adam(groups, lr=0.5 if kind == "tied" else 0.01))
    model.load_state_dict(plain_sd)
    opt.load_state_dict(plain_osd)

    @smp.step
    def evaluate(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    model.eval()
    with torch.no_grad():
        evaluate(model, _batch(0, kind)[0][:4])  # partitions; deferred loads apply
    problems = []
    for name, (got, want) in {"model": (dict(model.state_dict()), dict(plain_sd)),
                              "optimizer": (opt.state_dict(), plain_osd)}.items():
        try:
            assert_same(got, want)
        except AssertionError as exc:
            problems.append(f"{name} ({kind}, delayed={delayed}): {exc}")
    return problems


def _train_and_save(pp: int, prefix: str) -> list[str]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2})
    # delayed init with the tied model across processes hangs in the runtime (see report)
    problems = [p for kind, delayed in (("tied", False), ("mlp", True)) if pp == 2
                for p in _plain_round_trip(*_runtime_classes(), kind, delayed)]
    for kind in ("mlp", "tied") if pp == 2 else ("mlp",):
        model, opt, run = _fresh(*_runtime_classes(), kind)
        run(range(3))
        path = prefix if kind == "mlp" else prefix + ".tied"
        if smp.dp_rank() == 0:
            smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, path)
            smp.save({"model": model.state_dict(), "opt": opt.state_dict()}, path + ".full",
                     partial=False)
    return problems


def _resume(pp: int, jobs: list[tuple[str, bool, str]]) -> bytes:
    """For each (prefix, partial, kind): fresh model, load before the first step, 3 more
    steps; and the uninterrupted 6-step run of each kind at this degree. Returns the full
    state dicts as torch.save bytes (tensors through the result queue need the rank alive)."""
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2})
    classes = _runtime_classes()
    out: dict[str, Any] = {}
    for prefix, partial, kind in jobs:
        model, opt, run = _fresh(*classes, kind)
        ckpt = smp.load(prefix, partial=partial)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        run(range(3, 6))
        out[f"{prefix}:{partial}"] = (_to_cpu(model.state_dict()), _to_cpu(opt.state_dict()))
    for kind in sorted({k for _, _, k in jobs}):
        model, opt, run = _fresh(*classes, kind)
        run(range(6))
        out[f"reference:{kind}"] = (_to_cpu(model.state_dict()), _to_cpu(opt.state_dict()))
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


def _to_cpu(value: Any) -> Any:
    from smp_fx.ckpt.mixins import _to_cpu as to_cpu

    return to_cpu(value)


def _assert_exact(got: tuple[Any, Any], want: tuple[Any, Any]) -> None:
    assert list(got[0]) == list(want[0])
    torch.testing.assert_close(dict(got[0]), dict(want[0]), rtol=0, atol=0)
    assert got[1]["param_groups"] == want[1]["param_groups"]
    torch.testing.assert_close(got[1]["state"], want[1]["state"], rtol=0, atol=0)


def _check_cli_merge_matches_full(prefix: str, out: str) -> None:
    """``smp-fx checkpoint merge`` of the runtime's partial files equals its full checkpoint
    and loads into the plain model and the plain Adam without smp-fx."""
    from smp_fx.cli.main import main

    assert main(["checkpoint", "merge", prefix, "-o", out]) == 0
    merged = torch.load(out, weights_only=True)
    full = torch.load(prefix + ".full", weights_only=True)
    assert_same(dict(merged["model"]), dict(full["model"]))
    assert_same(merged["opt"], full["opt"])
    net = example("mlp").build_model(**MLP_KW)
    net.load_state_dict(merged["model"], strict=True)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    opt.load_state_dict(merged["opt"])
    assert_same(opt.state_dict(), full["opt"])


@pytest.mark.multiproc
def test_resume_same_degree_and_reshard(tmp_path: Path) -> None:
    a, b = str(tmp_path / "pp2.pt"), str(tmp_path / "pp4.pt")
    assert run_ranks(_train_and_save, 2, 2, a, timeout=120) == [[], []]
    _check_cli_merge_matches_full(a, str(tmp_path / "merged.pt"))
    run_ranks(_train_and_save, 4, 4, b, timeout=150)
    t = a + ".tied"
    at_pp2 = _unpack(run_ranks(_resume, 2, 2, [(a, True, "mlp"), (a + ".full", False, "mlp"),
                                               (b, True, "mlp"), (t, True, "tied"),
                                               (t + ".full", False, "tied")], timeout=150)[0])
    ref = at_pp2["reference:mlp"]
    _assert_exact(at_pp2[f"{a}:True"], ref)  # partial, same degree
    _assert_exact(at_pp2[f"{a}.full:False"], ref)  # full, same degree
    _assert_exact(at_pp2[f"{b}:True"], ref)  # partial saved at pp=4, loaded at pp=2
    _assert_exact(at_pp2[f"{t}:True"], at_pp2["reference:tied"])  # tied, replicated weight
    _assert_exact(at_pp2[f"{t}.full:False"], at_pp2["reference:tied"])
    assert "head.weight" in at_pp2[f"{t}:True"][0]  # saved under both tied names
    at_pp1 = _unpack(run_ranks(_resume, 1, 1, [(a, True, "mlp")], timeout=120)[0])
    _assert_exact(at_pp1[f"{a}:True"], at_pp1["reference:mlp"])  # partial pp=2 -> pp=1


@pytest.mark.multiproc
def test_in_process_pipeline_resume(tmp_path: Path) -> None:
    """One process running both stages (pp=2 in-process) saves one partial file; a fresh
    process resumes exactly (and the plain round trips hold in this mode too)."""
    a = str(tmp_path / "inproc.pt")
    assert run_ranks(_train_and_save, 1, 2, a, timeout=120) == [[]]
    index = read_index(a)
    assert index is not None and (index["pp_degree"], index["num_files"]) == (2, 1)
    res = _unpack(run_ranks(_resume, 1, 2, [(a, True, "mlp"), (a + ".tied", True, "tied")],
                            timeout=120)[0])
    _assert_exact(res[f"{a}:True"], res["reference:mlp"])
    _assert_exact(res[f"{a}.tied:True"], res["reference:tied"])
