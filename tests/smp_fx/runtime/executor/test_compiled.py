"""Compiled stages equal one process: the example GPT and Hugging Face Llama at pp 2 on 2 gloo
processes, under 1F1B, interleaved v = 2, ZB-V, interleaved zero bubble v = 2 and (GPT) ZB-H1,
compiled (``compile``): the loss of every step, every gradient after every step and the
``state_dict()`` after 3 Adam steps within 1e-5 of the plain model trained in one process.

Most cases use ``aot_eager``: the same capture and AOTAutograd function as inductor without
generating C++ (inductor costs ~30 s per stage on 2 cores); one GPT case runs inductor.
Under a split backward the chunk whose inputs need no gradient is compiled whole, the others
whole with their GEMMs' weight gradients deferred to W (``deferred_gemms``; its own tests);
the regions between eager GEMMs (``compiled_regions``), which a stage with checkpointed
regions rebuilt once takes, are tested here on their own. In bf16 and in fp16 (loss
scaling), compiled steps give the eager steps' losses. One spawn runs every case in turn.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

from examples.models import hf_zoo
from smp_fx.runtime.executor.compiled import (
    CompiledStage,
    CompileStats,
    compile_in_regions,
    compile_stages,
    unalias_gradients,
)
from smp_fx.runtime.executor.compiled_regions import CompiledRegions
from smp_fx.runtime.executor.seams import StageRunner
from tests.helpers import zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks
from tests.helpers.models import example
from tests.helpers.reference import train_plain

BATCH, STEPS, MICROBATCHES = 4, 3, 2
TOL = {"atol": 1e-5, "rtol": 1e-5}
GPT = {"n_layer": 4}
# (model, pipeline, virtual_pipeline_degree, backend)
CASES = (("gpt", "interleaved", 2, "aot_eager"),
         ("llama", "interleaved", 1, "aot_eager"), ("llama", "interleaved", 2, "aot_eager"),
         ("llama", "zbv", 2, "aot_eager"), ("gpt", "zbv", 2, "aot_eager"),
         ("llama", "zero_bubble", 2, "aot_eager"), ("gpt", "zero_bubble", 2, "aot_eager"),
         ("gpt", "zero_bubble", 1, "aot_eager"), ("gpt", "interleaved", 1, "inductor"))


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def _model(arch: str) -> nn.Module:
    if arch == "gpt":
        torch.manual_seed(0)
        return example("gpt").build_model(**GPT)
    return hf_zoo.build(arch, marked=False)


def _batches(arch: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    if arch != "gpt":
        return zoo.batches(arch, BATCH, STEPS)
    ex = example("gpt")
    torch.manual_seed(1234)
    return [(ex.example_inputs(BATCH), ex.example_targets(BATCH)) for _ in range(STEPS)]


def _loss(arch: str, out: Any, y: torch.Tensor) -> torch.Tensor:
    return example("gpt").loss_fn(out, y) if arch == "gpt" else hf_zoo.loss_fn(out, y)


def _batch_loss(arch: str, model: nn.Module, batch: Any) -> torch.Tensor:
    return _loss(arch, model(*batch[0]), batch[1])


def _references(path: Path, cases: tuple[tuple[str, str, int, str], ...] = CASES) -> None:
    refs = {}
    for arch in sorted({a for a, *_ in cases}):
        model = _model(arch)
        run = train_plain(model, _adam(model.parameters()), _batches(arch),
                          functools.partial(_batch_loss, arch))
        refs[arch] = (run.losses, [{n: g for n, g in s.items() if g is not None}
                                   for s in run.grads], run.state)
    torch.save(refs, path)


def _train_step(arch: str) -> Any:
    import smp_fx as smp

    @smp.step
    def train_step(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
        loss = _loss(arch, model(*x), y)
        model.backward(loss)
        return loss

    return train_step


def _train_and_compare(tag: str, arch: str, model: Any, opt: Any, train_step: Any,
                       ref_losses: list[float], ref_grads: list[dict[str, torch.Tensor]],
                       gather: Any = None) -> list[str]:
    """Train on ``_batches``: each step's loss and gradients (``gather``: the full ones
    from this rank's shards) against the one-process run's; the mismatches."""
    bad: list[str] = []
    for step, (x, y) in enumerate(_batches(arch)):
        opt.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        if not torch.allclose(loss, torch.tensor(ref_losses[step]), rtol=1e-5, atol=1e-5):
            bad.append(f"{tag}: loss step {step} {loss.item()} != {ref_losses[step]}")
        grads = {n: p.grad for n, p in model.local_named_parameters() if p.grad is not None}
        if gather is not None:
            grads = gather(model, grads)
        bad += [f"{tag}: grad {n} step {step}" for n in mismatched(grads, ref_grads[step], **TOL)]
        opt.step()
    return bad


def _case(arch: str, pipeline: str, v: int, backend: str, ref: Any,
          microbatches: int = MICROBATCHES) -> list[str]:
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": microbatches,
              "pipeline": pipeline, "virtual_pipeline_degree": v, "compile": backend})
    model = smp.DistributedModel(_model(arch))
    opt = smp.DistributedOptimizer(_adam(model.parameters()))
    train_step = _train_step(arch)

    tag = f"{arch} {pipeline} v={v} {backend}"
    ref_losses, ref_grads, ref_state = ref
    bad = _train_and_compare(tag, arch, model, opt, train_step, ref_losses, ref_grads)
    bad += [f"{tag}: {m}" for m in state_dict_mismatches(model.state_dict(), ref_state, **TOL)]
    stats = model.parallelized.compiled
    for s, st in stats.items():
        deferred = pipeline in ("zbv", "zero_bubble") and s != 0  # GEMMs' dW deferred to W
        if (st.fallback is not None or st.recompiles or st.regions or st.compiles != 1
                or deferred != (st.deferred > 0)
                or deferred != (st.region_params > 0)):  # a norm's weight: its gradient in I
            bad.append(f"{tag}: stage {s}: {st.summary()}, {st.compiles} compiles")
    return bad


def _half_losses(backend: str, precision: str) -> tuple[list[float], dict[int, CompileStats]]:
    """The GPT example's losses over 3 Adam steps in ``precision`` (bf16 or fp16, fp32
    masters; fp16 with SMP's loss scaling), 1F1B."""
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
              "pipeline": "interleaved", precision: True, "compile": backend})
    model = smp.DistributedModel(_model("gpt"))
    opt = smp.DistributedOptimizer(_adam(model.parameters()))
    train_step = _train_step("gpt")

    losses = []
    for x, y in _batches("gpt"):
        opt.zero_grad()
        losses.append(float(train_step(model, x, y).reduce_mean()))
        opt.step()
    return losses, dict(model.parallelized.compiled)


def _half_cases() -> list[str]:
    """bf16 and fp16 compiled (aot_eager: the eager kernels, no fusion) give eager's losses."""
    bad = []
    for precision in ("bf16", "fp16"):
        eager, _ = _half_losses("none", precision)
        compiled, stats = _half_losses("aot_eager", precision)
        bad += [f"{precision}: loss step {i} {c} != {e}"
                for i, (c, e) in enumerate(zip(compiled, eager)) if abs(c - e) > 1e-5 * abs(e)]
        bad += [f"{precision}: stage {s} {st}" for s, st in stats.items()
                if st.compiles != 1 or st.fallback is not None]
    return bad


def _all_cases(path: str, cases: tuple[tuple[str, str, int, str], ...] = CASES,
               half: bool = True, microbatches: int = MICROBATCHES) -> list[str]:
    """Every case in turn on one gloo world (and ``_half_cases``): the mismatches."""
    from smp_fx.world import state

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    refs = torch.load(path, weights_only=True)
    try:
        return [b for arch, pipeline, v, backend in cases
                for b in _case(arch, pipeline, v, backend, refs[arch], microbatches)] + (
                    _half_cases() if half else [])
    finally:
        state._reset()


@pytest.mark.multiproc
def test_compiled_stages_equal_one_process(tmp_path: Path) -> None:
    path = tmp_path / "references.pt"
    _references(path)
    assert run_ranks(_all_cases, 2, str(path), timeout=600) == [[], []]


def _compile_warnings() -> list[str]:
    """The ``smp_fx.compile`` log's warnings from now on, as they are said."""
    told: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: told.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("smp_fx.compile").addHandler(handler)
    return told


def _composed() -> tuple[tuple[int, list[str]], list[str], list[str]]:
    import torch._dynamo.utils

    from smp_fx.world import state
    from tests.helpers.compare import Checks
    from tests.smp_fx.test_schedules_compose import _adam, _tp_case

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    told = _compile_warnings()
    graphs = torch._dynamo.utils.counters["stats"]
    c = Checks()
    try:
        before = graphs["unique_graphs"]
        _adam(c, "interleaved", 1, shard_optimizer_state=True, compile="aot_eager")
        c.expect(graphs["unique_graphs"] > before, "ddp, ZeRO-1, checkpointing: compiled")
        before = graphs["unique_graphs"]
        bad = _tp_case("interleaved", 1, compile="aot_eager")
        c.expect(graphs["unique_graphs"] > before, "tp: compiled")
        quiet = len(told)
        _adam(c, "zbv", 2, compile="aot_eager")  # ddp after W; chunks in regions
        c.expect(all("recompute_once" in t for t in told[quiet:]),  # rebuilt once: eager
                 f"zbv: only the checkpointed regions told eager {told[quiet:]}")
        del told[quiet:]
        t = _adam(c, "zbv", 2, checkpointed=False, shard_optimizer_state=True,
                  compile="aot_eager")  # ddp and ZeRO-1 after W from the deferred GEMMs' sinks
        stats = t.dm.parallelized.compiled
        c.expect(all((st.deferred > 0) == (s != 0) and st.fallback is None
                     for s, st in stats.items()), f"zbv: deferred {stats}")
    finally:
        state._reset()
    return c.report(), bad, told


@pytest.mark.multiproc
def test_compiled_stages_with_data_tensor_parallelism_and_checkpointing() -> None:
    """pp 2 x dp 2 with ddp, ZeRO-1 and activation checkpointing (the GPT example's blocks),
    the same under ZB-V, and without checkpointing (its GEMMs deferred), and pp 2 x tp 2, all
    compiled, against one process
    (``test_schedules_compose``'s runs); the tensor-parallel collectives trace into the
    stage's graph (no fallback told); under ZB-V only the checkpointed blocks run eagerly."""
    assert run_ranks(_composed, 4, timeout=600) == [((25, []), [], [])] * 4


class _Breaks(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        print("a graph break")  # dynamo cannot put a print in a graph
        return (x * 2,)


def test_a_graph_break_runs_eagerly_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    stats = CompileStats(0)
    stage = CompiledStage(_Breaks(), "eager", stats)
    with caplog.at_level(logging.WARNING, "smp_fx.compile"):
        (out,) = stage(torch.ones(2))
        (again,) = stage(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))
    torch.testing.assert_close(again, out)
    assert stats.fallback is not None and "print" in stats.fallback
    assert sum("stage 0 runs eagerly" in r.message for r in caplog.records) == 1


class _Scale(nn.Module):  # a code object of its own: dynamo's cache and limit are per code
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


class _Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_recompiles_are_counted_per_stage() -> None:
    stats = CompileStats(3)
    stage = CompiledStage(_Scale(), "eager", stats)
    for rows in (2, 3, 5, 7):  # the second shape recompiles with a dynamic dimension
        stage(torch.ones(rows, 4))
    assert (stats.compiles, stats.recompiles, stats.fallback) == (2, 1, None)


class _Cube(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * x * x).sum(dim=-1)


@pytest.mark.multiproc
def test_a_stage_compiles_without_aot_autograds_cache() -> None:
    """Its lazily compiled backward saving a cache entry can crash the process (PyTorch issue
    #177442): with the cache on for the process, a compiled stage neither reads nor writes
    it, and its gradients are eager's."""
    from torch._dynamo.utils import counters

    def cache_events() -> dict[str, int]:
        return {k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k}

    x = torch.randn(3, 5, requires_grad=True)
    want = torch.autograd.grad(_Cube()(x).sum(), x)[0]
    with torch._functorch.config.patch(enable_autograd_cache=True), \
            torch._inductor.config.patch(fx_graph_cache=True):
        before = cache_events()
        stats = CompileStats(0)
        out = CompiledStage(_Cube(), "inductor", stats)(x)
        got = torch.autograd.grad(out.sum(), x)[0]  # the backward compiles here
        assert cache_events() == before
    assert stats.compiles == 1 and stats.fallback is None
    torch.testing.assert_close(got, want)


def test_the_recompile_limit_runs_the_stage_eagerly() -> None:
    stats = CompileStats(1)
    stage = CompiledStage(_Shift(), "eager", stats)
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        outs = [stage(torch.ones(rows, 4)) for rows in (2, 3, 5)]
    assert stats.compiles == 2 and stats.fallback is not None
    assert "FailOnRecompileLimitHit" in stats.fallback and outs[2].shape == (5, 4)


@torch.fx.wrap
def _noisy(x: torch.Tensor) -> torch.Tensor:
    print("a graph break in a region")  # dynamo cannot put a print in a graph
    return x * 2


class _Block(nn.Module):
    """Two GEMMs, a norm and an activation between them, a residual; ``noisy``: a graph
    break in the region between the GEMMs."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        h = torch.nn.functional.gelu(self.up(self.ln(x)))
        return (x + self.down(_noisy(h) if self.noisy else h),)


class _Runner(StageRunner):
    def __init__(self, module: nn.Module) -> None:
        gm = torch.fx.symbolic_trace(module)
        super().__init__(type("Stage", (), {"recvs": ((0, ("x",)),), "module": gm})(),
                         torch.device("cpu"))


@pytest.mark.parametrize("noisy", [False, True])
def test_a_split_backward_stage_compiles_in_regions_with_eager_gemms(noisy: bool) -> None:
    """Its I gives the input gradient with the norm's parameters' (read in a compiled
    region), W the GEMMs' from their joins: together the plain backward's."""
    torch.manual_seed(0)
    plain = _Block(noisy)
    runners: Any = {0: _Runner(_Block(noisy)), 1: _Runner(_Block(noisy))}
    for r in runners.values():
        r.stage.module.load_state_dict(plain.state_dict())
    runners[0].stage.recvs = ()
    stats = compile_stages({0: runners[0]}, "aot_eager", "zero_bubble")
    assert isinstance(runners[0].module, CompiledStage) and not stats[0].regions
    r, st = runners[1], CompileStats(1, params=6)
    assert compile_in_regions(r, "aot_eager", st) is None  # as a stage rebuilt once is
    assert isinstance(r.module, CompiledRegions) and st.fallback is None
    assert (len(st.regions), st.params, st.region_params) == (3, 6, 2)  # ln's weight, bias

    for rows in (4, 6):  # the second recompiles with a dynamic dimension
        x, g = torch.randn(rows, 8, requires_grad=True), torch.randn(rows, 8)
        (out,) = r.forward([x], 0)
        (gx,), pending = r.backward_input([out], [g], [x], 0)
        assert [p.shape for _, p in pending.shared] == [(8,), (8,)]  # the norm's, from I
        assert sorted(len(j.params) for j in pending.joins) == [2, 2]  # GEMMs' weight, bias
        r.backward_weight(pending, 0)
        x0 = x.detach().requires_grad_()
        (expected,) = plain(x0)
        expected.backward(g)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(gx, x0.grad)
        for (name, p), q in zip(r.stage.module.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert [rs.fallback is not None for rs in st.regions] == [False, noisy, False]
    assert (st.compiles, st.recompiles, st.eager_regions) == (6 - 2 * noisy, 3 - noisy, noisy)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.proj(x),)


def test_a_stage_of_one_gemm_says_it_compiled_nothing_under_a_split_backward() -> None:
    """A chunk holding a GEMM alone (a language model's head on a random cut) has no region
    to compile: its summary says so rather than "compiled whole", and nothing falls back."""
    runner, st = _Runner(_Head()), CompileStats(1, params=2)
    assert compile_in_regions(runner, "aot_eager", st) is None
    x = torch.randn(4, 8, requires_grad=True)
    (out,) = runner.forward([x], 0)
    (_,), pending = runner.backward_input([out], [torch.ones_like(out)], [x], 0)
    runner.backward_weight(pending, 0)
    assert (st.fallback, st.regions, st.gemms, st.compiles) == (None, [], 1, 0)
    assert st.summary() == ("stage 1: 0 regions compiled, 0 eager, 1 GEMMs eager; parameters "
                            "0 compiled, 2 eager")
    assert CompileStats(0, params=3).summary() == (
        "stage 0: nothing compiled yet, 3 parameters (not run, or no tensor operation reached "
        "the compiler)")


class _AliasedGradients(torch.autograd.Function):
    """``a + b`` whose backward hands ``b``'s gradient in ``a``'s memory, as AOTAutograd's
    compiled backward may (a view of another output, not tracked as one), and no gradient
    for ``c`` (autograd then calls ``c``'s hooks with None)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        base = g.sum(0)
        return base, base.detach().view(1, -1), None


@pytest.mark.parametrize("order", ["a first", "b first"])
def test_gradients_in_one_memory_are_accumulated_apart(order: str) -> None:
    a, b, c = (nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1, 3)),
               nn.Parameter(torch.zeros(2)))
    stats = CompileStats(0)
    unalias_gradients([a, b, c] if order == "a first" else [c, b, a], stats)
    for k in (1.0, 2.0):  # two microbatches: the second accumulates into .grad
        (_AliasedGradients.apply(a, b, c) * torch.full((2, 3), k)).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((3,), 6.0))
    torch.testing.assert_close(b.grad, torch.full((1, 3), 6.0))
    assert c.grad is None
    assert stats.unaliased == 1  # the first microbatch's; the second adds in place
    assert "1 gradients copied" in stats.summary()


def test_gradients_in_their_own_memory_are_not_copied() -> None:
    lin = nn.Linear(3, 3)
    stats = CompileStats(0)
    unalias_gradients(list(lin.parameters()), stats)
    for _ in range(3):
        lin.zero_grad()
        for _ in range(2):
            lin(torch.randn(2, 3)).sum().backward()
    assert stats.unaliased == 0


def test_sparse_gradients_are_left_alone() -> None:
    emb = nn.Embedding(8, 3, sparse=True)
    stats = CompileStats(0)
    unalias_gradients(list(emb.parameters()), stats)
    for _ in range(2):
        emb(torch.tensor([1, 2, 1])).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    assert stats.unaliased == 0
