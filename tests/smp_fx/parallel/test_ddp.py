"""Hybrid pipeline + data parallelism (``ddp: true``, ``smp_fx.parallel.ddp``).

The multi-process test runs 4 gloo ranks as pp=2 x dp=2, "cluster" then "spread"; every
rank feeds its own shard of the global batch, and the trained parameters must equal one
process training the unpartitioned model on the concatenated global batch (fp32). One spawn
runs every scenario one after another (smp is re-initialised in between):

* both placements: overlapped reduction (1F1B) == the global-batch reference, with
  dp_rank 1 starting from other weights (DDP broadcasts dp_rank 0's at partitioning);
  reduction at the end of the step gives bit-identical parameters; an evaluation step
  reduces nothing; user code can all-reduce over ``smp.get_dp_process_group()``;
* cluster: ``backward_passes_per_step=2`` == gradient accumulation over two steps (and
  the gradients really are unreduced after odd steps); ``broadcast_buffers`` on / off;
* spread: ``model.join()`` with one batch fewer on dp_rank 1, against a reference; a
  parameter without a gradient under overlapped reduction is an error on its stage;
* pp=1 x dp=4 (pure data parallelism) == the reference;
* examples/train_mnist.py runs as pp=2 x dp=2, its stage replicas ending equal.

The model is the tiny GPT example, whose tied embedding / LM head sits on both stages, so
the order "dp average, then pipeline sum of the tied replicas" is exercised too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.compare import mismatched, mismatched_across
from tests.helpers.dist import run_ranks
from tests.helpers.models import example
from tests.helpers.reference import train_plain

GLOBAL_BATCH = 8
M = 2  # microbatches per replica step
LR = 0.05


def _init(placement: str, pipeline: str) -> None:
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": M, "pipeline": pipeline,
              "active_microbatches": M, "ddp": True, "placement_strategy": placement})


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches, identical on every rank."""
    ex = example("gpt")
    torch.manual_seed(1234)
    return [(ex.example_inputs(GLOBAL_BATCH)[0], ex.example_targets(GLOBAL_BATCH))
            for _ in range(n)]


def _reductions(model: Any) -> int:
    """How many steps the model's data parallelism reduced on."""
    dp = model.parallelized.data_parallel
    assert dp is not None
    return int(dp.reductions)


def _reference(steps: int, accumulate: int) -> dict[str, torch.Tensor]:
    """One process, the unpartitioned model, the global batches; optimizer step every
    ``accumulate`` batches (gradients summed in between)."""
    ex = example("gpt")
    torch.manual_seed(0)
    ref = ex.build_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    return train_plain(ref, opt, _batches(steps), lambda m, b: ex.loss_fn(m(b[0]), b[1]),
                       accumulate=accumulate).params


def _train(steps: int, accumulate: int, **model_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """smp-fx on this rank's shard of the same batches; returns (model, local params)."""
    import smp_fx as smp

    ex = example("gpt")
    torch.manual_seed(0)
    module = ex.build_model()
    if smp.dp_rank() != 0:  # DDP must broadcast dp_rank 0's weights at partitioning
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
    model = smp.DistributedModel(module, **model_kwargs)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    shard = GLOBAL_BATCH // smp.dp_size()
    lo = smp.dp_rank() * shard
    info: dict[str, Any] = {"grad_spread": []}
    for i, (x, y) in enumerate(_batches(steps)):
        train_step(model, x[lo:lo + shard], y[lo:lo + shard])
        # how far this rank's gradients are from its dp peers' (0 once reduced)
        g = torch.cat([p.grad.reshape(-1) for _, p in sorted(model.local_named_parameters())])
        peers = [torch.empty_like(g) for _ in range(smp.dp_size())]
        dist.all_gather(peers, g, group=smp.get_dp_process_group())
        info["grad_spread"].append(max((q - g).abs().max().item() for q in peers))
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return model, {"params": params, **info}


def _assert_matches(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert params, "this rank holds no parameters"
    assert mismatched(params, ref, atol=1e-5) == []


def _placement(placement: str) -> dict[str, Any]:
    """Every scenario for one placement; runs on every rank."""
    import smp_fx as smp

    out: dict[str, Any] = {}
    # overlapped reduction (1F1B) == the unpartitioned model on the global batch; "spread"
    # uses many tiny buckets and gradients as bucket views
    small = {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True} \
        if placement == "spread" else {}
    _init(placement, "interleaved")
    out["coords"] = (smp.pp_rank(), smp.dp_rank(), smp.get_dp_group())
    ref = _reference(3, 1)
    model, overlap = _train(3, 1, overlapping_allreduce=True, **small)
    dp = model.parallelized.data_parallel
    assert dp is not None and dp.reductions == 3
    assert dp.armed == set(dp.runners)  # reduced inside the last backward
    tied = model.parallelized.tied
    assert tied is not None and tied.groups  # wte / lm_head on both stages: dp avg, pp sum
    _assert_matches(overlap["params"], ref)
    assert max(overlap["grad_spread"]) == 0.0

    # reduction at the end of the step: identical numbers
    _init(placement, "interleaved")
    model, late = _train(3, 1, overlapping_allreduce=False, **small)
    dp = model.parallelized.data_parallel
    assert dp is not None and dp.armed == set()
    assert mismatched(late["params"], overlap["params"]) == []

    # an evaluation step reduces nothing and changes nothing
    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    with torch.no_grad():
        eval_step(model, _batches(1)[0][0][:GLOBAL_BATCH // 2])
    assert dp.reductions == 3
    assert mismatched(dict(model.local_named_parameters()), late["params"]) == []

    # the dp process group is usable by user code
    t = torch.tensor([float(smp.rank())])
    dist.all_reduce(t, group=smp.get_dp_process_group())
    assert t.item() == sum(smp.get_dp_group())

    if placement == "cluster":
        # backward_passes_per_step=2 == gradient accumulation over two steps
        _init(placement, "simple")
        model, bpps = _train(4, 2, backward_passes_per_step=2)
        _assert_matches(bpps["params"], _reference(4, 2))
        spread = bpps["grad_spread"]
        assert spread[0] > 0 and spread[2] > 0, spread  # not reduced after odd steps
        assert spread[1] == 0 and spread[3] == 0, spread
        out["reductions"] = _reductions(model)
        out["buffers_differ"] = [_buffers_scenario(placement, bb) for bb in (True, False)]
    else:
        # uneven inputs: dp_rank 1 runs out one batch early inside model.join()
        out["join"] = _join_scenario(placement)
        out["no_grad_error"] = _no_grad_param_scenario(placement)
    return out


def _buffers_scenario(placement: str, broadcast_buffers: bool) -> list[str]:
    """BatchNorm statistics after a step on different shards, then an evaluation step:
    the buffers that differ across the dp group (none once broadcast from dp_rank 0 at the
    step's start)."""
    import smp_fx as smp

    _init(placement, "simple")
    ex = example("cnn")
    torch.manual_seed(0)
    model = smp.DistributedModel(ex.build_model(), broadcast_buffers=broadcast_buffers)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    torch.manual_seed(10 + smp.dp_rank())  # each replica its own data
    x = ex.example_inputs(4)[0]
    train_step(model, x, ex.example_targets(4))
    model.eval()
    with torch.no_grad():
        eval_step(model, x)
    return mismatched_across(dict(model.local_named_buffers()), smp.get_dp_process_group())


class _DetachedScale(nn.Module):
    """``scale`` is a parameter that never gets a gradient (it is read detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.scale.detach())


def _no_grad_param_scenario(placement: str) -> str:
    """Overlapped reduction with a parameter that gets no gradient: an error, not silently
    unreduced buckets (only on the ranks whose stage holds that parameter)."""
    import smp_fx as smp

    _init(placement, "simple")
    torch.manual_seed(0)
    model = smp.DistributedModel(_DetachedScale())

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    try:
        train_step(model, torch.randn(4, 8))
    except smp.SMPRuntimeError as exc:
        assert "must get a gradient" in str(exc), exc
        return "raised"
    return "ok"


def _body() -> dict[str, Any]:
    """One 4-rank world; smp is re-initialised per placement and scenario."""
    import smp_fx as smp
    from smp_fx.world import state

    dist.init_process_group("gloo")
    out: dict[str, Any] = {p: _placement(p) for p in ("cluster", "spread")}
    # pure data parallelism, pp=1 x dp=4 (the in-process runner path)
    state._reset()
    smp.init({"pipeline_parallel_degree": 1, "microbatches": M, "ddp": True})
    model, pure = _train(3, 1)
    _assert_matches(pure["params"], _reference(3, 1))
    out["pure_dp"] = (smp.dp_size(), _reductions(model))
    state._reset()
    out["example"] = _example_scenario()
    return out


def _example_scenario() -> tuple[int, int, list[str]]:
    """examples/train_mnist.py on these 4 ranks: pp=2 x dp=2, each rank its shard;
    the replicas of each stage end equal. Returns (dp size, steps, the parameters that
    differ across replicas)."""
    from pathlib import Path

    import smp_fx as smp
    from smp_fx.cli.partition import load_model_file

    script = load_model_file(str(Path(__file__).resolve().parents[3] / "examples" /
                                 "train_mnist.py"))
    # the script's model lives in main(); keep it (the process only holds it weakly)
    held: list[Any] = []
    train = script.train
    script.train = lambda model, *rest: (held.append(model), train(model, *rest))[1]
    losses = script.main(["--steps", "4", "--batch-size", "8"])
    assert all(loss == loss for loss in losses)  # finite, not NaN
    model = held[0]
    assert isinstance(model, smp.DistributedModel)
    assert model.parallelized.data_parallel is not None
    return smp.dp_size(), len(losses), mismatched_across(dict(model.local_named_parameters()),
                                                         smp.get_dp_process_group())


def _join_scenario(placement: str) -> list[str]:
    """dp_rank 1 has 2 batches, dp_rank 0 has 3 (both feed the same shard, so the expected
    result is simple): in the third step the joined rank contributes zeros (DDP: the
    average is over the whole group), and afterwards every replica is dp_rank 0's.
    Returns the parameters that differ across replicas."""
    import smp_fx as smp

    _init(placement, "interleaved")
    ex = example("gpt")
    torch.manual_seed(0)
    module = ex.build_model()
    ref = ex.build_model()
    ref.load_state_dict(module.state_dict())
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    batches = [(x[:4], y[:4]) for x, y in _batches(3)]
    with model.join():
        for x, y in (batches if smp.dp_rank() == 0 else batches[:2]):
            train_step(model, x, y)
            opt.step()
            opt.zero_grad()
    train_step(model, *batches[0])  # after join(): ordinary steps again, on every rank
    opt.step()

    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for weight, (x, y) in zip((1.0, 1.0, 0.5, 1.0), [*batches, batches[0]]):
        ref_opt.zero_grad()
        (weight * ex.loss_fn(ref(x), y)).backward()
        ref_opt.step()
    _assert_matches({n: p.detach() for n, p in model.local_named_parameters()},
                    dict(ref.named_parameters(remove_duplicate=False)))
    return mismatched_across(dict(model.local_named_parameters()), smp.get_dp_process_group())


@pytest.mark.multiproc
def test_pp2_dp2_matches_global_batch_cluster_and_spread() -> None:
    results = run_ranks(_body, 4, timeout=300)
    cluster = [r["cluster"] for r in results]
    spread = [r["spread"] for r in results]
    for per_rank in (cluster, spread):
        got = sorted((pp, dp) for pp, dp, _ in (r["coords"] for r in per_rank))
        assert got == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # cluster (DPT): a pipeline on adjacent ranks, dp groups [0, 2], [1, 3]
    assert [r["coords"][0] for r in cluster] == [0, 1, 0, 1]
    assert [r["coords"][2] for r in cluster] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["reductions"] == 2 for r in cluster)
    for r in cluster:  # broadcast: equal; not broadcast: each replica's own statistics
        assert r["buffers_differ"][0] == [], r["buffers_differ"]
        assert r["buffers_differ"][1] and all(n.endswith(("running_mean", "running_var"))
                                              for n in r["buffers_differ"][1]), r
    # spread (TPD): dp groups [0, 1], [2, 3]
    assert [r["coords"][0] for r in spread] == [0, 0, 1, 1]
    assert [r["coords"][2] for r in spread] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["join"] for r in spread] == [[]] * 4
    raised = {r["coords"][0] for r in spread if r["no_grad_error"] == "raised"}
    assert len(raised) == 1, [r["no_grad_error"] for r in spread]  # both dp ranks of a stage
    assert sum(r["no_grad_error"] == "raised" for r in spread) == 2
    assert all(r["pure_dp"] == (4, 3) for r in results)
    assert [r["example"] for r in results] == [(2, 2, [])] * 4


# ---- single-process checks -----------------------------------------------------------
@pytest.fixture()
def one_rank() -> Any:
    """A gloo world of one (so DDP can be constructed) with smp initialised, pp=1, ddp."""
    import smp_fx as smp
    from smp_fx.world import state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state._reset()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    yield smp
    state._reset()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_wrapping_distributed_model_in_torch_ddp_is_rejected(one_rank: Any) -> None:
    smp = one_rank
    model = smp.DistributedModel(nn.Linear(4, 2))
    with pytest.raises(smp.SMPRuntimeError, match="must not be wrapped"):
        nn.parallel.DistributedDataParallel(model)


def test_optimizer_step_inside_step_is_rejected(one_rank: Any) -> None:
    smp = one_rank
    model = smp.DistributedModel(nn.Linear(4, 2))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def bad_step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).sum()
        model.backward(loss)
        opt.step()
        return loss

    @smp.step
    def raw_step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).sum()
        model.backward(loss)
        opt.optimizer.step()  # the wrapped torch optimizer is guarded too
        return loss

    for fn in (bad_step, raw_step):
        with pytest.raises(smp.SMPRuntimeError, match="outside the smp.step"):
            fn(model, torch.randn(2, 4))
    opt.step()  # outside a step it is fine


def test_join_requires_ddp() -> None:
    import smp_fx as smp
    smp.init({"pipeline_parallel_degree": 1})
    model = smp.DistributedModel(nn.Linear(4, 2))
    with pytest.raises(smp.SMPConfigError, match="only with ddp"), model.join():
        pass


def test_buckets_respect_cap_and_order() -> None:
    from smp_fx.parallel.ddp import buckets

    params = [nn.Parameter(torch.zeros(n)) for n in (10, 300_000, 10, 10)]
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    got = buckets([*params, frozen], cap_mb=1.0)  # 1 MiB = 262144 fp32 values
    assert [[id(p) for p in b] for b in got] == \
        [[id(params[3]), id(params[2])], [id(params[1])], [id(params[0])]]



def _doubling_hook(calls, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
    """A DDP communication hook: the average over the group, doubled (unannotated: DDP
    refuses a ``bucket`` annotation other than the GradBucket class itself)."""
    calls.append(1)
    buf = bucket.buffer()
    work = dist.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0] / dist.get_world_size() * 2)


def _comm_hook_scenario() -> dict[str, Any]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = smp.DistributedModel(net)
    calls: list[int] = []
    model.register_comm_hook(calls, _doubling_hook)

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    torch.manual_seed(1)
    x = torch.randn(4, 4)
    train_step(model, x[2 * smp.rank():2 * smp.rank() + 2])
    assert net.weight.grad is not None
    return {"calls": len(calls), "grad": net.weight.grad.tolist()}  # no shared storage


@pytest.mark.multiproc
def test_register_comm_hook_hooks_the_models_ddp() -> None:
    """``DistributedModel.register_comm_hook`` (SMP's page): registered before the first
    step, it hooks the DDP wrapper the build makes; the gradients are what it returns."""
    results = run_ranks(_comm_hook_scenario, 2, timeout=120)
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    torch.manual_seed(1)
    x = torch.randn(4, 4)
    ref(x).pow(2).mean().backward()
    assert ref.weight.grad is not None
    for res in results:
        assert res["calls"] >= 1
        torch.testing.assert_close(torch.tensor(res["grad"]), 2 * ref.weight.grad)


def test_register_comm_hook_needs_the_overlapped_reduction(one_rank: Any) -> None:
    smp = one_rank
    model = smp.DistributedModel(nn.Linear(4, 2), overlapping_allreduce=False)
    with pytest.raises(smp.SMPConfigError, match="overlapping_allreduce=True"):
        model.register_comm_hook(None, _doubling_hook)
