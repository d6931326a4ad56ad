"""DistributedModel: before/after partitioning, hooks, local views, placement, options."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.config import IMPLEMENTED, PARAMS
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.models import example
from tests.helpers.numerics import Pair, init


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 2))


@pytest.fixture
def fresh(one_thread: None) -> None:
    init(2, 2, "simple")


@smp.step
def _step(model: Any, x: torch.Tensor) -> Any:
    seen.append(smp.is_tracing())
    out = model(x)
    model.backward(out.sum())
    return out


seen: list[bool] = []


def test_lifecycle(fresh: None) -> None:
    net = _net()
    model = smp.DistributedModel(net)
    assert [p for p in model.parameters()] == [p for p in net.parameters()]
    assert model.to("cuda") is model and model.cuda() is model and not model.partitioned
    calls: list[Any] = []
    model.register_post_partition_hook(lambda m: calls.append(("one", m.partitioned)))
    handle = model.register_post_partition_hook(lambda m, opt: calls.append("removed"))
    handle.remove()
    seen.clear()
    _step(model, torch.randn(4, 4))
    assert model.partitioned and calls == [("one", True)]
    assert seen[0] is True and seen[1:] == [False, False]  # traced on the first microbatch
    assert {n for n, _ in model.local_named_parameters()} == {n for n, _ in
                                                              net.named_parameters()}
    assert {n for n, _ in model.local_named_modules()} >= {"0", "2", "4"}
    assert model.get_module() is net and model.cpu() is net
    _step(model, torch.randn(4, 4))
    assert calls == [("one", True)]  # partitioned once


def test_option_checks(fresh: None) -> None:
    with pytest.raises(smp.SMPConfigError, match="trace_device"):
        smp.DistributedModel(_net(), trace_device="tpu")
    with pytest.raises(smp.SMPConfigError, match="trace_execution_times"):
        smp.DistributedModel(_net(), trace_device="cpu", trace_execution_times=True)
    with smp.delay_param_initialization():
        delayed = _net()
    with pytest.raises(smp.SMPConfigError, match="delay_param_initialization"):
        smp.DistributedModel(delayed, trace_memory_usage=True)
    model = smp.DistributedModel(_net(), bucket_cap_mb=50, broadcast_buffers=False)
    assert model.options.bucket_cap_mb == 50 and not model.options.broadcast_buffers


def test_train_eval_reach_the_stages(fresh: None) -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    model = smp.DistributedModel(net)
    _step(model, torch.randn(4, 4))
    model.eval()

    @smp.step
    def ev(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    x = torch.randn(4, 4)
    with torch.no_grad():
        a, b = ev(model, x).concat(), ev(model, x).concat()
    torch.testing.assert_close(a, b)  # dropout off in eval mode
    torch.testing.assert_close(a, net(x))


def _tied_body() -> dict[str, Any]:
    """GPT example over 2 processes: the tied embedding/LM head lives on both ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(2, 2, "interleaved")
    pair = Pair("gpt", batch=4)
    pair.compare(2, 2)
    names = {n for n, _ in pair.dm.local_named_parameters()}
    full = pair.dm.cpu()
    cpu_mismatched = mismatched(dict(full.named_parameters()),
                                dict(pair.ref.named_parameters()), atol=1e-6, rtol=1e-5)
    # two steps without zero_grad: the tied gradient accumulates exactly as in the plain
    # model (earlier, already summed gradients are not summed over the owners again)
    pair.reset()
    for _ in range(2):
        pair.ref_step(2)
        pair.train_step(pair.dm, *pair.x, pair.y)
    ref_grads = {n: p.grad for n, p in pair.ref.named_parameters(remove_duplicate=False)}
    accum_mismatched = mismatched({n: p.grad for n, p in pair.dm.local_named_parameters()},
                                  ref_grads, atol=1e-5, rtol=1e-5)
    return {"names": names & {"wte.weight", "lm_head.weight"},
            "groups": len(_tied_groups(pair.dm)), "cpu_mismatched": cpu_mismatched,
            "accum_mismatched": accum_mismatched}


def _tied_groups(dm: Any) -> list[Any]:
    tied = dm.parallelized.tied
    return [] if tied is None else list(tied.groups)


@pytest.mark.multiproc
def test_tied_parameters_across_processes() -> None:
    r0, r1 = run_ranks(_tied_body, 2, timeout=180)
    # the last stage reads the tied weight as lm_head.weight, but names it as plain
    # named_parameters() does: by its first registration
    assert r0["names"] == r1["names"] == {"wte.weight"}
    assert r0["groups"] == r1["groups"] == 1
    assert r0["cpu_mismatched"] == r1["cpu_mismatched"] == []
    assert r0["accum_mismatched"] == r1["accum_mismatched"] == []


def _delayed_body() -> list[float]:
    """GPT built under delay_param_initialization, 2 processes: only the local stage is
    materialised, with the eager build's values bitwise, and the tied embedding/LM head
    replicas start (and stay) equal."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(2, 2, "interleaved")
    ex = example("gpt")
    torch.manual_seed(0)
    eager = dict(ex.build_model().named_parameters(remove_duplicate=False))
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        net = ex.build_model()
    model = smp.DistributedModel(net)
    wrong: list[str] = []  # filled once materialised: "checked", then any mismatch
    model.register_post_partition_hook(lambda m: wrong.extend(["checked", *(
        n for n, p in m.local_named_parameters() if not torch.equal(p, eager[n]))]))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    for _ in range(2):
        opt.zero_grad()
        train(model, ex.example_inputs(4)[0], ex.example_targets(4))
        opt.step()
    local = dict(model.local_named_parameters())
    assert local and wrong == ["checked"]
    assert not any(p.is_meta for p in local.values())
    assert any(p.is_meta for p in net.parameters())  # the other stage was never allocated
    tied = local.get("wte.weight", local.get("lm_head.weight"))
    return tied.detach().flatten()[:8].tolist()


@pytest.mark.multiproc
def test_delayed_init_materialises_per_stage() -> None:
    a, b = run_ranks(_delayed_body, 2, timeout=180)
    assert a == b


def test_delayed_init_in_process_keeps_ties(fresh: None) -> None:
    ex = example("gpt")
    with smp.delay_param_initialization():
        net = ex.build_model()
    model = smp.DistributedModel(net)

    @smp.step
    def train(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    train(model, ex.example_inputs(4)[0], ex.example_targets(4))
    assert net.lm_head.weight is net.wte.weight and not net.wte.weight.is_meta
    assert net.wte.weight.grad is not None


def test_measured_costs_plan_and_numerics(fresh: None) -> None:
    """trace_execution_times / trace_memory_usage: the plan is made from measured costs
    (times differ from the analytic ones), and training still matches the plain model:
    every step's outputs and gradients, and the parameters after each optimizer step."""
    torch.manual_seed(0)
    net = _net()
    ref = _net()
    ref.load_state_dict(net.state_dict())
    measured = smp.DistributedModel(net, trace_execution_times=True, trace_memory_usage=True)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = {"atol": 1e-5, "rtol": 1e-5}
    for step in range(3):
        x = torch.randn(4, 4)
        opt.zero_grad()
        ref_opt.zero_grad()
        out = _step(measured, x).concat()
        want = ref(x)
        (want.sum() / 2).backward()  # the step's backward, averaged over its 2 microbatches
        torch.testing.assert_close(out, want, **tol, msg=lambda m, s=step: f"step {s}: {m}")
        got_grads = {n: p.grad for n, p in measured.local_named_parameters()}
        assert set(got_grads) == {n for n, _ in ref.named_parameters()}  # both stages here
        assert mismatched(got_grads, {n: p.grad for n, p in ref.named_parameters()},
                          **tol) == [], step
        opt.step()
        ref_opt.step()
        assert mismatched(dict(measured.local_named_parameters()),
                          dict(ref.named_parameters()), **tol) == [], step
    x = torch.randn(4, 4)
    analytic = smp.DistributedModel(_net())
    _step(analytic, x)
    times = [s.time_s for s in measured.plan.stages]
    assert times != [s.time_s for s in analytic.plan.stages]


def test_partitioning_traces_once(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph traced for measuring is the one costed, planned and split: the compile
    pipeline never runs its own trace pass for the runtime."""
    import passes.pipeline

    def second_trace(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the compile pipeline traced the model again")

    monkeypatch.setattr(passes.pipeline, "trace", second_trace)
    model = smp.DistributedModel(_net(), trace_execution_times=True)
    _step(model, torch.randn(4, 4))
    assert model.partitioned and model.plan is not None
def test_plan_device_from_the_environment(fresh: None, tmp_path: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """SMP_FX_DEVICE_SPEC names the spec the runtime plans for: a built-in or a file."""
    import dataclasses
    import json

    from cost_model.devices import H100

    path = tmp_path / "spec.json"
    path.write_text(json.dumps(dataclasses.replace(H100, name="box").to_json()))
    for value, name in ((str(path), "box"), ("v100", "v100")):
        monkeypatch.setenv("SMP_FX_DEVICE_SPEC", value)
        model = smp.DistributedModel(_net())
        _step(model, torch.randn(4, 4))
        assert model.plan.spec().name == name
    monkeypatch.setenv("SMP_FX_DEVICE_SPEC", str(tmp_path / "nope.json"))
    with pytest.raises(smp.SMPConfigError, match="SMP_FX_DEVICE_SPEC"):
        _step(smp.DistributedModel(_net()), torch.randn(4, 4))


def test_unimplemented_configured_feature_is_an_error_at_wrap() -> None:
    planned = [p for p in PARAMS if p.status != IMPLEMENTED and p.used_at == "DistributedModel"
               and p.kind is bool]
    if not planned:
        pytest.skip("every DistributedModel feature is built")
    name = planned[0].name
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, name: True})
    with pytest.raises(smp.SMPNotImplementedError, match=name):
        smp.DistributedModel(_net())


class _SharedFirst(nn.Module):
    """A weight registered first as ``shared.weight`` (as T5's) and read only by the last
    stage, through its alias ``lm_head.weight`` (the first stage embeds with its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 8)
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(ids)))


def test_names_are_plain_named_parameters_names(fresh: None) -> None:
    plain = _SharedFirst()
    model = smp.DistributedModel(plain)
    names = [n for n, _ in plain.named_parameters()]
    assert names[0] == "shared.weight"
    assert [n for n, _ in model.named_parameters()] == names  # no "module." prefix, as SMP

    @smp.step
    def fwd(model: Any, ids: torch.Tensor) -> Any:
        return model(ids)

    with torch.no_grad():
        fwd(model, torch.randint(0, 16, (4, 3)))
    stages = [{n for n, _ in s.module.named_parameters()} for s in model.program.stages]
    assert "lm_head.weight" in stages[-1]  # the stage holds it by the alias it reads
    assert "shared.weight" not in set().union(*stages)
    local = [n for n, _ in model.local_named_parameters()]
    assert sorted(local) == sorted(names)
    decay = {n for n in names if n.endswith("weight")}  # a name-based parameter group
    assert {n for n, _ in model.local_named_parameters() if n in decay} == decay


def test_post_step_hook_runs_once_after_the_next_step(fresh: None) -> None:
    model = smp.DistributedModel(_net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[tuple[Any, Any, bool]] = []
    model.register_post_step_hook(lambda m, o: calls.append((m, o, m.partitioned)))
    removed = model.register_post_step_hook(lambda m, o: calls.append(("removed", o, False)))
    removed.remove()
    x = torch.randn(4, 4)
    _step(model, x)
    assert calls == [(model, opt, True)]
    _step(model, x)
    assert len(calls) == 1  # once
    model.register_post_step_hook(lambda m, o: calls.append((m, o, True)))
    _step(model, x)
    assert len(calls) == 2


def test_state_dict_gather_to_rank0_and_same_partition_load(fresh: None) -> None:
    torch.manual_seed(0)
    model = smp.DistributedModel(_net())
    _step(model, torch.randn(4, 4))
    full = model.state_dict(gather_to_rank0=True)  # one process: it is pipeline rank 0
    assert list(full) == list(_net().state_dict())
    other = smp.DistributedModel(_net())
    _step(other, torch.randn(4, 4))
    other.load_state_dict(model.local_state_dict(), same_partition_load=True)
    for (n, a), (_, b) in zip(model.local_named_parameters(), other.local_named_parameters()):
        torch.testing.assert_close(a, b, msg=n)
    with pytest.raises(smp.SMPCheckpointError, match="takes only gather_to_rank0"):
        model.state_dict(prefix="x")


def test_wrapping_the_same_module_again_gives_the_same_model(fresh: None) -> None:
    """The Hugging Face Trainer wraps its base model again for every evaluation."""
    net = _net()
    model = smp.DistributedModel(net, backward_passes_per_step=2)
    _step(model, torch.randn(4, 4))
    plan = model.plan
    again = smp.DistributedModel(net, backward_passes_per_step=2)
    assert again is model and again.partitioned and again.plan is plan
    _step(again, torch.randn(4, 4))  # the step finds the model it is given
    with pytest.raises(smp.SMPConfigError, match="called again on the module it wraps"):
        smp.DistributedModel(net)
    other = smp.DistributedModel(_net())
    assert other is not model and not other.partitioned


class _Rooted(nn.Module):
    """A parameter on the root, a LayerNorm and linears: what the Trainer's weight-decay
    walk tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.inp(x * self.scale))))


def test_walks_by_name_see_the_wrapped_module_as_root(fresh: None) -> None:
    """pp 2 in-process, before and after partitioning: transformers' weight-decay names on
    the model are the plain module's (LayerNorm's left out by type, the root's parameter
    kept), ``named_modules()`` names modules as the module does, and ``train``/``apply``
    still reach the module itself."""
    from transformers.trainer_pt_utils import get_parameter_names

    net = _Rooted()
    model = smp.DistributedModel(net)
    decay = get_parameter_names(net, [nn.LayerNorm])
    assert "scale" in decay and "norm.weight" not in decay
    for when in ("before", "after"):
        assert get_parameter_names(model, [nn.LayerNorm]) == decay, when
        assert [(n, type(m)) for n, m in model.named_modules()][1:] == [
            (n, type(m)) for n, m in net.named_modules()][1:], when
        assert _names_walked(model, when) == []
        _step(model, torch.randn(4, 4))
    model.eval()
    assert not net.training and not any(m.training for m in model.local_modules())
    model.train()
    assert net.training and model.training
    visited: list[nn.Module] = []
    model.apply(visited.append)
    assert visited[-1] is model and net in visited and net.norm in visited
    assert list(model.children()) == list(net.children())


# tp 2 (shards replace the module's parameters), pp 2 (tied replicas), sdp 2 (FSDP2 shards)
WALK_CONFIGS = ({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True},
                {"pipeline_parallel_degree": 2, "microbatches": 2},
                {"pipeline_parallel_degree": 1, "sharded_data_parallel_degree": 2,
                 "sdp_param_persistence_threshold": 1, "ddp": True})


def _walks(cfg: dict[str, Any]) -> list[str]:
    """After one step: every parameter this rank trains is in ``parameters()`` and has a
    gradient; none keeps it after ``model.zero_grad()``; ``requires_grad_`` and ``eval``
    reach them and their modules."""
    from smp_fx.parallel import ds_view
    from smp_fx.world import state
    from tests.smp_fx.parallel.test_tensor_parallel import MLP

    state._reset()
    smp.init(cfg)
    torch.manual_seed(0)
    model = smp.DistributedModel(MLP())
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    step(model, torch.randn(8, 8))
    tag, bad = str(cfg), []
    trained = dict(model.local_named_parameters())
    # under sdp the original object stands for its shard (SMP's DeepSpeed view reads it)
    walked = {id(getattr(p, ds_view.SOURCE, p)) for p in model.parameters()}
    bad += [f"{tag}: {n} not in parameters()" for n, p in trained.items() if id(p) not in walked]
    bad += [f"{tag}: {n} no gradient" for n, p in trained.items() if p.grad is None]
    model.zero_grad()
    bad += [f"{tag}: {n} kept its gradient" for n, p in trained.items() if p.grad is not None]
    model.requires_grad_(False)
    bad += [f"{tag}: {n} still requires grad" for n, p in trained.items() if p.requires_grad]
    model.requires_grad_(True)
    model.eval()
    bad += [f"{tag}: {type(m).__name__} training" for m in model.local_modules() if m.training]
    return bad + _names_walked(model, tag)


def _names_walked(model: Any, tag: str) -> list[str]:
    """transformers' ``get_parameter_names`` (the Trainer's weight-decay walk over
    ``named_children()`` and ``_parameters``) gives ``named_parameters()``' names, and
    ``model.module.named_parameters()`` (SMP's wrapper) the same tensors; ``get_parameter``
    and ``get_submodule`` read those names."""
    from transformers.trainer_pt_utils import get_parameter_names

    named = list(model.named_parameters())
    walked = get_parameter_names(model, [])
    bad = [f"{tag}: get_parameter_names {sorted(set(walked) ^ {n for n, _ in named})}"
           ] if sorted(walked) != sorted(n for n, _ in named) else []
    bad += [f"{tag}: get_parameter({n!r}) is another tensor" for n, p in named
            if model.get_parameter(n) is not p]
    bad += [f"{tag}: get_submodule({n!r})" for n, m in model.named_modules()
            if model.get_submodule(n) is not m]
    view = [(n, id(p)) for n, p in model.module.named_parameters()]
    return bad + ([f"{tag}: model.module walks other tensors"]
                  if view != [(n, id(p)) for n, p in named] else [])


def _walks_body() -> list[str]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return [b for cfg in WALK_CONFIGS for b in _walks(cfg)]


@pytest.mark.multiproc
def test_module_walks_reach_every_trained_parameter() -> None:
    assert run_ranks(_walks_body, 2, timeout=180) == [[], []]
